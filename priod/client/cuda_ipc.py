"""Client side of CUDA IPC: share device memory with the daemon, open what the daemon shares.

`export_device_buffer` describes a client's CUDA array (CuPy, PyTorch) for ``register_device``:
by the IPC handle of its allocation, or where IPC handles cannot share it by a POSIX fd
(``cuMemCreate`` memory, stream-ordered pools created shareable); `open_device_fd` maps a
device region the daemon allocated from the fd the client keeps (`open_device_export` opens one
shared by IPC handle), as a `CudaBuffer` that CuPy and PyTorch view without a copy.

This is what the client library uses, and it never imports the engine: its only CUDA access is
`priod.common.cuda.driver`, which loads cuda-bindings on first use (importing this module
needs neither a GPU nor cuda-bindings). Calls run with the array's device made current and the
caller's current device restored afterwards, so the application's own device is left alone.

GPUs are named to the daemon by UUID (`gpu_uuid` of this process's ordinal), and a UUID the
daemon returns is mapped back to this process's ordinal (`local_ordinal`): the two processes
may number the GPUs differently (CUDA_VISIBLE_DEVICES, containers).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, Self

import numpy as np

from priod.common.cuda.driver import (
    DeviceScope,
    IpcTable,
    bindings,
    check,
    gpu_uuid,
    handle_to_bytes,
    local_ordinal,
)
from priod.common.cuda.vmm import vmm_import, vmm_map, vmm_unmap
from priod.errors import CudaError, EngineError

__all__ = [
    "CudaBuffer",
    "DeviceBuffer",
    "DeviceBytes",
    "InterprocessEvent",
    "device_span",
    "export_cuda_array",
    "export_device_buffer",
    "gpu_uuid",
    "ipc_event",
    "local_ordinal",
    "open_device_export",
    "open_device_fd",
]

_client_ipc = IpcTable()
"""The daemon allocations this process has open, each opened once however many buffers use it."""


class DeviceBuffer(NamedTuple):
    """A client's device buffer as the daemon needs it (`export_device_buffer`)."""

    handle: bytes
    """The IPC handle of the whole allocation the buffer lives in (its base, not the buffer);
    for ``pool_fd`` the allocation's 64-byte ``CUmemPoolPtrExportData``; empty for ``vmm_fd``."""
    offset: int
    """The buffer's offset into that allocation."""
    nbytes: int
    device: int
    """This process's ordinal of the buffer's GPU."""
    pointer: int
    """The buffer's address in this process (``tensor.data_ptr()``)."""
    kind: str = "cuda_ipc"
    """``cuda_ipc`` (``handle`` names ``cudaMalloc`` memory), ``vmm_fd`` (``fd`` names a
    ``cuMemCreate`` allocation of ``size`` bytes) or ``pool_fd`` (``fd`` names the
    stream-ordered pool, ``handle`` the allocation of ``size`` bytes in it)."""
    fd: int = -1
    """For ``vmm_fd`` and ``pool_fd``: the allocation's (the pool's) POSIX fd, the caller's to
    pass along and close."""
    size: int = 0
    """For ``vmm_fd`` and ``pool_fd``: the whole allocation's size (for ``vmm_fd`` the daemon
    maps all of it)."""


def device_span(obj: object) -> tuple[int, int]:
    """``(pointer, nbytes)`` of a contiguous CUDA buffer: a PyTorch tensor of any dtype, or
    anything with ``__cuda_array_interface__`` (CuPy, Numba, `CudaBuffer`).

    PyTorch tensors are read through ``data_ptr()``, ``element_size()`` and ``is_contiguous()``,
    never their ``__cuda_array_interface__``: torch builds that from a dtype table which has no
    fp8 types (``KeyError: torch.float8_e4m3fn``), and ``data_ptr`` is what every dtype has.

    Raises:
        TypeError: ``obj`` is neither (or is a tensor on the CPU).
        ValueError: The buffer is not C-contiguous, or is empty.
    """
    if _is_torch_tensor(obj):
        t: Any = obj
        if not t.is_cuda:
            raise TypeError(
                f"this tensor is on {t.device}, not on a GPU: for host memory use alloc_host and its Region.torch() view"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"the tensor is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): pass .contiguous() or a contiguous view"
            )
        nbytes = int(t.numel()) * int(t.element_size())
        if nbytes == 0:
            raise ValueError("the tensor is empty")
        return int(t.data_ptr()), nbytes
    try:
        cai: dict[str, Any] = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(
            f"{type(obj).__name__} has no __cuda_array_interface__: pass a CuPy array or a CUDA tensor"
        ) from None
    pointer = int(cai["data"][0])
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None:
        expected = itemsize
        for extent, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if extent > 1 and int(stride) != expected:
                raise ValueError(
                    f"the array is not C-contiguous (shape {shape}, strides {tuple(strides)}): copy it first"
                )
            expected *= extent
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        raise ValueError("the array is empty")
    return pointer, nbytes


