"""The one module of priod that imports ``cuda.bindings``, and the CUDA calls both sides share.

The bindings load on first use (`bindings`), so importing this module, or anything that
imports it, needs neither a GPU nor cuda-bindings; the first real CUDA call needs both and says
which is missing. This module imports nothing heavier than ``ctypes``, so the client-side
helpers (`priod.client.cuda_ipc`) import it without pulling in the engine.

Every CUDA call of priod goes through `check`, which turns cuda-python's ``(err, value...)``
tuples into values or `CudaError`, for the runtime (``cudaError_t``) and the driver
(``CUresult``) API alike.

Besides: `gpu_available` (the probe behind ``--backend auto``), `device_count`, `DeviceScope`
(make a device current for client-side calls, then restore the caller's), and CUDA IPC handles
(`handle_to_bytes`, `handle_from_bytes`, and `IpcTable`, which opens each handle once per
process: the daemon keeps one table for the client memory it imports, the client library one
for the daemon memory it opens).

Tests put stand-ins in place of the bindings with `use_bindings` (``priod.testing.FakeCuda``
does), so every caller of `bindings`, `check` and `status_codes` meets the fakes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Any

from priod.common.gpus import format_uuid, uuid_key
from priod.errors import CudaError, EngineError, InvalidRequest

__all__ = [
    "INSTALL_HINT",
    "SIM_HINT",
    "BindingsOverride",
    "DeviceScope",
    "IpcTable",
    "bindings",
    "check",
    "device_count",
    "error",
    "event_handle_from_bytes",
    "gpu_available",
    "gpu_uuid",
    "handle_from_bytes",
    "handle_to_bytes",
    "local_ordinal",
    "one_gpu",
    "pool_export_from_bytes",
    "status_codes",
    "use_bindings",
]

INSTALL_HINT = "pip install 'priod[cuda13]' (NVIDIA driver >= 580) or 'priod[cuda12]' (driver >= 525)"
SIM_HINT = "--backend sim runs without a GPU"

# The cuda.bindings modules and their success/not-ready codes, loaded on first use.
_rt: Any = None
_drv: Any = None
_RT_OK: Any = None
_DRV_OK: Any = None
_NOT_READY: Any = None
_bindings_lock = threading.Lock()


def bindings() -> tuple[Any, Any]:
    """The ``(runtime, driver)`` modules of cuda.bindings, imported on first use.

    Raises:
        EngineError: cuda-bindings is not installed; the message says how to install it and
            that ``--backend sim`` runs without a GPU.
    """
    global _rt, _drv, _RT_OK, _DRV_OK, _NOT_READY
    if _rt is None:
        with _bindings_lock:
            if _rt is None:
                try:
                    from cuda.bindings import driver, runtime
                except ImportError as exc:
                    raise EngineError(
                        f"the cuda backend needs cuda-bindings, which is not installed ({exc}): "
                        f"{INSTALL_HINT}; {SIM_HINT}"
                    ) from exc
                _drv = driver
                _DRV_OK = driver.CUresult.CUDA_SUCCESS
                _NOT_READY = runtime.cudaError_t.cudaErrorNotReady
                _RT_OK = runtime.cudaError_t.cudaSuccess
                _rt = runtime
    return _rt, _drv


class BindingsOverride:
    """What `use_bindings` replaced: `restore` (or the end of a ``with`` block) puts it back."""

    def __init__(self, previous: tuple[Any, Any, Any, Any, Any]) -> None:
        self._previous: tuple[Any, Any, Any, Any, Any] | None = previous

    def restore(self) -> None:
        """Put back the modules and status codes in use before (once; later calls do nothing)."""
        global _rt, _drv, _RT_OK, _DRV_OK, _NOT_READY
        with _bindings_lock:
            if self._previous is None:
                return
            _drv, _RT_OK, _DRV_OK, _NOT_READY = self._previous[1:]
            _rt, self._previous = self._previous[0], None
        one_gpu.cache_clear()

    def __enter__(self) -> BindingsOverride:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def use_bindings(runtime: Any, driver: Any) -> BindingsOverride:
    """Use ``runtime`` and ``driver`` as cuda.bindings' ``runtime`` and ``driver`` modules, from
    now until the returned `BindingsOverride` is restored: the seam for tests, whose fakes then
    answer every CUDA call of priod (``priod.testing.FakeCuda`` is one).

    The status codes come from them as from the real modules: ``runtime.cudaError_t.cudaSuccess``
    and ``.cudaErrorNotReady``, ``driver.CUresult.CUDA_SUCCESS``. ``(None, None)`` stands for
    bindings not loaded yet: the next `bindings` imports them. `one_gpu`'s answer is forgotten
    both here and on restore, since it came from the bindings. Overrides nest if restored in
    the reverse order (``with use_bindings(rt, drv): ...`` does)."""
    global _rt, _drv, _RT_OK, _DRV_OK, _NOT_READY
    if (runtime is None) != (driver is None):
        raise ValueError("use_bindings takes both modules, or neither (None, None: not loaded yet)")
    codes = (
        (None, None, None)
        if runtime is None
        else (runtime.cudaError_t.cudaSuccess, driver.CUresult.CUDA_SUCCESS, runtime.cudaError_t.cudaErrorNotReady)
    )
    with _bindings_lock:
        previous = (_rt, _drv, _RT_OK, _DRV_OK, _NOT_READY)
        _drv, (_RT_OK, _DRV_OK, _NOT_READY) = driver, codes
        _rt = runtime  # last, as in `bindings`: a thread that sees it set sees the rest
    one_gpu.cache_clear()
    return BindingsOverride(previous)


def status_codes() -> tuple[Any, Any]:
    """``(cudaSuccess, cudaErrorNotReady)``, the two answers of a query that are not errors."""
    bindings()
    return _RT_OK, _NOT_READY


def error(err: Any) -> CudaError:
    """Build the CudaError for a runtime (cudaError_t) or driver (CUresult) error code."""
    name = str(getattr(err, "name", err))
    explanation = ""
    with contextlib.suppress(Exception):  # naming an error must never hide it
        if _rt is not None and isinstance(err, _rt.cudaError_t):
            e1, n = _rt.cudaGetErrorName(err)
            e2, s = _rt.cudaGetErrorString(err)
            name = n.decode() if e1 is _RT_OK else name
            explanation = s.decode() if e2 is _RT_OK else ""
        elif _drv is not None and isinstance(err, _drv.CUresult):
            e1, n = _drv.cuGetErrorName(err)
            e2, s = _drv.cuGetErrorString(err)
            name = n.decode() if e1 is _DRV_OK else name
            explanation = s.decode() if e2 is _DRV_OK else ""
    return CudaError(name, explanation)


def check(result: tuple[Any, ...]) -> Any:
    """Turn a cuda-python result ``(err, value...)`` into its value(s), or raise `CudaError`.

    Returns None for ``(err,)``, the value for ``(err, value)`` and a tuple for more values.
    Works for both the runtime (``cudaError_t``) and the driver (``CUresult``) API.
    """
    err = result[0]
    if err is not _RT_OK and err is not _DRV_OK:
        if _rt is None:  # called before anything loaded the bindings: load them and look again
            bindings()
            return check(result)
        raise error(err)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def gpu_available() -> bool:
    """True if cuda-bindings is installed, a driver loads and at least one GPU is visible.

    Never raises: this is what ``--backend auto`` and the test suite's skip marks ask.
    """
    try:
        rt, _ = bindings()
        err, count = rt.cudaGetDeviceCount()
        return err is _RT_OK and int(count) > 0
    except Exception:
        return False


def device_count() -> int:
    """The number of visible GPUs; EngineError with the reason and the fix if there are none."""
    rt, _ = bindings()
    err, count = rt.cudaGetDeviceCount()
    if err is _RT_OK and int(count) > 0:
        return int(count)
    if err is _RT_OK or err is rt.cudaError_t.cudaErrorNoDevice:
        why = "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    elif err is rt.cudaError_t.cudaErrorInsufficientDriver:
        why = (
            "no usable NVIDIA driver: it is missing or older than the CUDA version of "
            "cuda-bindings (install or update the NVIDIA driver)"
        )
    else:
        why = f"CUDA could not start ({error(err)})"
    raise EngineError(f"the cuda backend cannot run here: {why}; {SIM_HINT}")


def gpu_uuid(ordinal: int) -> str:
    """The UUID of this process's GPU ``ordinal`` (as CUDA_VISIBLE_DEVICES numbers them here),
    formatted as nvidia-smi prints it. The driver API's ``cuDeviceGetUuid_v2`` where the bindings
    have it (12.x: the plain call predates MIG UUIDs), else ``cuDeviceGetUuid`` (13.x: MIG-aware)."""
    _, drv = bindings()
    check(drv.cuInit(0))
    dev = check(drv.cuDeviceGet(ordinal))
    get = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    uuid = check(get(dev))
    # Through its address, as for IPC handles: ``CUuuid.bytes`` has not had one type in every release.
    return format_uuid(ctypes.string_at(int(uuid.getPtr()), 16))


def local_ordinal(device_uuid: str) -> int:
    """This process's ordinal of the GPU with that UUID, whatever its CUDA_VISIBLE_DEVICES.

    Raises:
        EngineError: no GPU visible to this process has that UUID (the message lists those that are).
    """
    _, drv = bindings()
    check(drv.cuInit(0))
    key = uuid_key(device_uuid)
    seen = []
    for ordinal in range(int(check(drv.cuDeviceGetCount()))):
        text = gpu_uuid(ordinal)
        if uuid_key(text) == key:
            return ordinal
        seen.append(f"{ordinal}={text}")
    raise EngineError(
        f"GPU {device_uuid} is not visible to this process (it sees {', '.join(seen) or 'no GPU'}); "
        "check its CUDA_VISIBLE_DEVICES, or the container's GPU assignment"
    )


@functools.cache
def one_gpu() -> bool:
    """Whether this process sees exactly one GPU (asked once: CUDA_VISIBLE_DEVICES is read at
    start-up and never again)."""
    return device_count() == 1


class DeviceScope:
    """Make ``device`` current for a block of client-side calls, then restore the caller's device.

    Client helpers run inside an application (PyTorch, CuPy) whose current device we must not
    change behind its back. A process that sees one GPU has only device 0 to be current, so the
    scope asks nothing: on a thread just woken, ``cudaGetDevice`` costs a direct 64 KiB copy
    ~4 us at p50 and ~16 at p99 (H200; docs/benchmarks.md).
    """

    def __init__(self, device: int) -> None:
        self._device = device
        self._previous: int | None = None

    def __enter__(self) -> None:
        if self._device == 0 and one_gpu():
            return
        rt, _ = bindings()
        self._previous = int(check(rt.cudaGetDevice()))
        if self._previous != self._device:
            check(rt.cudaSetDevice(self._device))

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None and self._previous != self._device:
            _rt.cudaSetDevice(self._previous)


def handle_to_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``cudaIpcMemHandle_t``, ``cudaIpcEventHandle_t`` or
    ``CUmemPoolPtrExportData`` (through its address: works on every version)."""
    return ctypes.string_at(int(handle.getPtr()), 64)


