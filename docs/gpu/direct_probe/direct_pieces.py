"""Cold cost of each piece of a direct 64 KiB h2d copy against a bare one, each after 5 ms asleep
(run on the H200 at 1dd229b, 2026-12-01 ~21:11 UTC; output: direct_pieces.json)."""

import json
import os
import sys
import time

import cupy as cp

sys.path.insert(0, os.getcwd())
import priod
from priod.direct import DirectCopies
from priod.engines.cuda._driver import DeviceScope, bindings, check
from priod.testing import daemon_process, percentile

rt, _ = bindings()
N = int(os.environ.get("N", "300"))
n = 64 << 10
host = cp.cuda.alloc_pinned_memory(16 << 20)
dev = cp.cuda.alloc(16 << 20)
hp, dp = host.ptr, dev.ptr
pc = time.perf_counter
res: dict[str, list[float]] = {k: [] for k in ("bare", "direct", "p_scope", "p_begin", "p_memcpy", "p_wait", "p_end", "bare_memcpy", "bare_wait")}
with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    dc = DirectCopies(c.hold_page())
    pair = dc.pair((dp, 16 << 20), (hp, 16 << 20))
    stream = dc._streams.get(0) or dc._stream(0)
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    ok = dc._ok
    for i in range(N + 10):
        time.sleep(0.005)
        t0 = pc()
        pair.copy(n)
        t1 = pc()
        if i >= 10:
            res["direct"].append((t1 - t0) * 1e6)
        time.sleep(0.005)
        # bare: the same calls without scope or page
        t0 = pc()
        check(rt.cudaMemcpyAsync(dp, hp, n, kind, stream))
        t1 = pc()
        while rt.cudaStreamQuery(stream)[0] is not ok:
            pass
        t2 = pc()
        if i >= 10:
            res["bare"].append((t2 - t0) * 1e6)
            res["bare_memcpy"].append((t1 - t0) * 1e6)
            res["bare_wait"].append((t2 - t1) * 1e6)
        time.sleep(0.005)
        # the pieces of the direct path, timed one by one
        t0 = pc()
        scope = DeviceScope(0)
        scope.__enter__()
        t1 = pc()
        dc.page.begin(pair._slot)
        t2 = pc()
        check(rt.cudaMemcpyAsync(dp, hp, n, kind, stream))
        t3 = pc()
        dc._wait(stream)
        t4 = pc()
        dc.page.end(pair._slot)
        scope.__exit__(None, None, None)
        t5 = pc()
        if i >= 10:
            for k, a, b in (("p_scope", t0, t1), ("p_begin", t1, t2), ("p_memcpy", t2, t3), ("p_wait", t3, t4), ("p_end", t4, t5)):
                res[k].append((b - a) * 1e6)
    dc.close()
with open(os.path.join(os.environ.get("OUT", "."), "direct_pieces.json"), "w") as f:
    json.dump(res, f)
for k, v in res.items():
    print(f"{k:<12} p50 {percentile(v, 50):7.1f} p90 {percentile(v, 90):7.1f} p99 {percentile(v, 99):7.1f}")