def _is_torch_tensor(obj: object) -> bool:
    """A ``torch.Tensor`` (or subclass), recognised without importing torch: a process that
    never imported torch has no tensors to pass."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


POOL_HINT = (
    "it comes from a stream-ordered pool (cudaMallocAsync; in PyTorch PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) "
    "that was not created shareable (a device's default pool, which PyTorch's cudaMallocAsync backend uses, never is), "
    "so priod cannot share it: allocate the buffer from a pool created with a POSIX file descriptor handle type "
    "(cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor; in the driver API CUmemPoolProps.handleTypes = "
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), or run PyTorch with its native allocator (leave backend unset, or "
    "PYTORCH_CUDA_ALLOC_CONF=backend:native), or allocate the buffer with priod's alloc_device and view it with Region.torch()"
)
VMM_HINT = (
    "it was mapped with cuMemCreate (virtual memory management; in PyTorch PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
    "without a POSIX file descriptor handle type (CUmemAllocationProp.requestedHandleTypes lacks "
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; PyTorch picks fabric handles where the system grants them), "
    "so priod cannot share it: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False for this process, "
    "or allocate the buffer with priod's alloc_device and view it with Region.torch()"
)


def _unshareable(drv: Any, pointer: int) -> str | None:
    """Why ``pointer``'s memory cannot be shared by ``cudaIpcGetMemHandle``, or None if it can
    (or the driver cannot say): `POOL_HINT` for a stream-ordered pool's memory, `VMM_HINT` for
    other memory (``cuMemCreate``'s). Asked first, because the handle call itself fails with a
    bare ``cudaErrorInvalidValue`` that names neither cause nor fix; the caller then tries the
    fd export of that kind of memory, whose failure is what the hint explains."""
    attr = drv.CUpointer_attribute
    try:
        capable = check(drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pointer))
    except (CudaError, AttributeError):
        return None  # an old driver or binding: the handle call decides
    if capable:
        return None
    try:
        pool = check(drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, pointer))
        in_pool = bool(int(pool))
    except (CudaError, AttributeError, TypeError, ValueError):
        in_pool = False
    return POOL_HINT if in_pool else VMM_HINT


def export_device_buffer(obj: object) -> DeviceBuffer:
    """Describe a contiguous CUDA buffer (see `device_span`) so that the daemon can open it.

    A caching allocator (PyTorch's, CuPy's) hands out pieces of larger ``cudaMalloc``
    segments, and an IPC handle can only name a segment's base: the handle is of the base
    (``cuMemGetAddressRange``), with the buffer's offset into it. The caller must keep the buffer
    alive while the daemon uses it, and make sure the producer's stream has finished writing it
    before a copy starts.

    Memory that CUDA IPC handles cannot share goes by a POSIX fd instead (the caller's to send
    and close): ``cuMemCreate`` memory by its allocation's (`_export_vmm`), a stream-ordered
    pool's by the pool's with the allocation's export data (`_export_pool`).

    Raises:
        TypeError, ValueError: As `device_span`.
        EngineError: The memory cannot be shared; the message says which allocator setting to
            change (PyTorch's expandable segments without POSIX fd handles, ``cudaMallocAsync``
            from a pool that is not shareable, such as a device's default pool).
    """
    pointer, nbytes = device_span(obj)
    rt, drv = bindings()
    check(drv.cuInit(0))
    device = int(check(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)))
    with DeviceScope(device):
        why = _unshareable(drv, pointer)
        if why is VMM_HINT:
            return _export_vmm(drv, pointer, nbytes, device)
        if why is POOL_HINT:
            return _export_pool(drv, pointer, nbytes, device)
        if why is not None:
            raise EngineError(f"this buffer's memory cannot be registered with priod: {why}")
        base, _size = check(drv.cuMemGetAddressRange(pointer))
        base = int(base)
        try:
            handle = check(rt.cudaIpcGetMemHandle(base))
        except CudaError as exc:
            # The attributes did not tell (an old driver): name both PyTorch settings that cause this.
            raise EngineError(
                f"this buffer's memory cannot be registered with priod: cudaIpcGetMemHandle refused it ({exc}); allocate it "
                "with cudaMalloc (the default allocators of CuPy and PyTorch): in PyTorch set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and leave backend unset (or PYTORCH_CUDA_ALLOC_CONF=backend:native), "
                "or allocate the buffer with priod's alloc_device and view it with Region.torch()"
            ) from exc
    return DeviceBuffer(handle_to_bytes(handle), pointer - base, nbytes, device, pointer)


def _export_vmm(drv: Any, pointer: int, nbytes: int, device: int) -> DeviceBuffer:
    """Describe a buffer in ``cuMemCreate`` memory by a POSIX fd of its allocation.

    The buffer must lie within one allocation: PyTorch's expandable segments map many (2 MiB
    pages in the small pool, 20 MiB in the large) side by side in one address range, and the
    daemon maps what one fd names, whole. The allocation's extent is where the retained handle
    stays the pointer's (the driver returns the very handle value that was mapped): first the
    ends of ``cuMemGetAddressRange``'s range, and where those are another allocation's, a walk
    in steps of the allocation granularity (every mapping starts and ends on one).
    """
    retained: list[Any] = []

    def retain(address: int) -> int | None:
        try:
            handle = check(drv.cuMemRetainAllocationHandle(address))
        except CudaError:
            return None  # not cuMemMap-ed there
        retained.append(handle)
        return int(handle)

    try:
        handle = retain(pointer)
        if handle is None:
            # Neither IPC-capable nor from a pool, nor cuMemMap-ed: the driver did not say why.
            raise EngineError(f"this buffer's memory cannot be registered with priod: {VMM_HINT}")
        prop = check(drv.cuMemGetAllocationPropertiesFromHandle(retained[0]))
        posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            requested = int(prop.requestedHandleTypes)
        except ValueError:  # a mask of several types is no member of the bindings' enum: let the export decide
            requested = int(posix_fd)
        if not requested & int(posix_fd):
            raise EngineError(f"this buffer's memory cannot be registered with priod: {VMM_HINT}")
        base, size = check(drv.cuMemGetAddressRange(pointer))
        base, size = int(base), int(size)
        last = pointer + nbytes - 1
        if last >= base + size or retain(last) != handle:
            raise EngineError(
                f"this buffer ({nbytes} bytes at 0x{pointer:x}) spans several cuMemCreate allocations (PyTorch's expandable segments "
                "map one per 2 MiB or 20 MiB page), and priod registers one allocation per region: register smaller pieces, each "
                "within one page, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or allocate it with priod's alloc_device "
                "and view it with Region.torch()"
            )
        if retain(base) != handle or retain(base + size - 1) != handle:
            step = int(
                check(
                    drv.cuMemGetAllocationGranularity(
                        prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                    )
                )
            )
            lo, hi = pointer - pointer % step, last - last % step + step
            while lo - step >= base and retain(lo - step) == handle:
                lo -= step
            while hi < base + size and retain(hi) == handle:
                hi += step
            base, size = lo, hi - lo
        try:
            fd = int(check(drv.cuMemExportToShareableHandle(retained[0], posix_fd, 0)))
        except CudaError as exc:
            raise EngineError(
                f"this buffer's memory cannot be registered with priod: cuMemExportToShareableHandle refused it ({exc}); {VMM_HINT}"
            ) from exc
    finally:
        # A retain counts a reference like cuMemCreate's; the mapping keeps the memory alive.
        for h in retained:
            drv.cuMemRelease(h)
    return DeviceBuffer(b"", pointer - base, nbytes, device, pointer, "vmm_fd", fd, size)


def _export_pool(drv: Any, pointer: int, nbytes: int, device: int) -> DeviceBuffer:
    """Describe a buffer in a stream-ordered pool's memory by a POSIX fd of the pool
    (``cuMemPoolExportToShareableHandle``, which only a pool created with that handle type
    gives) and the 64-byte export data of its allocation (``cuMemPoolExportPointer`` of the
    allocation's base, ``cuMemGetAddressRange``'s), with the buffer's offset into it."""
    pool = check(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, pointer))
    posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    try:
        fd = int(check(drv.cuMemPoolExportToShareableHandle(pool, posix_fd, 0)))
    except CudaError as exc:
        raise EngineError(
            f"this buffer's memory cannot be registered with priod: cuMemPoolExportToShareableHandle refused its pool ({exc}); {POOL_HINT}"
        ) from exc
    try:
        base, size = check(drv.cuMemGetAddressRange(pointer))
        base, size = int(base), int(size)
        if pointer + nbytes > base + size:
            raise EngineError(
                f"this buffer ({nbytes} bytes at 0x{pointer:x}) runs past the end of its pool allocation (0x{base:x}, {size} bytes), "
                "and priod registers one allocation per region: register the part within each allocation separately"
            )
        try:
            export = handle_to_bytes(check(drv.cuMemPoolExportPointer(base)))
        except CudaError as exc:
            raise EngineError(
                f"this buffer's memory cannot be registered with priod: cuMemPoolExportPointer refused its allocation ({exc}); {POOL_HINT}"
            ) from exc
    except BaseException:
        os.close(fd)
        raise
    return DeviceBuffer(export, pointer - base, nbytes, device, pointer, "pool_fd", fd, size)


