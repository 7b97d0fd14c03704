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
from collections.abc import Callable

from priod.engines.base import DeviceExport, DeviceMemory, HostMemory
from priod.errors import CudaError

from ._driver import IpcTable, bindings, check, handle_to_bytes

__all__ = ["CudaDeviceMemory", "CudaHostMemory", "Regions"]


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
        self.released = False


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
