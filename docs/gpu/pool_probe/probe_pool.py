"""Probe of the stream-ordered pool IPC calls priod's pool_fd path relies on (parent exports, child imports)."""
import ctypes
import os
import subprocess
import sys

from cuda.bindings import driver as d
from cuda.bindings import runtime as r

OK = d.CUresult.CUDA_SUCCESS


def ck(x):
    if x[0] != OK:
        return f"ERR {getattr(x[0], 'name', x[0])}"
    return x[1] if len(x) == 2 else (x[1:] if len(x) > 2 else None)


def b64(data):
    return ctypes.string_at(int(data.getPtr()), 64)


CHILD = r'''
import ctypes, sys
from cuda.bindings import driver as d, runtime as r
OK = d.CUresult.CUDA_SUCCESS
def ck(x):
    if x[0] != OK: return f"ERR {getattr(x[0], 'name', x[0])}"
    return x[1] if len(x) == 2 else (x[1:] if len(x) > 2 else None)
fd, export, memfd = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
r.cudaSetDevice(0); r.cudaFree(0)
P = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
print("child: import memfd as pool:", ck(d.cuMemPoolImportFromShareableHandle(memfd, P, 0)))
p1 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0)); p2 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0))
print("child: pool imports", p1, p2, "same:", int(p1) == int(p2))
data = d.CUmemPoolPtrExportData(); ctypes.memmove(int(data.getPtr()), export, 64)
bad = d.CUmemPoolPtrExportData(); ctypes.memmove(int(bad.getPtr()), b"\x07" * 64, 64)
print("child: import garbage export data:", ck(d.cuMemPoolImportPointer(p1, bad)))
q1 = ck(d.cuMemPoolImportPointer(p1, data)); q2 = ck(d.cuMemPoolImportPointer(p1, data))
print("child: pointer imports", q1, q2)
q = int(q1)
print("child: address range of import:", ck(d.cuMemGetAddressRange(q)), "of import+4096:", ck(d.cuMemGetAddressRange(q + 4096)))
loc = d.CUmemLocation(); loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE; loc.id = 0
print("child: pool access for dev0 before set:", ck(d.cuMemPoolGetAccess(p1, loc)))
out = (ctypes.c_ubyte * 16)()
print("child: read 16 bytes:", ck(d.cuMemcpyDtoH(ctypes.addressof(out), q, 16)), bytes(out).hex())
acc = d.CUmemAccessDesc(); acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE; acc.location.id = 0; acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
print("child: set access dev0 rw:", ck(d.cuMemPoolSetAccess(p1, [acc], 1)))
src = (ctypes.c_ubyte * 16)(*range(16))
print("child: write 16 bytes at +4096:", ck(d.cuMemcpyHtoD(q + 4096, ctypes.addressof(src), 16)))
print("child: free import 1:", ck(d.cuMemFree(q)))
if int(q2) != q: print("child: free import 2:", ck(d.cuMemFree(int(q2))))
print("child: destroy pool:", ck(d.cuMemPoolDestroy(p1)), "again:", ck(d.cuMemPoolDestroy(p2)))
'''


def main():
    print("driver", ck(d.cuDriverGetVersion()), "bindings", getattr(__import__("cuda.bindings").bindings, "__version__", "?"))
    ck(d.cuInit(0)); r.cudaSetDevice(0); r.cudaFree(0)
    dev = ck(d.cuDeviceGet(0))
    print("supported handle types:", ck(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, dev)))
    props = d.CUmemPoolProps()
    props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    pool = ck(d.cuMemPoolCreate(props))
    s = ck(d.cuStreamCreate(0))
    a = int(ck(d.cuMemAllocFromPoolAsync(1 << 20, pool, s)))
    b = int(ck(d.cuMemAllocFromPoolAsync((3 << 20) + 8192, pool, s)))
    c = int(ck(d.cuMemAllocFromPoolAsync(5000, pool, s)))
    ck(d.cuStreamSynchronize(s))
    print(f"allocs a=0x{a:x} b=0x{b:x} c=0x{c:x}")
    for name, p in (("a", a), ("b", b), ("b+4096", b + 4096), ("c", c)):
        rng = ck(d.cuMemGetAddressRange(p))
        print(f"range {name}:", rng if isinstance(rng, str) else (hex(int(rng[0])), int(rng[1])))
    attr = ck(d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, b + 4096))
    print("mempool attr", type(attr).__name__, attr, "== pool:", int(attr) == int(pool))
    print("ipc capable attr:", ck(d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, b)))
    print("export b before the pool is exported:", ck(d.cuMemPoolExportPointer(b)))
    fd = ck(d.cuMemPoolExportToShareableHandle(attr, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
    print("pool fd:", type(fd).__name__, fd, os.readlink(f"/proc/self/fd/{int(fd)}"))
    e1 = ck(d.cuMemPoolExportPointer(b))
    e2 = ck(d.cuMemPoolExportPointer(b + 4096))
    print("export b:", type(e1).__name__, "export b+4096:", e2 if isinstance(e2, str) else ("same" if b64(e2) == b64(e1) else "different"))
    fd2 = ck(d.cuMemPoolExportToShareableHandle(attr, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
    print("second pool fd:", fd2, "export b again same:", b64(ck(d.cuMemPoolExportPointer(b))) == b64(e1))
    dp = ck(d.cuDeviceGetDefaultMemPool(dev))
    print("default pool export:", ck(d.cuMemPoolExportToShareableHandle(dp, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    x = int(ck(d.cuMemAllocAsync(4096, s))); ck(d.cuStreamSynchronize(s))
    print("default pool export pointer:", ck(d.cuMemPoolExportPointer(x)))
    props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    np_ = ck(d.cuMemPoolCreate(props))
    print("no-handle pool export:", ck(d.cuMemPoolExportToShareableHandle(np_, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    print("memset:", ck(d.cuMemsetD8(b, 0x5A, (3 << 20) + 8192)))
    memfd = os.memfd_create("notapool")
    out = subprocess.run([sys.executable, "-c", CHILD, str(int(fd)), b64(e1).hex(), str(memfd)], pass_fds=[int(fd), memfd], capture_output=True, text=True, timeout=120)
    print(out.stdout, out.stderr[-3000:], "child rc", out.returncode)
    got = (ctypes.c_ubyte * 16)()
    print("parent reads b+4096:", ck(d.cuMemcpyDtoH(ctypes.addressof(got), b + 4096, 16)), bytes(got).hex())
    for p in (a, b, c, x):
        ck(d.cuMemFreeAsync(p, s))
    ck(d.cuStreamSynchronize(s))
    print("destroy pools:", ck(d.cuMemPoolDestroy(pool)), ck(d.cuMemPoolDestroy(np_)))


main()
