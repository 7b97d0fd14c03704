"""The memory the CUDA engine copies between: pinned host regions and device regions.

- Host memory is a client's memfd, mapped shared and pinned once with
  ``cudaHostRegister(mapped | portable)``: 0.12 ms per MiB when its pages exist already,
  0.4-0.6 ms per MiB for a fresh memfd (the pages are allocated then), measured on an H200.
  Never per copy. Mapped, so that the express kernel reaches it through its device alias;
  portable, so that every device's context can use it.
- Device memory is either allocated here with ``cuMemCreate`` (a client reaches it through the
  POSIX fd in its `DeviceExport` and keeps that fd, so the memory outlives the daemon) or
  imported from a client's IPC handle. IPC handle imports go through
  the daemon-side `IpcTable`, which opens each client allocation once however many regions
  point into it.
- A client's ``cuMemCreate`` memory (PyTorch's expandable segments, vLLM's CuMemAllocator)
  comes as a POSIX fd instead (`import_device_fd`): imported, mapped whole at an address range
  reserved here, and given read/write access for the region's GPU; each region maps its own.
- A client's stream-ordered pool memory (``cudaMallocAsync`` from a pool created with POSIX fd
  handles) comes as the pool's POSIX fd and the allocation's export data
  (`import_device_pool`): the `PoolTable` imports the pool for each region (the driver counts
  the imports) and each allocation once however many regions use it, and gives each back with
  its region (the allocation with its last one).

`Regions` keeps what one engine holds, so that close frees it all, and the registration times
that ``priod status`` shows. Its methods run on the daemon's executor threads, since they take
milliseconds; the tables are single dict operations or under a lock. Checking the arguments
(sizes, served devices, a closed engine) is the engine's job, before it calls in here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from priod.common.cuda.driver import IpcTable, bindings, check, pool_export_from_bytes
from priod.common.cuda.vmm import VmmMapping, access_descs, vmm_import, vmm_map, vmm_prop, vmm_unmap
from priod.daemon.engines.base import DeviceExport, DeviceMemory, HostMemory
from priod.errors import CudaError, InvalidRequest

__all__ = [
    "CudaDeviceMemory",
    "CudaHostMemory",
    "PoolTable",
    "Regions",
]


class CudaHostMemory(HostMemory):
    """A memfd mapped by `HostMemory` and pinned with ``cudaHostRegister(mapped | portable)``."""

    def __init__(self, fd: int, nbytes: int) -> None:
        super().__init__(fd, nbytes)
        self.host_pointer = self.address
        """`address`, read once (numpy's ``ctypes.data`` costs a microsecond per call)."""
        self.device_pointer = 0
        """The address kernels use (equal to `address` under unified addressing)."""
        self.register_ms = 0.0
        self.registered = False


class CudaDeviceMemory(DeviceMemory):
    """Device memory: allocated here (``export`` set, ``vmm`` its mapping), or a client's
    memory imported from its IPC handle, its POSIX fd (``vmm``) or its pool (``pool``)."""

    def __init__(
        self,
        pointer: int,
        nbytes: int,
        device: int,
        *,
        export: DeviceExport | None = None,
        ipc_handle: bytes | None = None,
    ) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.device = device
        self.export = export
        self.ipc_handle = ipc_handle
        """For imported memory, the handle it was opened from (to close it)."""
        self.vmm: VmmMapping | None = None
        """For memory imported from a POSIX fd, its mapping (to unmap and release it)."""
        self.pool: PoolKey | None = None
        """For memory imported from a pool, its allocation's key in the `PoolTable`."""
        self.released = False


PoolKey = tuple[int, bytes]
"""An imported pool allocation: the imported pool's handle value and the allocation's export data."""


class PoolTable:
    """The clients' stream-ordered pools and pool allocations imported here, counted.

    The driver counts a process's imports of one pool: every import gives the same handle, and
    the pool lives until each import has had its ``cuMemPoolDestroy`` (measured on an H200,
    driver 580: after one destroy of two imports the pool still imports pointers, after the
    second a call on it crashed the process). So every registration imports the pool and its
    release destroys that import, the last one after the allocation is freed. An allocation,
    though, is imported once however many regions use it: imported twice it comes back as one
    pointer, and the first free unmaps it for both (nvbug 5570902, which cuda.core's IPC
    pointer cache works around); it is freed with its last region. The callers make the
    region's device current first.
    """

    def __init__(self, use: Callable[[int], None]) -> None:
        self._use = use
        self._pools: dict[int, list[Any]] = {}
        """Imported pool's handle value -> [the pool, how many imports of it are held, device]."""
        self._allocations: dict[PoolKey, list[int]] = {}
        """-> [the imported pointer, the allocation's size, how many regions use it]."""
        self._lock = threading.Lock()

    def acquire(self, fd: int, export: bytes, device: int, peers: Sequence[int] = ()) -> tuple[PoolKey, int, int]:
        """Import the pool behind ``fd`` (one more import of it, for `release` to destroy) and
        the allocation that ``export`` names (or reuse it); ``peers`` get read/write access to a
        pool not imported yet (its own GPU has it already). Returns the key to `release`, the
        allocation's address here and its size.

        Raises:
            InvalidRequest: the fd is not a pool's POSIX export, or the export data names no
                allocation of it (the client's fault, named; what was imported is let go).
        """
        _, drv = bindings()
        with self._lock:
            try:
                pool = check(
                    drv.cuMemPoolImportFromShareableHandle(
                        fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                    )
                )
            except CudaError as exc:
                raise InvalidRequest(
                    f"the fd passed with register_device (kind 'pool_fd') does not import as a CUDA memory pool ({exc}): {POOL_FD_HINT}"
                ) from exc
            pool_key = int(pool)
            entry = self._pools.get(pool_key)
            if entry is None:
                try:
                    if peers:
                        descs = access_descs(drv, peers)
                        check(drv.cuMemPoolSetAccess(pool, descs, len(descs)))
                except BaseException:
                    drv.cuMemPoolDestroy(pool)
                    raise
                entry = self._pools[pool_key] = [pool, 0, device]
            entry[1] += 1
            key = (pool_key, bytes(export))
            held = self._allocations.get(key)
            if held is None:
                try:
                    held = self._allocations[key] = [*_import_pointer(drv, entry[0], export), 0]
                except BaseException:
                    self._destroy_one(drv, pool_key)  # the error that got us here is the one to report
                    raise
            held[2] += 1
            return key, held[0], held[1]

    def release(self, key: PoolKey) -> None:
        """Drop one region's reference: free the imported allocation when it was the last, then
        destroy the region's import of the pool (each tried, the first error raised). Nothing
        may be in flight on it (cuMemFree of pool memory does not wait for the device)."""
        _, drv = bindings()
        with self._lock:
            held = self._allocations.get(key)
            if held is None:
                return
            held[2] -= 1
            last = held[2] == 0
            results = [drv.cuMemFree(held[0])] if last else []
            results.append(self._destroy_one(drv, key[0]))
            if last:
                # Forgotten once freed, so that a count of 0 (`__len__`, in `priod status`)
                # means the client may free its allocation: CUDA wants importers to free first.
                del self._allocations[key]
        for result in results:
            check(result)

    def _destroy_one(self, drv: Any, pool_key: int) -> Any:
        """``cuMemPoolDestroy`` of one import of the pool (its result); forget it after the last."""
        entry = self._pools[pool_key]
        result = drv.cuMemPoolDestroy(entry[0])
        entry[1] -= 1
        if entry[1] == 0:
            del self._pools[pool_key]
        return result

    def close_all(self) -> list[BaseException]:
        """Free every imported allocation and destroy every import of every pool, whatever
        their counts; return the errors met."""
        _, drv = bindings()
        results = []
        with self._lock:
            for (pool_key, _), held in self._allocations.items():
                self._use(self._pools[pool_key][2])
                results.append(drv.cuMemFree(held[0]))
            self._allocations.clear()
            for pool, imports, device in self._pools.values():
                self._use(device)
                results.extend(drv.cuMemPoolDestroy(pool) for _ in range(imports))
            self._pools.clear()
        errors: list[BaseException] = []
        for result in results:
            try:
                check(result)
            except CudaError as exc:
                errors.append(exc)
        return errors

    def __len__(self) -> int:
        """How many client pool allocations are imported (``pool_imports`` in ``priod status``)."""
        return len(self._allocations)


def _import_pointer(drv: Any, pool: Any, export: bytes) -> tuple[int, int]:
    """``cuMemPoolImportPointer`` of ``export`` from the imported ``pool``: the allocation's
    address here and its size (``cuMemGetAddressRange``, so that no region reaches past it);
    export data that names nothing of this pool is the client's mistake (InvalidRequest)."""
    try:
        pointer = int(check(drv.cuMemPoolImportPointer(pool, pool_export_from_bytes(export))))
    except CudaError as exc:
        raise InvalidRequest(
            f"the export data passed with register_device (kind 'pool_fd') names no allocation of that pool ({exc}): {POOL_FD_HINT}"
        ) from exc
    try:
        base, size = check(drv.cuMemGetAddressRange(pointer))
        if int(base) != pointer:
            raise CudaError(
                "CUDA_ERROR_INVALID_VALUE",
                f"the imported allocation at 0x{pointer:x} lies inside a range from 0x{int(base):x}",
            )
    except BaseException:
        drv.cuMemFree(pointer)
        raise
    return pointer, int(size)


class Regions:
    """The host and device regions of one engine, and its daemon-side IPC and pool tables.

    ``use`` makes a device current in the calling thread (the engine's, which skips the call
    when the device already is).
    """

    def __init__(self, use: Callable[[int], None]) -> None:
        self._use = use
        self.hosts: dict[int, CudaHostMemory] = {}
        self.device_mems: dict[int, CudaDeviceMemory] = {}
        self.ipc = IpcTable()
        self.pools = PoolTable(use)
        self._register_log: deque[tuple[int, float]] = deque(maxlen=32)
        self._register_count = 0
        self._register_bytes = 0
        self._register_ms = 0.0
        self._register_lock = threading.Lock()  # registrations run on several executor threads

    def map_host(self, fd: int, nbytes: int, device: int) -> CudaHostMemory:
        """Map and pin ``nbytes`` of ``fd``, with ``device`` current."""
        rt, _ = bindings()
        mem = CudaHostMemory(fd, nbytes)
        try:
            # Allocate the pages first, outside CUDA. cudaHostRegister faults in pages it finds
            # missing while holding a driver lock, and the event loop's own CUDA calls (event
            # queries, launches) wait on that lock: an urgent copy waited as long as that took.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                pass  # e.g. a memfd sealed against writes: registration faults the pages in
            self._use(device)
            t0 = time.perf_counter()
            check(rt.cudaHostRegister(mem.address, nbytes, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable))
            mem.register_ms = (time.perf_counter() - t0) * 1e3
            mem.registered = True
            mem.device_pointer = int(check(rt.cudaHostGetDevicePointer(mem.address, 0)))
        except BaseException:
            if mem.registered:
                rt.cudaHostUnregister(mem.address)
            mem.unmap()
            raise
        self.hosts[id(mem)] = mem
        with self._register_lock:
            self._register_log.append((nbytes, mem.register_ms))
            self._register_count += 1
            self._register_bytes += nbytes
            self._register_ms += mem.register_ms
        return mem

    def release_host(self, mem: HostMemory) -> None:
        """Unpin and unmap ``mem``; nothing if it was released already (or is not ours)."""
        if self.hosts.pop(id(mem), None) is None:
            return
        assert isinstance(mem, CudaHostMemory)
        rt, _ = bindings()
        try:
            if mem.registered:
                mem.registered = False
                check(rt.cudaHostUnregister(mem.address))
        finally:
            mem.unmap()

    def alloc_device(self, nbytes: int, device: int, peers: Sequence[int] = ()) -> CudaDeviceMemory:
        """``cuMemCreate`` on ``device``, exported by a POSIX fd and mapped here with read/write
        access for ``device`` and ``peers``.

        Not ``cudaMalloc``: memory that ``cudaMalloc`` makes dies with this process, and the
        client's KV cache must outlive a daemon restart. The client keeps the fd (the export
        holds a reference to the allocation) and registers it again with the next daemon.
        The size is rounded up to the allocation granularity (2 MiB on an H200).
        """
        _, drv = bindings()
        self._use(device)
        prop = vmm_prop(drv, device)
        granularity = int(
            check(
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                )
            )
        )
        size = -(-nbytes // granularity) * granularity
        handle = check(drv.cuMemCreate(size, prop, 0))
        try:
            posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = int(check(drv.cuMemExportToShareableHandle(handle, posix_fd, 0)))
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        try:
            mapping = vmm_map(drv, handle, size, [device, *peers])  # releases handle on failure
        except BaseException:
            os.close(fd)
            raise
        mem = CudaDeviceMemory(mapping.base, nbytes, device, export=DeviceExport(fd=fd, kind="vmm_fd", size=size))
        mem.vmm = mapping
        self.device_mems[id(mem)] = mem
        return mem

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> CudaDeviceMemory:
        """Open a client's allocation (once per allocation) and take ``nbytes`` at ``offset``."""
        self._use(device)
        base = self.ipc.acquire(bytes(ipc_handle), device)
        mem = CudaDeviceMemory(base + offset, nbytes, device, ipc_handle=bytes(ipc_handle))
        self.device_mems[id(mem)] = mem
        return mem

    def import_device_fd(
        self, fd: int, size: int, offset: int, nbytes: int, device: int, peers: Sequence[int] = ()
    ) -> CudaDeviceMemory:
        """Import a client's ``cuMemCreate`` allocation from its POSIX fd, map all ``size``
        bytes of it here with read/write access for ``device`` (and ``peers``), and take
        ``nbytes`` at ``offset``. ``fd`` stays the caller's: the imported handle keeps the
        allocation alive.

        Raises:
            InvalidRequest: the fd is not a CUDA allocation's POSIX export, or ``size`` is not
                the allocation's (the client's fault, named; never an internal error).
        """
        _, drv = bindings()
        self._use(device)
        handle = vmm_import(drv, fd)
        mapping = vmm_map(drv, handle, size, [device, *peers])
        mem = CudaDeviceMemory(mapping.base + offset, nbytes, device)
        mem.vmm = mapping
        self.device_mems[id(mem)] = mem
        return mem

    def import_device_pool(
        self, fd: int, export: bytes, offset: int, nbytes: int, device: int, peers: Sequence[int] = ()
    ) -> CudaDeviceMemory:
        """Import a client's stream-ordered pool from its POSIX fd and the allocation that
        ``export`` (its ``CUmemPoolPtrExportData``) names, the allocation once however many
        regions use it (`PoolTable`), with read/write access for ``peers`` besides ``device``,
        and take ``nbytes`` at ``offset`` of the allocation. ``fd`` stays the caller's.

        Raises:
            InvalidRequest: as `PoolTable.acquire`, or the region reaches past the allocation.
        """
        self._use(device)
        key, pointer, size = self.pools.acquire(fd, export, device, peers)
        if offset + nbytes > size:
            self.pools.release(key)
            raise InvalidRequest(
                f"offset {offset} + nbytes {nbytes} is past the end of the pool allocation, {size} bytes: {POOL_FD_HINT}"
            )
        mem = CudaDeviceMemory(pointer + offset, nbytes, device)
        mem.pool = key
        self.device_mems[id(mem)] = mem
        return mem

    def release_device(self, mem: DeviceMemory) -> None:
        """Free an allocation, or drop an import's reference to its handle. Idempotent."""
        if self.device_mems.pop(id(mem), None) is None:
            return
        assert isinstance(mem, CudaDeviceMemory) and mem.device is not None
        mem.released = True
        self._use(mem.device)
        if mem.vmm is not None:
            if mem.export is not None:
                os.close(mem.export.fd)  # the client's dup, if it still has one, keeps the memory
            vmm_unmap(mem.vmm)
        elif mem.pool is not None:
            self.pools.release(mem.pool)
        elif mem.ipc_handle is not None:
            self.ipc.release(mem.ipc_handle, mem.device)

    def close(self) -> list[BaseException]:
        """Release every region and close every IPC handle; return the errors met."""
        errors: list[BaseException] = []
        for mem in list(self.hosts.values()):
            try:
                self.release_host(mem)
            except (CudaError, BufferError) as exc:
                errors.append(exc)
        for dmem in list(self.device_mems.values()):
            try:
                self.release_device(dmem)
            except CudaError as exc:
                errors.append(exc)
        errors.extend(self.ipc.close_all())
        errors.extend(self.pools.close_all())
        return errors

    def statistics(self) -> dict[str, object]:
        """Registration times and region counts, for ``priod status``."""
        recent = [{"bytes": b, "ms": round(ms, 3)} for b, ms in self._register_log]
        return {
            "host_register": {
                "count": self._register_count,
                "bytes": self._register_bytes,
                "ms_total": round(self._register_ms, 3),
                "ms_per_gib": round(self._register_ms / (self._register_bytes / 2**30), 3)
                if self._register_bytes
                else None,
                "recent": recent,
            },
            "host_regions": len(self.hosts),
            "device_regions": len(self.device_mems),
            "pool_imports": len(self.pools),
        }


POOL_FD_HINT = (
    "pass the fd that cuMemPoolExportToShareableHandle(pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) gave for the buffer's pool, "
    "and as handle the 64 bytes that cuMemPoolExportPointer gave for its allocation, allocated (its stream synchronised) and not "
    "freed (priod.client.cuda_ipc.export_device_buffer does), with offset + nbytes within the allocation"
)
