"""Where a direct batch by the copy kernel spends its time, idle, in-process: 256 scattered
64 KiB blocks (16 MiB) h2d and d2h between CuPy buffers, as bench_gpu_batch.py's direct rows.
Host time to enqueue (the table and the launches), GPU time of the launches (events around
them), and the whole latency, against one contiguous cudaMemcpyAsync of the same bytes."""
import os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
import cupy as cp
from priod.direct import _BatchKernel
from priod.engines.cuda._driver import bindings, check
rt, drv = bindings()
KiB = 1024; N = 256; B = 64 * KiB
host = cp.cuda.alloc_pinned_memory(2 * N * B); dev = cp.cuda.alloc(2 * N * B)
hp = int(check(rt.cudaHostGetDevicePointer(host.ptr, 0)))
_, high = check(rt.cudaDeviceGetStreamPriorityRange())
stream = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, high))
rng = np.random.default_rng(1)
d_offs = (rng.permutation(2 * N)[:N] * B).astype(np.uint64); s_offs = (rng.permutation(2 * N)[:N] * B).astype(np.uint64)
sizes = np.full(N, B, dtype=np.uint64)
kernel = _BatchKernel.load(0)
assert kernel is not None
e0 = check(rt.cudaEventCreate()); e1 = check(rt.cudaEventCreate())
ok = rt.cudaError_t.cudaSuccess
kinds = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost}

def once(direction, how):
    dst, src = (dev.ptr, hp) if direction == "h2d" else (hp, dev.ptr)
    t0 = time.perf_counter()
    check(rt.cudaEventRecord(e0, stream))
    if how == "contiguous":
        d, s_ = (dev.ptr, host.ptr) if direction == "h2d" else (host.ptr, dev.ptr)
        check(rt.cudaMemcpyAsync(d, s_, N * B, kinds[direction], stream))
    else:
        kernel.launch(dst, src, d_offs, s_offs, sizes, stream)
    t1 = time.perf_counter()
    check(rt.cudaEventRecord(e1, stream))
    while rt.cudaStreamQuery(stream)[0] != ok:
        pass
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6, float(check(rt.cudaEventElapsedTime(e0, e1))) * 1e3, (t2 - t0) * 1e6

for direction in ("h2d", "d2h"):
    for how in ("contiguous", "kernel", "contiguous", "kernel"):
        rows = []
        for i in range(60):
            r = once(direction, how)
            if i >= 10:
                rows.append(r)
            time.sleep(0.002)
        a = np.array(rows)
        label = how
        print(f"{direction} {label:22s} enqueue p50 {np.median(a[:,0]):6.1f} us  GPU p50 {np.median(a[:,1]):6.1f}  whole p50 {np.median(a[:,2]):6.1f} p99 {np.percentile(a[:,2],99):6.1f} us", flush=True)
