"""A/B (run on the H200, 2026-12-01 ~21:12 UTC, on a tree where DeviceScope kept a class flag
`_one_gpu`, since replaced by `one_gpu()`): a direct 64 KiB h2d copy with DeviceScope asking cudaGetDevice (as before) and without
(one GPU), and a bare cudaMemcpyAsync + spin, interleaved, each after 5 ms asleep."""
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
N = int(os.environ.get("N", "400"))
host = cp.cuda.alloc_pinned_memory(16 << 20)
dev = cp.cuda.alloc(16 << 20)
hp, dp = host.ptr, dev.ptr
pc = time.perf_counter
res: dict = {}
with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    dc = DirectCopies(c.hold_page())
    pair = dc.pair((dp, 16 << 20), (hp, 16 << 20))
    stream = dc._streams.get(0) or dc._stream(0)
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    ok = dc._ok
    for n in (64 << 10, 1 << 20):
        for i in range(N + 10):
            for variant in ("scope", "noscope", "bare") if i % 2 else ("bare", "noscope", "scope"):
                time.sleep(0.005)
                if variant == "bare":
                    t0 = pc()
                    check(rt.cudaMemcpyAsync(dp, hp, n, kind, stream))
                    while rt.cudaStreamQuery(stream)[0] is not ok:
                        pass
                else:
                    DeviceScope._one_gpu = variant == "noscope"
                    t0 = pc()
                    pair.copy(n)
                t = (pc() - t0) * 1e6
                if i >= 10:
                    res.setdefault(f"{n >> 10}K {variant}", []).append(t)
    dc.close()
with open(os.path.join(os.environ.get("OUT", "."), "direct_ab.json"), "w") as f:
    json.dump(res, f)
for k, v in res.items():
    print(f"{k:<14} p50 {percentile(v, 50):7.1f} p90 {percentile(v, 90):7.1f} p99 {percentile(v, 99):7.1f}")