def export_cuda_array(obj: object) -> tuple[bytes, int, int, int]:
    """``(ipc_handle, offset, nbytes, device)`` of `export_device_buffer` (its first four
    fields), for memory CUDA IPC handles share; ``cuMemCreate`` and pool memory need the fd of
    `export_device_buffer` and are refused here.

    Raises:
        EngineError: the buffer is ``cuMemCreate`` or pool memory, or as `export_device_buffer`.
    """
    buf = export_device_buffer(obj)
    if buf.kind != "cuda_ipc":
        os.close(buf.fd)
        raise EngineError(
            f"this buffer is {'stream-ordered pool' if buf.kind == 'pool_fd' else 'cuMemCreate'} memory, which has no CUDA IPC handle: "
            f"use export_device_buffer (its kind {buf.kind!r} and fd)"
        )
    return buf.handle, buf.offset, buf.nbytes, buf.device


class CudaBuffer:
    """Device memory another process shares, opened here as a flat uint8 CUDA array: by a
    CUDA IPC handle (`open_device_export`) or a ``cuMemCreate`` allocation's POSIX fd
    (`open_device_fd`, a device region the daemon allocated).

    ``cupy.asarray(buf)`` and ``torch.as_tensor(buf, device="cuda")`` view it without a copy.
    `close` (or leaving a ``with`` block) closes the handle once no other buffer uses it; views
    made from the buffer must not be used after that.
    """

    def __init__(self, pointer: int, nbytes: int, device: int, release: Callable[[], None]) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.device = device
        self._release = release
        self._closed = False

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        if self._closed:
            raise ValueError("the CudaBuffer is closed")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False), "strides": None, "version": 3}

    def close(self) -> None:
        """Close the handle (when this is its last buffer in the process). Idempotent."""
        if not self._closed:
            self._closed = True
            with DeviceScope(self.device):
                self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"0x{self.pointer:x}"
        return f"CudaBuffer(gpu{self.device}, {self.nbytes} bytes, {state})"