def handle_from_bytes(data: bytes) -> Any:
    """A ``cudaIpcMemHandle_t`` holding ``data``; InvalidRequest unless it is 64 bytes."""
    rt, _ = bindings()
    return _ipc_handle(rt.cudaIpcMemHandle_t, data, "CUDA IPC handle")


def _ipc_handle(kind: Any, data: bytes, what: str) -> Any:
    if len(data) != 64:
        raise InvalidRequest(f"a {what} is 64 bytes, this one is {len(data)}")
    handle = kind()
    ctypes.memmove(int(handle.getPtr()), data, 64)
    return handle


def pool_export_from_bytes(data: bytes) -> Any:
    """A ``CUmemPoolPtrExportData`` (what ``cuMemPoolExportPointer`` gave for a pool allocation)
    holding ``data``; InvalidRequest unless it is 64 bytes. `handle_to_bytes` reads one back."""
    _, drv = bindings()
    return _ipc_handle(drv.CUmemPoolPtrExportData, data, "pool allocation's export data (CUmemPoolPtrExportData)")


def event_handle_from_bytes(data: bytes) -> Any:
    """A ``cudaIpcEventHandle_t`` holding ``data``; InvalidRequest unless it is 64 bytes."""
    rt, _ = bindings()
    return _ipc_handle(rt.cudaIpcEventHandle_t, data, "CUDA IPC event handle")


