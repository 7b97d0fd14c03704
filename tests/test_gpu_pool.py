"""Stream-ordered pool memory registered by the pool's POSIX fd on a real GPU (marker ``gpu``;
skipped without one): a pool created with cuda-python's cuMemPoolCreate (pinned, POSIX fd
handles, on GPU 0), allocations from it by cuMemAllocFromPoolAsync, registered with a SyncClient
against a cuda daemon (kind pool_fd), copied into and out of by the daemon, every byte read
back with cuMemcpyDtoH; and a pool made without handle types, refused with the setting to change.
(PyTorch's backend:cudaMallocAsync, whose device default pool is not shareable, is refused in
tests/test_gpu_torch.py.)"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import priod
from priod.testing import DaemonProcess, wait_until

pytestmark = pytest.mark.gpu

MiB = 1 << 20


class _Cai:
    """``nbytes`` of device memory at ``pointer``, as a flat uint8 CUDA array."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


class _Pool:
    """A stream-ordered pool on GPU 0, made by cuda-python: with POSIX fd handles (shareable)
    or without (``shareable=False``, like a device's default pool); allocations from it are
    complete (their stream synchronised) when `alloc` returns."""

    def __init__(self, shareable: bool = True) -> None:
        from priod.common.cuda.driver import bindings, check

        self.rt, self.drv = bindings()
        self.check = check
        drv = self.drv
        check(self.rt.cudaSetDevice(0))
        check(self.rt.cudaFree(0))  # the primary context, current for the driver calls below
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        handles = drv.CUmemAllocationHandleType
        props.handleTypes = (
            handles.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if shareable else handles.CU_MEM_HANDLE_TYPE_NONE
        )
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        self.pool = check(drv.cuMemPoolCreate(props))
        self.stream = check(drv.cuStreamCreate(0))
        self.allocations: list[int] = []

    def alloc(self, nbytes: int, fill: int) -> int:
        """``nbytes`` from the pool, every byte ``fill``."""
        pointer = int(self.check(self.drv.cuMemAllocFromPoolAsync(nbytes, self.pool, self.stream)))
        self.allocations.append(pointer)
        self.check(self.drv.cuMemsetD8Async(pointer, fill, nbytes, self.stream))
        self.check(self.drv.cuStreamSynchronize(self.stream))
        return pointer

    def read(self, pointer: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        out = np.empty(nbytes, dtype=np.uint8)
        self.check(self.drv.cuMemcpyDtoH(out.ctypes.data, pointer, nbytes))
        return out

    def write(self, pointer: int, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.check(self.drv.cuMemcpyHtoD(pointer, data.ctypes.data, data.nbytes))

    def close(self) -> None:
        """Free the allocations and destroy the pool (after the daemon let go of its imports:
        CUDA wants importers to free first)."""
        for pointer in self.allocations:
            self.check(self.drv.cuMemFreeAsync(pointer, self.stream))
        self.check(self.drv.cuStreamSynchronize(self.stream))
        self.check(self.drv.cuStreamDestroy(self.stream))
        self.check(self.drv.cuMemPoolDestroy(self.pool))


def test_pool_allocation_registers_by_the_pool_fd(gpu_daemon: DaemonProcess) -> None:
    """A buffer at an odd offset inside an allocation of a shareable pool registers by the pool's
    fd and the allocation's export data (kind pool_fd); copies into it and out of it, bulk and
    urgent, move exactly its bytes (read back by cuMemcpyDtoH), the allocation's other bytes keep
    theirs. A second region on the same allocation and one on another allocation of the pool
    share the daemon's imports (2 allocations imported for 3 regions), a device-to-device copy
    between two of them lands, and once the regions are freed the daemon lets go of every
    import (the driver counts a process's imports of a pool: each region's is destroyed with
    it), after which the buffer registers anew."""
    from priod.client.cuda_ipc import export_device_buffer

    pool = _Pool()
    size = 3 * MiB + 8192
    base = pool.alloc(size, 0x5A)
    other = pool.alloc(MiB, 0x33)
    lead, n = 4096 + 5, 3 * MiB - 7
    view = _Cai(base + lead, n)
    buf = export_device_buffer(view)
    os.close(buf.fd)
    assert (buf.kind, buf.offset, buf.nbytes, len(buf.handle), buf.pointer) == ("pool_fd", lead, n, 64, base + lead), (
        buf
    )
    assert buf.size >= lead + n, buf
    rng = np.random.default_rng(23)
    try:
        with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
            region = c.register_device(view)
            host = c.alloc_host(n)
            assert region.nbytes == n and host.array is not None
            for priority in ("bulk", "urgent"):
                host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
                c.copy(region, host, priority=priority)  # into the pool allocation
                got = pool.read(base, size)
                assert np.array_equal(got[lead : lead + n], host.array), ("in", priority)
                assert (got[:lead] == 0x5A).all() and (got[lead + n :] == 0x5A).all(), ("a neighbour changed", priority)
                want = rng.integers(0, 256, n, dtype=np.uint8)
                pool.write(base + lead, want)
                c.copy(host, region, priority=priority)  # out of it
                assert np.array_equal(host.array, want), ("out", priority)
            again = c.register_device(_Cai(base, 4096))  # the same allocation, at its start
            second = c.register_device(_Cai(other + 8, 1000))  # another allocation of the pool
            engine = c.status()["engine"]
            assert engine["pool_imports"] == 2, engine
            c.copy(second, region, 1000, priority="urgent")
            got = pool.read(other, MiB)
            assert (
                np.array_equal(got[8:1008], host.array[:1000])
                and (got[:8] == 0x33).all()
                and (got[1008:] == 0x33).all()
            )
            c.copy(host, again, 4096, priority="bulk")
            assert np.array_equal(host.array[:4096], pool.read(base, 4096))
            for r in (region, again, second):
                c.free(r)
            wait_until(lambda: c.status()["engine"]["pool_imports"] == 0, what="the daemon to free its pool imports")
            # the daemon gave back every import of the pool: a new registration imports it anew
            region = c.register_device(view)
            c.copy(host, region, priority="urgent")
            assert np.array_equal(host.array, pool.read(base + lead, n))
            c.free(region)
            wait_until(
                lambda: c.status()["engine"]["pool_imports"] == 0, what="the daemon to free its pool imports again"
            )
    finally:
        pool.close()


def test_pool_without_handle_types_names_the_setting(gpu_daemon: DaemonProcess) -> None:
    """A pool made without a POSIX fd handle type (as a device's default pool is) cannot be
    shared: register_device fails before any request, naming how to make a pool that can be,
    and the other ways out; the connection goes on."""
    pool = _Pool(shareable=False)
    try:
        pointer = pool.alloc(MiB, 0)
        with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
            with pytest.raises(priod.EngineError) as info:
                c.register_device(_Cai(pointer, MiB))
            message = str(info.value)
            assert message.startswith(
                "this buffer's memory cannot be registered with priod: cuMemPoolExportToShareableHandle refused its pool"
            ), message
            assert "cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor" in message, message
            assert (
                "PYTORCH_CUDA_ALLOC_CONF=backend:native" in message
                and "alloc_device and view it with Region.torch()" in message
            ), message
            c.ping()
    finally:
        pool.close()