class DeviceBytes:
    """Device memory this process has already (a buffer it registered) as a flat uint8 CUDA
    array, so torch can view its bytes whatever the buffer's dtype; keeps ``owner`` alive."""

    def __init__(self, owner: object, pointer: int, nbytes: int, device: int) -> None:
        self.owner, self.pointer, self.nbytes, self.device = owner, pointer, nbytes, device

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False), "strides": None, "version": 3}

    def close(self) -> None:
        """Nothing to close: the memory is the owner's."""


def open_device_export(ipc_handle: bytes, offset: int, nbytes: int, device: int) -> CudaBuffer:
    """Open a device region another process exported (``DeviceExport.ipc_handle`` of a region
    the daemon allocated). A handle cannot be opened in the process that made it.

    Raises:
        CudaError: CUDA refused the handle (wrong device, the exporter freed it, same process).
    """
    if nbytes <= 0 or offset < 0:
        raise ValueError(f"bad device region: offset {offset}, {nbytes} bytes")
    bindings()
    handle = bytes(ipc_handle)
    with DeviceScope(device):
        base = _client_ipc.acquire(handle, device)
    return CudaBuffer(base + offset, nbytes, device, lambda: _client_ipc.release(handle, device))


def open_device_fd(fd: int, size: int, offset: int, nbytes: int, device: int) -> CudaBuffer:
    """Map a ``cuMemCreate`` allocation of ``size`` bytes from its POSIX fd (a device region the
    daemon allocated; ``fd`` stays the caller's) with read/write access for ``device``, this
    process's ordinal of its GPU, and view ``nbytes`` at ``offset``. The mapping holds the
    allocation until `CudaBuffer.close`.

    Raises:
        CudaError: CUDA refused the fd or the mapping.
    """
    if nbytes <= 0 or offset < 0 or offset + nbytes > size:
        raise ValueError(f"bad device region: offset {offset}, {nbytes} bytes, in an allocation of {size}")
    rt, drv = bindings()
    with DeviceScope(device):
        check(rt.cudaFree(0))  # the device's primary context current on this thread, for the driver calls
        mapping = vmm_map(drv, vmm_import(drv, fd), size, [device])
    return CudaBuffer(mapping.base + offset, nbytes, device, lambda: vmm_unmap(mapping))


