"""The memory the CUDA engine copies between: pinned host regions and device regions.

- Host memory is a client's memfd, mapped shared and pinned once with
  ``cudaHostRegister(mapped | portable)``: 0.12 ms per MiB when its pages exist already,
  0.4-0.6 ms per MiB for a fresh memfd (the pages are allocated then), measured on an H200.
  Never per copy. Mapped, so that the express kernel reaches it through its device alias;
  portable, so that every device's context can use it.
- Device memory is either allocated here with ``cudaMalloc`` (a client reaches it through the
  IPC handle in its `DeviceExport`) or imported from a client's IPC handle. Imports go through
  the daemon-side `IpcTable`, which opens each client allocation once however many regions
  point into it.
- A client's ``cuMemCreate`` memory (PyTorch's expandable segments, vLLM's CuMemAllocator)
  comes as a POSIX fd instead (`import_device_fd`): imported, mapped whole at an address range
  reserved here, and given read/write access for the region's GPU; each region maps its own.

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
from typing import Any, NamedTuple

from priod.engines.base import DeviceExport, DeviceMemory, HostMemory
from priod.errors import CudaError, InvalidRequest

from ._driver import IpcTable, bindings, check, handle_to_bytes

__all__ = ["CudaDeviceMemory", "CudaHostMemory", "Regions", "VmmMapping", "vmm_import", "vmm_map", "vmm_unmap"]


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
    """Device memory: allocated here (``owned``) or opened from a client's IPC handle."""

    def __init__(
        self,
        pointer: int,
        nbytes: int,
        device: int,
        *,
        owned: bool,
        export: DeviceExport | None = None,
        ipc_handle: bytes | None = None,
    ) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.device = device
        self.owned = owned
        self.export = export
        self.ipc_handle = ipc_handle
        """For imported memory, the handle it was opened from (to close it)."""
        self.vmm: VmmMapping | None = None
        """For memory imported from a POSIX fd, its mapping (to unmap and release it)."""
        self.released = False


class VmmMapping(NamedTuple):
    """An imported ``cuMemCreate`` allocation mapped here: ``size`` bytes at ``base``."""

    handle: Any
    """The imported ``CUmemGenericAllocationHandle``, released after the unmap."""
    base: int
    size: int


class Regions:
    """The host and device regions of one engine, and its daemon-side IPC table.

    ``use`` makes a device current in the calling thread (the engine's, which skips the call
    when the device already is).
    """

    def __init__(self, use: Callable[[int], None]) -> None:
        self._use = use
        self.hosts: dict[int, CudaHostMemory] = {}
        self.device_mems: dict[int, CudaDeviceMemory] = {}
        self.ipc = IpcTable()
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

    def alloc_device(self, nbytes: int, device: int) -> CudaDeviceMemory:
        """``cudaMalloc`` on ``device``, exported by its IPC handle."""
        rt, _ = bindings()
        self._use(device)
        pointer = int(check(rt.cudaMalloc(nbytes)))
        try:
            handle = handle_to_bytes(check(rt.cudaIpcGetMemHandle(pointer)))
        except BaseException:
            rt.cudaFree(pointer)
            raise
        mem = CudaDeviceMemory(pointer, nbytes, device, owned=True, export=DeviceExport(ipc_handle=handle, offset=0))
        self.device_mems[id(mem)] = mem
        return mem

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> CudaDeviceMemory:
        """Open a client's allocation (once per allocation) and take ``nbytes`` at ``offset``."""
        self._use(device)
        base = self.ipc.acquire(bytes(ipc_handle), device)
        mem = CudaDeviceMemory(base + offset, nbytes, device, owned=False, ipc_handle=bytes(ipc_handle))
        self.device_mems[id(mem)] = mem
        return mem

    def import_device_fd(self, fd: int, size: int, offset: int, nbytes: int, device: int, peers: Sequence[int] = ()) -> CudaDeviceMemory:
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
        mem = CudaDeviceMemory(mapping.base + offset, nbytes, device, owned=False)
        mem.vmm = mapping
        self.device_mems[id(mem)] = mem
        return mem

    def release_device(self, mem: DeviceMemory) -> None:
        """Free an allocation, or drop an import's reference to its handle. Idempotent."""
        if self.device_mems.pop(id(mem), None) is None:
            return
        assert isinstance(mem, CudaDeviceMemory) and mem.device is not None
        rt, _ = bindings()
        mem.released = True
        self._use(mem.device)
        if mem.owned:
            check(rt.cudaFree(mem.pointer))
        elif mem.vmm is not None:
            vmm_unmap(mem.vmm)
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
        return errors

    def statistics(self) -> dict[str, object]:
        """Registration times and region counts, for ``priod status``."""
        recent = [{"bytes": b, "ms": round(ms, 3)} for b, ms in self._register_log]
        return {
            "host_register": {
                "count": self._register_count,
                "bytes": self._register_bytes,
                "ms_total": round(self._register_ms, 3),
                "ms_per_gib": round(self._register_ms / (self._register_bytes / 2**30), 3) if self._register_bytes else None,
                "recent": recent,
            },
            "host_regions": len(self.hosts),
            "device_regions": len(self.device_mems),
        }


