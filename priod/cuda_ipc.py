"""Client side of CUDA IPC: share device memory with the daemon, open what the daemon shares.

`export_cuda_array` describes a client's CUDA array (CuPy, PyTorch) by the IPC handle of its
allocation, for ``register_device``; `open_device_export` opens a device region the daemon
allocated, as a `CudaBuffer` that CuPy and PyTorch view without a copy.

This is what the client library uses, and it never imports the engine: its only CUDA access is
`priod.engines.cuda._driver`, which loads cuda-bindings on first use (importing this module
needs neither a GPU nor cuda-bindings). Calls run with the array's device made current and the
caller's current device restored afterwards, so the application's own device is left alone.

GPUs are named to the daemon by UUID (`gpu_uuid` of this process's ordinal), and a UUID the
daemon returns is mapped back to this process's ordinal (`local_ordinal`): the two processes
may number the GPUs differently (CUDA_VISIBLE_DEVICES, containers).
"""

from __future__ import annotations

import math
from typing import Any, Self

import numpy as np

from priod.engines.cuda._driver import (
    DeviceScope,
    IpcTable,
    bindings,
    check,
    gpu_uuid,
    handle_to_bytes,
    local_ordinal,
)
from priod.errors import CudaError, EngineError

__all__ = ["CudaBuffer", "InterprocessEvent", "export_cuda_array", "gpu_uuid", "ipc_event", "local_ordinal", "open_device_export"]

_client_ipc = IpcTable()
"""The daemon allocations this process has open, each opened once however many buffers use it."""


def export_cuda_array(obj: object) -> tuple[bytes, int, int, int]:
    """Describe a contiguous CUDA array (CuPy, PyTorch: anything with
    ``__cuda_array_interface__``) so that the daemon can open it.

    Returns ``(ipc_handle, offset, nbytes, device)``: the IPC handle of the whole allocation the
    array lives in (pool allocators hand out pieces of larger allocations), the array's offset
    into it, its size and its GPU. The caller must keep the array alive while the daemon uses it,
    and make sure the producer's stream has finished writing it before a copy starts.

    Raises:
        TypeError: ``obj`` has no ``__cuda_array_interface__``.
        ValueError: The array is not C-contiguous, or is empty.
        EngineError: The allocation cannot be shared by CUDA IPC (``cudaMallocAsync`` pools and
            ``cuMemCreate`` memory cannot; plain ``cudaMalloc``, CuPy's and PyTorch's default
            allocators can).
    """
    try:
        cai: dict[str, Any] = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"{type(obj).__name__} has no __cuda_array_interface__: pass a CuPy array or a CUDA tensor") from None
    pointer = int(cai["data"][0])
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None:
        expected = itemsize
        for extent, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if extent > 1 and int(stride) != expected:
                raise ValueError(f"the array is not C-contiguous (shape {shape}, strides {tuple(strides)}): copy it first")
            expected *= extent
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        raise ValueError("the array is empty")
    rt, drv = bindings()
    check(drv.cuInit(0))
    device = int(check(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)))
    with DeviceScope(device):
        base, _size = check(drv.cuMemGetAddressRange(pointer))
        base = int(base)
        try:
            handle = check(rt.cudaIpcGetMemHandle(base))
        except CudaError as exc:
            raise EngineError(
                f"this array's memory cannot be shared by CUDA IPC ({exc}): allocate it with cudaMalloc "
                "(the default allocators of CuPy and PyTorch), not from a cudaMallocAsync pool or cuMemCreate"
            ) from exc
    return handle_to_bytes(handle), pointer - base, nbytes, device


class CudaBuffer:
    """Device memory opened from another process's IPC handle, as a flat uint8 CUDA array.

    ``cupy.asarray(buf)`` and ``torch.as_tensor(buf, device="cuda")`` view it without a copy.
    `close` (or leaving a ``with`` block) closes the handle once no other buffer uses it; views
    made from the buffer must not be used after that.
    """

    def __init__(self, handle: bytes, base: int, offset: int, nbytes: int, device: int) -> None:
        self._handle = handle
        self.pointer = base + offset
        self.nbytes = nbytes
        self.device = device
        self._closed = False

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        if self._closed:
            raise ValueError("the CudaBuffer is closed")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False), "strides": None, "version": 3}

    def close(self) -> None:
        """Close the IPC handle (when this is its last buffer in the process). Idempotent."""
        if not self._closed:
            self._closed = True
            with DeviceScope(self.device):
                _client_ipc.release(self._handle, self.device)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"0x{self.pointer:x}"
        return f"CudaBuffer(gpu{self.device}, {self.nbytes} bytes, {state})"


def open_device_export(ipc_handle: bytes, offset: int, nbytes: int, device: int) -> CudaBuffer:
    """Open a device region another process exported (``DeviceExport.ipc_handle`` of a region
    the daemon allocated). A handle cannot be opened in the process that made it.

    Raises:
        CudaError: CUDA refused the handle (wrong device, the exporter freed it, same process).
    """
    if nbytes <= 0 or offset < 0:
        raise ValueError(f"bad device region: offset {offset}, {nbytes} bytes")
    bindings()
    with DeviceScope(device):
        base = _client_ipc.acquire(bytes(ipc_handle), device)
    return CudaBuffer(bytes(ipc_handle), base, offset, nbytes, device)


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
