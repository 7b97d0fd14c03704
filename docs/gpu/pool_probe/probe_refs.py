"""Does the driver count a process's imports of one pool (so that each import wants its own cuMemPoolDestroy)?"""
import ctypes
import subprocess
import sys

from cuda.bindings import driver as d
from cuda.bindings import runtime as r

CHILD = r'''
import ctypes, sys
from cuda.bindings import driver as d, runtime as r
OK = d.CUresult.CUDA_SUCCESS
def ck(x):
    if x[0] != OK: return f"ERR {getattr(x[0], 'name', x[0])}"
    return x[1] if len(x) == 2 else (x[1:] if len(x) > 2 else None)
fd, export = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
r.cudaSetDevice(0); r.cudaFree(0)
P = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
data = d.CUmemPoolPtrExportData(); ctypes.memmove(int(data.getPtr()), export, 64)
def use(tag, pool):
    q = ck(d.cuMemPoolImportPointer(pool, data))
    if isinstance(q, str): print(tag, "import pointer:", q); return
    out = (ctypes.c_ubyte * 4)()
    print(tag, "import pointer ok, read:", ck(d.cuMemcpyDtoH(ctypes.addressof(out), int(q), 4)), bytes(out).hex(), "free:", ck(d.cuMemFree(int(q))))
p1 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0)); p2 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0))
print("two imports, same handle:", int(p1) == int(p2))
print("destroy 1:", ck(d.cuMemPoolDestroy(p1)))
use("after 1 destroy of 2 imports:", p1)
print("destroy 2:", ck(d.cuMemPoolDestroy(p1)))
use("after 2 destroys:", p1)
print("destroy 3:", ck(d.cuMemPoolDestroy(p1)))
p3 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0)); print("import again:", p3, int(p3) == int(p1))
q = ck(d.cuMemPoolImportPointer(p3, data)); print("hold a pointer:", q)
p4 = ck(d.cuMemPoolImportFromShareableHandle(fd, P, 0))
print("destroy once with a pointer held:", ck(d.cuMemPoolDestroy(p3)))
out = (ctypes.c_ubyte * 4)(); print("read held pointer:", ck(d.cuMemcpyDtoH(ctypes.addressof(out), int(q), 4)), bytes(out).hex())
use("import pointer again (pool destroyed once of 2):", p4)
print("free held:", ck(d.cuMemFree(int(q))), "destroy:", ck(d.cuMemPoolDestroy(p4)))
'''
OK = d.CUresult.CUDA_SUCCESS
def ck(x):
    assert x[0] == OK, x[0]
    return x[1] if len(x) == 2 else None
ck(d.cuInit(0)); r.cudaSetDevice(0); r.cudaFree(0)
props = d.CUmemPoolProps()
props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
pool = ck(d.cuMemPoolCreate(props)); s = ck(d.cuStreamCreate(0))
b = int(ck(d.cuMemAllocFromPoolAsync(1 << 20, pool, s))); ck(d.cuMemsetD8Async(b, 0x77, 1 << 20, s)); ck(d.cuStreamSynchronize(s))
fd = ck(d.cuMemPoolExportToShareableHandle(pool, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
e = ctypes.string_at(int(ck(d.cuMemPoolExportPointer(b)).getPtr()), 64)
out = subprocess.run([sys.executable, "-c", CHILD, str(int(fd)), e.hex()], pass_fds=[int(fd)], capture_output=True, text=True, timeout=120)
print(out.stdout, out.stderr[-3000:], "child rc", out.returncode)
ck(d.cuMemFreeAsync(b, s)); ck(d.cuStreamSynchronize(s)); print("parent destroy:", d.cuMemPoolDestroy(pool))