class IpcTable:
    """Opened IPC handles, counted: one allocation is opened once per process however many
    regions (a pool allocator hands out many arrays from one allocation) point into it, since
    CUDA IPC does not promise that a second open of the same handle in one process works."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, bytes], list[int]] = {}
        self._lock = threading.Lock()

    def acquire(self, handle: bytes, device: int) -> int:
        """Open (or reuse) ``handle`` with ``device`` current; return the allocation's base."""
        rt, _ = bindings()
        key = (device, handle)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                base = int(check(rt.cudaIpcOpenMemHandle(handle_from_bytes(handle), rt.cudaIpcMemLazyEnablePeerAccess)))
                entry = self._open[key] = [base, 0]
            entry[1] += 1
            return entry[0]

    def release(self, handle: bytes, device: int) -> None:
        """Drop one reference; close the handle when the last region goes."""
        key = (device, handle)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._open[key]
        check(_rt.cudaIpcCloseMemHandle(entry[0]))

    def close_all(self) -> list[BaseException]:
        """Close every handle still open, whatever its count; return the errors met."""
        errors: list[BaseException] = []
        with self._lock:
            entries, self._open = list(self._open.items()), {}
        for (device, _), (base, _refs) in entries:
            try:
                check(_rt.cudaSetDevice(device))
                check(_rt.cudaIpcCloseMemHandle(base))
            except CudaError as exc:
                errors.append(exc)
        return errors
