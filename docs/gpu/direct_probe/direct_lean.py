"""A/B (run on the H200 2026-12-01 ~21:13 UTC at 1dd229b plus DeviceScope.one_gpu, "before"; ~21:14 with
the committed direct path, "after"): the direct copy as committed, a lean one (no scope object,
hold-page words written inline), and a bare cudaMemcpyAsync + spin, interleaved, after 5 ms asleep."""
import json
import os
import sys
import time

import cupy as cp

sys.path.insert(0, os.getcwd())
import priod
from priod.direct import WORDS_PER_SLOT, DirectCopies
from priod.engines.cuda._driver import bindings, check
from priod.testing import daemon_process, percentile

rt, _ = bindings()
N = int(os.environ.get("N", "400"))
host = cp.cuda.alloc_pinned_memory(16 << 20)
dev = cp.cuda.alloc(16 << 20)
hp, dp = host.ptr, dev.ptr
pc = time.perf_counter
res: dict = {}


def lean(pair, n):
    owner = pair._owner
    page, slot = owner.page, pair._slot
    stream = owner._streams[0]
    with page._lock:
        b = page._begun[slot] = page._begun[slot] + 1
        page._words[slot * WORDS_PER_SLOT] = b
    try:
        err = owner._rt.cudaMemcpyAsync(pair.dst, pair.src, n, owner._default, stream)[0]
        if err is not owner._ok:
            check((err,))
        owner._wait(stream)
    finally:
        with page._lock:
            e = page._ended[slot] = page._ended[slot] + 1
            page._words[slot * WORDS_PER_SLOT + 1] = e
    return n


with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    dc = DirectCopies(c.hold_page())
    pair = dc.pair((dp, 16 << 20), (hp, 16 << 20))
    stream = dc._streams.get(0) or dc._stream(0)
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    ok = dc._ok
    for n in (64 << 10, 1 << 20):
        for i in range(N + 10):
            for variant in ("cur", "lean", "bare") if i % 2 else ("bare", "lean", "cur"):
                time.sleep(0.005)
                t0 = pc()
                if variant == "bare":
                    check(rt.cudaMemcpyAsync(dp, hp, n, kind, stream))
                    while rt.cudaStreamQuery(stream)[0] is not ok:
                        pass
                elif variant == "lean":
                    lean(pair, n)
                else:
                    pair.copy(n)
                t = (pc() - t0) * 1e6
                if i >= 10:
                    res.setdefault(f"{n >> 10}K {variant}", []).append(t)
    dc.close()
with open(os.path.join(os.environ.get("OUT", "."), "direct_lean.json"), "w") as f:
    json.dump(res, f)
for k, v in res.items():
    print(f"{k:<14} p50 {percentile(v, 50):7.1f} p90 {percentile(v, 90):7.1f} p99 {percentile(v, 99):7.1f}")
