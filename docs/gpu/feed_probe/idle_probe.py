"""An idle link: 64 KiB copies 5 ms apart, in-process (CuPy buffers, as bench_gpu.py's idle-5ms
and direct-idle rows use). Which of the direct path's ways costs what: cudaMemcpyDefault against
an explicit kind, spinning on cudaStreamQuery against cudaStreamSynchronize, and what the 5 ms of
sleep before a copy costs against 5 ms of spinning."""
import os, sys, time, json
import numpy as np
sys.path.insert(0, os.getcwd())
import cupy as cp
from priod.engines.cuda._driver import bindings, check
rt, drv = bindings()
ok = rt.cudaError_t.cudaSuccess
KiB = 1024
N = 64 * KiB
host = cp.cuda.alloc_pinned_memory(1 << 20); dev = cp.cuda.alloc(1 << 20)
_, high = check(rt.cudaDeviceGetStreamPriorityRange())
cupy_stream = cp.cuda.Stream(non_blocking=True, priority=high)
own_stream = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, high))
kinds = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost}
default = rt.cudaMemcpyKind.cudaMemcpyDefault

def once(direction, kind, stream, wait):
    dst, src = (dev.ptr, host.ptr) if direction == "h2d" else (host.ptr, dev.ptr)
    t0 = time.perf_counter()
    check(rt.cudaMemcpyAsync(dst, src, N, kind, stream))
    if wait == "sync":
        check(rt.cudaStreamSynchronize(stream))
    else:
        while rt.cudaStreamQuery(stream)[0] != ok:
            pass
    return (time.perf_counter() - t0) * 1e6

def series(direction, kind, stream, wait, gap, count=150, warm=5):
    lat = []
    for i in range(warm + count):
        t = once(direction, kind, stream, wait)
        if i >= warm:
            lat.append(t)
        if gap == "sleep":
            time.sleep(0.005)
        elif gap == "spin":
            end = time.perf_counter() + 0.005
            while time.perf_counter() < end:
                pass
    return lat

variants = [
    ("explicit, cupy stream, sync, sleep (idle-5ms)", "explicit", "cupy", "sync", "sleep"),
    ("explicit, cupy stream, query spin, sleep", "explicit", "cupy", "query", "sleep"),
    ("default, own stream, query spin, sleep (direct)", "default", "own", "query", "sleep"),
    ("explicit, own stream, query spin, sleep", "explicit", "own", "query", "sleep"),
    ("default, own stream, sync, sleep", "default", "own", "sync", "sleep"),
    ("explicit, cupy stream, sync, spin gap", "explicit", "cupy", "sync", "spin"),
    ("default, own stream, query spin, spin gap", "default", "own", "query", "spin"),
    ("explicit, cupy stream, sync, no gap", "explicit", "cupy", "sync", None),
]
out = {}
for _round in range(2):
    for direction in ("h2d", "d2h"):
        for name, k, s, w, g in variants:
            kind = kinds[direction] if k == "explicit" else default
            stream = cupy_stream.ptr if s == "cupy" else own_stream
            lat = series(direction, kind, stream, w, g)
            out.setdefault(f"{direction} {name}", []).extend(lat)
for key, lat in out.items():
    print(f"{key:58s} p50 {np.percentile(lat,50):6.1f} p99 {np.percentile(lat,99):6.1f} us")
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "idle_probe.json"), "w"))
