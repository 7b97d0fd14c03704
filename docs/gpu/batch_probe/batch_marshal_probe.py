"""Probe: what a cuMemcpyBatchAsync call costs per segment on the CPU: cuda-python's lists vs ctypes arrays."""
import os, time, sys, ctypes, json
import numpy as np
sys.path.insert(0, os.getcwd())
from priod.engines.base import LaneKey, Direction, Path
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.engine import _host

rt, drv = bindings()
MiB = 1 << 20
REGION = 512 * MiB
BLOCK = 64 << 10
eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
host = eng.map_host(fd, REGION)
dev = eng.alloc_device(REGION, 0)
lane = eng._devices[0].h2d
stream = lane.dma
batched = eng._batched
rng = np.random.default_rng(1)
slots = REGION // BLOCK

# ctypes path: the 12.8 ABI (with failIdx), through cuGetProcAddress
pfn = check(drv.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, drv.CUflags(0) if hasattr(drv, "CUflags") else 0))
print("pfn", pfn)
addr = int(pfn[0]) if isinstance(pfn, tuple) else int(pfn)
P = ctypes.c_void_p; S = ctypes.c_size_t
proto = ctypes.CFUNCTYPE(ctypes.c_int, P, P, P, S, P, P, S, P, P)
fn = proto(addr)
attrs = batched._attrs[0]
attrs_ptr = attrs.getPtr()
idx = (ctypes.c_size_t * 1)(0)
fail = ctypes.c_size_t(0)
stream_handle = int(stream)

def ctypes_copy(dst, src, d_off, s_off, sizes):
    dsts = d_off + np.uint64(dst); srcs = s_off + np.uint64(src)
    rc = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes), attrs_ptr, ctypes.addressof(idx), 1, ctypes.byref(fail), stream_handle)
    if rc != 0: raise RuntimeError(f"rc {rc} failIdx {fail.value}")

dp, sp = dev.pointer, host.host_pointer
def hinted_attrs():
    a = drv.CUmemcpyAttributes()
    a.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    a.srcLocHint.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    a.srcLocHint.id = 0
    a.dstLocHint.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.dstLocHint.id = 0
    return a
ha = hinted_attrs()
ha_ptr = ha.getPtr()
def ctypes_hinted(dst, src, d_off, s_off, sizes):
    dsts = d_off + np.uint64(dst); srcs = s_off + np.uint64(src)
    rc = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes), ha_ptr, ctypes.addressof(idx), 1, ctypes.byref(fail), stream_handle)
    if rc != 0: raise RuntimeError(f"rc {rc} failIdx {fail.value}")
kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
out = {}
for count in (256, 420, 4096):
    d = rng.choice(slots, count, replace=False).astype(np.uint64) * BLOCK
    s = rng.choice(slots, count, replace=False).astype(np.uint64) * BLOCK
    z = np.full(count, BLOCK, dtype=np.uint64)
    reps = max(8, 32768 // count)
    for name, f in (("ctypes", lambda: ctypes_copy(dp, sp, d, s, z)), ("hinted", lambda: ctypes_hinted(dp, sp, d, s, z)), ("ctypes-again", lambda: ctypes_copy(dp, sp, d, s, z)), ("d2h", lambda: ctypes_copy(sp, dp, s, d, z))):
        f(); check(drv.cuStreamSynchronize(stream))
        cpu = []
        t0 = time.perf_counter()
        for _ in range(reps):
            c0 = time.perf_counter(); f(); cpu.append(time.perf_counter() - c0)
        check(drv.cuStreamSynchronize(stream))
        wall = time.perf_counter() - t0
        out[f"{name} {count}"] = (np.median(cpu) / count * 1e6, reps * count * BLOCK / wall / 1e9)
# correctness of the ctypes path: pattern in host, scatter to device, back to host elsewhere
import mmap
mm = mmap.mmap(fd, REGION, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
view = np.frombuffer(mm, dtype=np.uint8)
half = REGION // 2
view[:half] = np.random.default_rng(3).integers(0, 256, half, dtype=np.uint8)
view[half:] = 0
n = 300
d = rng.choice(half // BLOCK, n, replace=False).astype(np.uint64) * BLOCK
s = rng.choice(half // BLOCK, n, replace=False).astype(np.uint64) * BLOCK
z = np.full(n, BLOCK - 8, dtype=np.uint64)
ctypes_copy(dp, sp, d, s, z)          # host[s] -> dev[d]
lane2 = eng._devices[0].d2h
ctypes_copy(sp + half, dp, s, d, z)   # dev[d] -> host[half + s]  (same stream order not needed: sync)
check(drv.cuStreamSynchronize(stream))
ok = all((view[half + int(a): half + int(a) + BLOCK - 8] == view[int(a): int(a) + BLOCK - 8]).all() for a in s)
print("ctypes round trip bytes equal:", ok)
for k, (us, g) in out.items():
    print(f"{k:20s} cpu {us:6.3f} us/segment  {g:6.2f} GB/s")