VMM_FD_HINT = (
    "pass the fd that cuMemExportToShareableHandle(handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) gave for the "
    "allocation (priod.cuda_ipc.export_device_buffer does), with size the whole allocation's"
)


def vmm_import(drv: Any, fd: int) -> Any:
    """``cuMemImportFromShareableHandle`` of a POSIX fd; a fd that is not a CUDA allocation's
    export is the client's mistake (InvalidRequest), whatever the driver calls it."""
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        return check(drv.cuMemImportFromShareableHandle(fd, kind))
    except CudaError as exc:
        raise InvalidRequest(f"the fd passed with register_device (kind 'vmm_fd') does not import as a CUDA allocation ({exc}): {VMM_FD_HINT}") from exc


def vmm_map(drv: Any, handle: Any, size: int, devices: Sequence[int]) -> VmmMapping:
    """Map all ``size`` bytes of the imported ``handle`` at a new address range and give
    ``devices`` read/write access; on any failure undo what was done and release ``handle``."""
    base = 0
    mapped = False
    try:
        prop = check(drv.cuMemGetAllocationPropertiesFromHandle(handle))
        granularity = int(check(drv.cuMemGetAllocationGranularity(prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        if granularity <= 0 or size % granularity:
            raise InvalidRequest(f"size = {size} is not a multiple of the allocation's granularity ({granularity} bytes): {VMM_FD_HINT}")
        base = int(check(drv.cuMemAddressReserve(size, granularity, 0, 0)))
        try:
            check(drv.cuMemMap(base, size, 0, handle, 0))
        except CudaError as exc:
            # The driver's one complaint about a size larger than the allocation.
            raise InvalidRequest(f"the allocation does not map with size = {size} ({exc}): {VMM_FD_HINT}") from exc
        mapped = True
        descs = []
        for device in devices:
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(access)
        check(drv.cuMemSetAccess(base, size, descs, len(descs)))
    except BaseException:
        # Best effort, in the reverse order; the error that got us here is the one to report.
        if mapped:
            drv.cuMemUnmap(base, size)
        if base:
            drv.cuMemAddressFree(base, size)
        drv.cuMemRelease(handle)
        raise
    return VmmMapping(handle, base, size)


def vmm_unmap(mapping: VmmMapping) -> None:
    """Unmap, free the address range, release the imported handle (each tried, the first error
    raised): the client's allocation is freed once it, too, lets go. Nothing may be in flight
    on it (cuMemUnmap does not wait for the device)."""
    _, drv = bindings()
    results = (
        drv.cuMemUnmap(mapping.base, mapping.size),
        drv.cuMemAddressFree(mapping.base, mapping.size),
        drv.cuMemRelease(mapping.handle),
    )
    for result in results:
        check(result)