def _stream(stream: Any) -> int:
    """A stream as the runtime takes it: an int handle, or an object that has one (a
    ``torch.cuda.Stream``'s ``cuda_stream``, a CuPy stream's ``ptr``); 0 or None: the legacy
    default stream."""
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


class InterprocessEvent:
    """A CUDA event another process can open: made with ``cudaEventInterprocess |
    cudaEventDisableTiming`` (interprocess events cannot time), on one GPU (``device``, this
    process's ordinal); ``handle`` is its ``cudaIpcEventHandle_t``, what ``wait_event`` and
    ``signal_event`` take. PyTorch users may use ``torch.cuda.Event(interprocess=True)`` instead.

    Keep it alive while a copy names it, and until the connection that named it is closed:
    the daemon opens each handle once per connection and keeps it.
    """

    def __init__(self, device: int | None = None) -> None:
        rt, _ = bindings()
        self.device = int(check(rt.cudaGetDevice())) if device is None else device
        with DeviceScope(self.device):
            self.event: Any = check(rt.cudaEventCreateWithFlags(rt.cudaEventInterprocess | rt.cudaEventDisableTiming))
            try:
                self.handle = handle_to_bytes(check(rt.cudaIpcGetEventHandle(self.event)))
            except BaseException:
                rt.cudaEventDestroy(self.event)
                raise

    def record(self, stream: Any = None) -> None:
        """Record on ``stream`` (behind the kernel that produces a copy's source; before sending
        the copy with ``wait_event=`` this event)."""
        rt, _ = bindings()
        with DeviceScope(self.device):
            check(rt.cudaEventRecord(self.event, _stream(stream)))

    def wait(self, stream: Any = None) -> None:
        """Make ``stream``'s later work wait for the event's latest record (after a copy's
        ``recorded()`` returned, for a ``signal_event``); the host does not wait."""
        rt, _ = bindings()
        with DeviceScope(self.device):
            check(rt.cudaStreamWaitEvent(_stream(stream), self.event, 0))

    def query(self) -> bool:
        """True once the work before its latest record has completed (never blocks)."""
        rt, _ = bindings()
        err = rt.cudaEventQuery(self.event)[0]
        if err == rt.cudaError_t.cudaErrorNotReady:
            return False
        check((err,))
        return True

    def synchronize(self) -> None:
        """Block the host until the event completes."""
        rt, _ = bindings()
        check(rt.cudaEventSynchronize(self.event))

    def close(self) -> None:
        """Destroy the event (idempotent). A daemon's open copy of it is the daemon's to close."""
        if self.event is not None:
            rt, _ = bindings()
            with DeviceScope(self.device):
                check(rt.cudaEventDestroy(self.event))
            self.event = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ipc_event(device: int | None = None) -> InterprocessEvent:
    """A new `InterprocessEvent` on GPU ``device`` (this process's ordinal; default: the current
    device). Pass it (or its ``handle``) as a copy's ``wait_event`` or ``signal_event``."""
    return InterprocessEvent(device)
