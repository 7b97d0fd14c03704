"""Does a batched call's first byte wait for the whole call? Latency of one 256 x 64 KiB batch, h2d,
one call vs split calls, interleaved, against one contiguous copy of the same bytes."""
import os, sys, time, ctypes
import numpy as np
sys.path.insert(0, os.getcwd())
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
rt, drv = bindings()
MiB = 1 << 20; REGION = 256 * MiB; BLOCK = 64 << 10; N = 256
eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
stream = eng._devices[0].h2d.strict
b = eng._batched
rng = np.random.default_rng(1)
slots = REGION // BLOCK
d = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
s = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
z = np.full(N, BLOCK, dtype=np.uint64)
dp, sp = dev.pointer, host.host_pointer
kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
from priod.engines.cuda.batched import BatchedDma
def dma(k):
    bd = BatchedDma(call_segments=k)
    return lambda: bd.copy(dp, sp, d, s, z, kind, stream)
def calls(sizes):
    def f():
        i = 0
        for n in sizes:
            b.copy(dp, sp, d[i:i+n], s[i:i+n], z[i:i+n], kind, stream); i += n
    return f
variants = {
    "contiguous": lambda: check(rt.cudaMemcpyAsync(dp, sp, N * BLOCK, kind, stream)),
    "one call": calls([256]),
    "16,32,64,128,16": calls([16, 32, 64, 128, 16]),
    "8 x 32": calls([32] * 8),
    "32 x 8": calls([8] * 32),
    "BatchedDma 1 call": dma(1 << 30),
    "BatchedDma 32": dma(32),
    "BatchedDma 64": dma(64),
    "BatchedDma 96": dma(96),
}
lat = {k: [] for k in variants}; push = {k: [] for k in variants}
for i in range(60):
    for k, f in variants.items():
        check(drv.cuStreamSynchronize(stream))
        t0 = time.perf_counter(); f(); t1 = time.perf_counter()
        while rt.cudaStreamQuery(stream)[0] != rt.cudaError_t.cudaSuccess: pass
        t2 = time.perf_counter()
        if i >= 10: lat[k].append((t2 - t0) * 1e6); push[k].append((t1 - t0) * 1e6)
for k in variants:
    print(f"{k:18s} latency p50 {np.percentile(lat[k],50):7.1f} p99 {np.percentile(lat[k],99):7.1f} us   enqueue p50 {np.percentile(push[k],50):6.1f} us")
