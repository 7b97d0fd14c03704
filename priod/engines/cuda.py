"""The CUDA copy engine, and the only module of priod that imports ``cuda.bindings``.

What it is built on (measured on an H200, ``shared/design/findings.md`` and the figures below):

- Host-to-device and device-to-host copies run FIFO on one copy engine per direction, whatever
  the stream's priority. So each lane has one low-priority DMA stream for bulk chunks, which
  the scheduler keeps short, and one high-priority DMA stream for strict chunks: priority does
  nothing for copies, but a second stream lets small host-to-device copies (up to 24 KiB here)
  pass a running bulk copy, which they cannot do behind it on the same stream.
- The express path is a copy kernel (``express.cu``, shipped as ``express.ptx``) on a
  highest-priority stream, reading or writing mapped host memory through its device alias. It
  does not queue behind the copy engine: under a whole 2 GiB copy in the same direction, 64 KiB
  took 27 us (h2d) / 19 us (d2h), 1 MiB 69 / 44 us, 16 MiB 416 / 374 us, while the DMA path
  waited 36.5 ms. Stream priority matters here, for the kernel's blocks, but running blocks
  are not preempted: with every SM held by a low-priority kernel of 1 ms blocks, an express
  copy took 650-680 us; with 0.1 ms blocks, 27-45 us.
- Host memory is a client's memfd, mapped shared and pinned once with
  ``cudaHostRegister(mapped | portable)``: 0.12 ms per MiB when its pages exist already,
  0.4-0.6 ms per MiB for a fresh memfd (the pages are allocated then). Never per copy.
- Completion is an event recorded after each chunk and polled with ``cudaEventQuery``
  (0.5-1 us a poll). A ``submit`` costs 7-9 us of Python (DMA) and 8-10 us (express, of which
  ``cuLaunchKernel`` is 5 us).

Importing this module needs neither a GPU nor cuda-bindings; constructing `CudaEngine` needs
both and says so. All CUDA calls go through `check`, which turns cuda-python's ``(err, value...)``
tuples into values or `CudaError`. The client-side helpers at the bottom (`export_cuda_array`,
`open_device_export`) live here too, so that this stays the one module that talks to CUDA.

Threading: `submit` and completions run on the daemon's event loop; region set-up and teardown
(`map_host`, `alloc_device`, `import_device`, the releases) run on executor threads, since they
take milliseconds. CUDA calls are thread-safe; the tables they touch are single dict operations
or under a lock. The current device is set per call where it matters, so other code in the
process may use other devices.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import statistics as _stats
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path as _FsPath
from typing import Any, Protocol

import numpy as np

from priod.engines.base import (
    Completion,
    DeviceExport,
    DeviceMemory,
    Direction,
    Engine,
    HostMemory,
    LaneInfo,
    LaneKey,
    Memory,
    Path,
)
from priod.errors import CudaError, EngineError, InvalidRequest

__all__ = [
    "CudaEngine",
    "CudaBuffer",
    "check",
    "gpu_available",
    "export_cuda_array",
    "open_device_export",
    "EXPRESS_MAX",
    "EXPRESS_MIN_H2D",
]

EXPRESS_MAX = 64 << 20
"""Largest copy the express lane takes. Past this a kernel holds the SMs for milliseconds (16 MiB
took 340 us alone), and a bulk-sized copy belongs on the DMA path anyway."""

EXPRESS_MIN_H2D = 8 << 10
"""Host-to-device copies smaller than this go by DMA even when urgent. Small host-to-device
payloads ride in the command stream and pass a running bulk copy on *another* stream (findings
section 2; hence the lane's separate strict stream), need no SM, and alone beat the kernel's
launch by 2-5 us. Measured on the H200 (driver 580.159), ``submit`` to ``done()`` from Python,
medians of 7-11; DMA on the lane's strict stream, the bulk a whole 2 GiB copy on its DMA stream:

    size      alone: DMA / express     under bulk: DMA / express
    1 KiB         10.2 / 15.0 us           30.6 / 60.6 us (express: one noisy run)
    4 KiB         10.7 / 13.6              24.8 / 24.0-27.5
    8 KiB         11.7 / 13.9              49.9-68.9 / 25.7
    12-24 KiB       -                      25.7-41.4 / 25.8-27.6
    28 KiB          -                      36,395 (waits for all the bulk) / -
    32 KiB        11.7 / 14.8              36,503 / 26.1-28.2
    64 KiB        12.3 / 15.2              36,520 / 26.5-28.1
    1 MiB         30.7 / 34.6              36,808 / 67-69
    16 MiB       334.3 / 343.8             36,564 / 414-417

So under load the kernel wins from 8 KiB (and ties at 4 KiB); DMA passes the bulk only up to
24 KiB (the driver's inline limit, which may differ elsewhere), and a 1 KiB copy on the bulk's
own stream waits the whole 36.6 ms. Below 8 KiB DMA is as fast and leaves the SMs alone."""

EXPRESS_THREADS = 1024
EXPRESS_BLOCKS_PER_SM = 2
"""Grid of at most two 1024-thread blocks per SM: one full wave, as the kernel is capped at 32
registers per thread (``__launch_bounds__(1024, 2)``). Measured, median us, 1 / 2 / 4 blocks
per SM: alone h2d 1 MiB 41 / 35 / 50, 16 MiB 355 / 344 / 342; under a bulk copy h2d 16 MiB
496 / 414 / 419, d2h 16 MiB 458 / 387 / 380 (1 MiB under bulk: too noisy to rank)."""
EXPRESS_UNROLL = 4
"""Loads in flight per thread, as ``UNROLL`` in ``express.cu``; used to size small grids."""

PTX_PATH = _FsPath(__file__).with_name("express.ptx")
KERNEL_NAME = b"priod_copy"

_INSTALL_HINT = "pip install 'priod[cuda]'"
_SIM_HINT = "--backend sim runs without a GPU"

# The cuda.bindings modules and their success/not-ready codes, loaded on first use.
_rt: Any = None
_drv: Any = None
_RT_OK: Any = None
_DRV_OK: Any = None
_NOT_READY: Any = None
_bindings_lock = threading.Lock()


class _Log(Protocol):
    """The subset of a structlog logger this module uses."""

    def info(self, event: str, /, **kw: Any) -> Any: ...

    def warning(self, event: str, /, **kw: Any) -> Any: ...


class _StdLog:
    """A stdlib-logging stand-in for a structlog logger (``log.info("event", key=value)``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def info(self, event: str, /, **kw: Any) -> None:
        self._logger.info("%s %s", event, " ".join(f"{k}={v!r}" for k, v in kw.items()))

    def warning(self, event: str, /, **kw: Any) -> None:
        self._logger.warning("%s %s", event, " ".join(f"{k}={v!r}" for k, v in kw.items()))


def _bindings() -> tuple[Any, Any]:
    """Import cuda.bindings on first use; raise EngineError if it is not installed."""
    global _rt, _drv, _RT_OK, _DRV_OK, _NOT_READY
    if _rt is None:
        with _bindings_lock:
            if _rt is None:
                try:
                    from cuda.bindings import driver, runtime
                except ImportError as exc:
                    raise EngineError(
                        f"the cuda backend needs cuda-bindings, which is not installed ({exc}): "
                        f"{_INSTALL_HINT}; {_SIM_HINT}"
                    ) from exc
                _drv = driver
                _DRV_OK = driver.CUresult.CUDA_SUCCESS
                _NOT_READY = runtime.cudaError_t.cudaErrorNotReady
                _RT_OK = runtime.cudaError_t.cudaSuccess
                _rt = runtime
    return _rt, _drv


def _error(err: Any) -> CudaError:
    """Build the CudaError for a runtime (cudaError_t) or driver (CUresult) error code."""
    name = str(getattr(err, "name", err))
    explanation = ""
    try:
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
    except Exception:  # noqa: BLE001 - naming an error must never hide it
        pass
    return CudaError(name, explanation)


def check(result: tuple[Any, ...]) -> Any:
    """Turn a cuda-python result ``(err, value...)`` into its value(s), or raise `CudaError`.

    Returns None for ``(err,)``, the value for ``(err, value)`` and a tuple for more values.
    Works for both the runtime (``cudaError_t``) and the driver (``CUresult``) API.
    """
    err = result[0]
    if err is not _RT_OK and err is not _DRV_OK:
        if _rt is None:  # called before anything loaded the bindings: load them and look again
            _bindings()
            return check(result)
        raise _error(err)
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
        rt, _ = _bindings()
        err, count = rt.cudaGetDeviceCount()
        return err is _RT_OK and int(count) > 0
    except Exception:  # noqa: BLE001 - a probe: any failure means "no GPU here"
        return False


def _device_count() -> int:
    """The number of visible GPUs; EngineError with the reason and the fix if there are none."""
    rt, _ = _bindings()
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
        why = f"CUDA could not start ({_error(err)})"
    raise EngineError(f"the cuda backend cannot run here: {why}; {_SIM_HINT}")


class _DeviceScope:
    """Make ``device`` current for a block of client-side calls, then restore the caller's device.

    Client helpers run inside an application (PyTorch, CuPy) whose current device we must not
    change behind its back.
    """

    def __init__(self, device: int) -> None:
        self._device = device
        self._previous: int | None = None

    def __enter__(self) -> None:
        rt, _ = _bindings()
        self._previous = int(check(rt.cudaGetDevice()))
        if self._previous != self._device:
            check(rt.cudaSetDevice(self._device))

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None and self._previous != self._device:
            _rt.cudaSetDevice(self._previous)


def _handle_to_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``cudaIpcMemHandle_t`` (through its address: works on every version)."""
    return ctypes.string_at(int(handle.getPtr()), 64)


def _handle_from_bytes(data: bytes) -> Any:
    if len(data) != 64:
        raise InvalidRequest(f"a CUDA IPC handle is 64 bytes, this one is {len(data)}")
    rt, _ = _bindings()
    handle = rt.cudaIpcMemHandle_t()
    ctypes.memmove(int(handle.getPtr()), data, 64)
    return handle


class _IpcTable:
    """Opened IPC handles, counted: one allocation is opened once per process however many
    regions (a pool allocator hands out many arrays from one allocation) point into it, since
    CUDA IPC does not promise that a second open of the same handle in one process works."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, bytes], list[int]] = {}
        self._lock = threading.Lock()

    def acquire(self, handle: bytes, device: int) -> int:
        """Open (or reuse) ``handle`` with ``device`` current; return the allocation's base."""
        rt, _ = _bindings()
        key = (device, handle)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                base = int(check(rt.cudaIpcOpenMemHandle(_handle_from_bytes(handle), rt.cudaIpcMemLazyEnablePeerAccess)))
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


# ---------------------------------------------------------------------------------------------
# Memory and completions


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


class _EventPool:
    """Events of one device (an event must be recorded on a stream of its own device).

    Only ``cudaEventDisableTiming`` events: they are the cheapest to record and query."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.free: list[Any] = []
        self.created: list[Any] = []
        self.closed = False

    def take(self) -> Any:
        if self.free:
            return self.free.pop()
        event = check(_rt.cudaEventCreateWithFlags(_rt.cudaEventDisableTiming))
        self.created.append(event)
        return event


class _EventCompletion(Completion):
    """Done when the event recorded after the chunk has completed."""

    __slots__ = ("_event", "_pool", "_done")

    def __init__(self, event: Any, pool: _EventPool) -> None:
        self._event = event
        self._pool = pool
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        if self._event is None or self._pool.closed:
            raise EngineError("the cuda engine was closed (or the completion released) before this chunk finished")
        err = _rt.cudaEventQuery(self._event)[0]
        if err is _RT_OK:
            self._done = True
            return True
        if err is _NOT_READY:
            return False
        raise _error(err)

    def release(self) -> None:
        if self._event is not None:
            if not self._pool.closed:
                self._pool.free.append(self._event)
            self._event = None


class _Done(Completion):
    """A chunk of zero bytes: nothing to wait for."""

    def done(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class _Lane:
    """The streams of one (device, direction) lane, and what calibration found."""

    key: LaneKey
    dma: Any = None
    """Lowest priority: bulk (non-strict) DMA chunks, FIFO."""
    strict: Any = None
    """Highest priority: strict DMA chunks. A second stream matters for small host-to-device
    copies, which ride the command stream and pass a bulk copy on *another* stream only."""
    express: Any = None
    """Highest priority: the copy kernel."""
    express_cu: Any = None
    """The same stream as a driver-API ``CUstream``, for ``cuLaunchKernel``."""
    kind: Any = None
    """The cudaMemcpyKind of this direction."""
    host_src: bool = False
    host_dst: bool = False
    dma_bandwidth: float = 0.0
    express_bandwidth: float = 0.0
    express_min: int = 0
    express_max: int = 0


@dataclass
class _Device:
    index: int
    name: str = ""
    pci_bus_id: str = ""
    sm_count: int = 0
    events: _EventPool = field(default_factory=lambda: _EventPool(-1))
    module: Any = None
    function: Any = None
    kernel_registers: int = 0
    lanes: dict[Direction, _Lane] = field(default_factory=dict)
    h2d: _Lane = field(default_factory=lambda: _Lane(LaneKey(-1, Direction.H2D)))
    d2h: _Lane = field(default_factory=lambda: _Lane(LaneKey(-1, Direction.D2H)))
    d2d: _Lane = field(default_factory=lambda: _Lane(LaneKey(-1, Direction.D2D)))


_KIND_NAMES = {Direction.H2D: "cudaMemcpyHostToDevice", Direction.D2H: "cudaMemcpyDeviceToHost", Direction.D2D: "cudaMemcpyDeviceToDevice"}


class CudaEngine(Engine):
    """Copies on NVIDIA GPUs through cuda-python: a DMA lane and an express lane per direction.

    Args:
        devices: GPU ordinals to serve (default: all visible).
        express: Load the copy kernel and offer the express lane.
        calibrate_bytes: Size of the pinned copy timed per direction at start to measure each
            lane's bandwidth; 0 skips calibration and assumes the figures in `_NOMINAL`.
        log: A structlog-style logger (``log.info("event", key=value)``); stdlib logging if None.

    Raises:
        EngineError: No cuda-bindings, no driver or no GPU: the message says which, and that
            ``--backend sim`` runs without a GPU.
    """

    name = "cuda"

    _NOMINAL = {Direction.H2D: 55e9, Direction.D2H: 55e9, Direction.D2D: 1.5e12}
    """Bytes/s assumed when calibration is skipped (H200 PCIe Gen5 x16, findings section 5)."""

    def __init__(
        self,
        devices: list[int] | None = None,
        express: bool = True,
        calibrate_bytes: int = 256 << 20,
        log: _Log | None = None,
    ) -> None:
        rt, drv = _bindings()
        self._log: _Log = log if log is not None else _StdLog(logging.getLogger(__name__))
        self._closed = False
        self._devices: dict[int, _Device] = {}
        self._hosts: dict[int, CudaHostMemory] = {}
        self._device_mems: dict[int, CudaDeviceMemory] = {}
        self._ipc = _IpcTable()
        self._current: tuple[int, int] | None = None
        self._register_log: deque[tuple[int, float]] = deque(maxlen=32)
        self._register_count = 0
        self._register_bytes = 0
        self._register_ms = 0.0
        self._register_lock = threading.Lock()  # registrations run on several executor threads
        self._express_wanted = express
        self._express_error: str | None = None
        self.express_blocks_per_sm = EXPRESS_BLOCKS_PER_SM
        # cuLaunchKernel reads its arguments through an array of pointers; keep both arrays
        # alive and reuse them (the driver copies the values at launch).
        self._kargs = (ctypes.c_uint64 * 3)()
        base = ctypes.addressof(self._kargs)
        self._kptrs = (ctypes.c_uint64 * 3)(base, base + 8, base + 16)
        self._kparams = ctypes.addressof(self._kptrs)

        count = _device_count()
        wanted = list(range(count)) if devices is None else list(devices)
        for index in wanted:
            if not 0 <= index < count:
                raise EngineError(f"gpu {index} does not exist: this host has {count} (0..{count - 1})")
        ptx: bytes | None = None
        if express:
            try:
                ptx = PTX_PATH.read_bytes() + b"\0"
            except OSError as exc:
                self._express_error = f"cannot read {PTX_PATH}: {exc}"
        try:
            for index in wanted:
                self._devices[index] = self._open_device(index, ptx)
            for dev in self._devices.values():
                self._calibrate(dev, calibrate_bytes)
        except BaseException:
            self.close()
            raise
        if express and self._express_error:
            self._log.warning("cuda express lane off", reason=self._express_error)

    # -- setup -------------------------------------------------------------------------------

    def _use(self, device: int) -> None:
        """Make ``device`` current in this thread (skipped when it already is)."""
        key = (threading.get_ident(), device)
        if self._current != key:
            check(_rt.cudaSetDevice(device))
            self._current = key

    def _open_device(self, index: int, ptx: bytes | None) -> _Device:
        rt, drv = _rt, _drv
        self._use(index)
        err = rt.cudaSetDeviceFlags(rt.cudaDeviceScheduleSpin | rt.cudaDeviceMapHost)[0]
        # Spin: the engine never blocks on the GPU in normal work (it polls events), so the flag
        # only shapes calibration and close, where spinning gives the cleanest timings.
        if err is not _RT_OK and err is not rt.cudaError_t.cudaErrorSetOnActiveProcess:
            raise _error(err)
        check(rt.cudaFree(0))  # create the primary context now, with those flags
        props = check(rt.cudaGetDeviceProperties(index))
        dev = _Device(index=index, events=_EventPool(index))
        dev.name = bytes(props.name).split(b"\0", 1)[0].decode(errors="replace")
        dev.sm_count = int(check(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, index)))
        try:
            dev.pci_bus_id = bytes(check(rt.cudaDeviceGetPCIBusId(32, index))).split(b"\0", 1)[0].decode()
        except CudaError:
            dev.pci_bus_id = ""
        least, greatest = (int(v) for v in check(rt.cudaDeviceGetStreamPriorityRange()))
        # Register the device before creating anything, so close() frees what was made even if
        # a later step fails.
        self._devices[index] = dev
        if ptx is not None and self._express_error is None:
            try:
                dev.module = check(drv.cuModuleLoadData(ptx))
                dev.function = check(drv.cuModuleGetFunction(dev.module, KERNEL_NAME))
                dev.kernel_registers = int(
                    check(drv.cuFuncGetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, dev.function))
                )
            except CudaError as exc:
                # An older driver than the PTX's ISA (CUDA_ERROR_UNSUPPORTED_PTX_VERSION) lands
                # here: the engine still works, without the express lane.
                self._express_error = (
                    f"loading {PTX_PATH.name} on gpu{index} failed ({exc}); the driver may be older "
                    "than the PTX (regenerate it with an older nvcc: scripts/build_ptx.sh)"
                )
                dev.module = dev.function = None
        for direction in Direction:
            host_src, host_dst = _HOST_ENDS[direction]
            lane = _Lane(LaneKey(index, direction), kind=_kind(direction), host_src=host_src, host_dst=host_dst)
            dev.lanes[direction] = lane
            setattr(dev, direction.value, lane)
            lane.dma = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, least))
            lane.strict = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
            lane.express = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
            lane.express_cu = drv.CUstream(int(lane.express))
        return dev

    def _calibrate(self, dev: _Device, nbytes: int) -> None:
        """Time DMA and express copies per direction; fill the lanes' figures and log them."""
        has_express = dev.function is not None and self._express_wanted
        for direction, lane in dev.lanes.items():
            lane.express_max = EXPRESS_MAX if has_express else 0
            lane.express_min = EXPRESS_MIN_H2D if (has_express and direction is Direction.H2D) else 0
            lane.dma_bandwidth = self._NOMINAL[direction]
        if nbytes <= 0:
            return
        rt = _rt
        self._use(dev.index)
        host = check(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped))
        dev_a = dev_b = 0
        start = stop = None
        try:
            host_alias = int(check(rt.cudaHostGetDevicePointer(host, 0)))
            dev_a = int(check(rt.cudaMalloc(nbytes)))
            dev_b = int(check(rt.cudaMalloc(nbytes)))
            check(rt.cudaMemset(dev_a, 1, nbytes))
            check(rt.cudaMemset(dev_b, 2, nbytes))
            ctypes.memset(int(host), 3, nbytes)
            start = check(rt.cudaEventCreate())
            stop = check(rt.cudaEventCreate())
            express_bytes = min(nbytes, EXPRESS_MAX)
            ends = {
                Direction.H2D: (dev_a, int(host), host_alias),
                Direction.D2H: (int(host), dev_a, dev_a),
                Direction.D2D: (dev_b, dev_a, dev_a),
            }
            figures: dict[str, float] = {}
            for direction, lane in dev.lanes.items():
                dst, src, src_alias = ends[direction]
                dst_alias = host_alias if direction is Direction.D2H else dst

                def dma(dst: int = dst, src: int = src, lane: _Lane = lane) -> None:
                    check(rt.cudaMemcpyAsync(dst, src, nbytes, lane.kind, lane.dma))

                lane.dma_bandwidth = nbytes / self._time(dma, lane.dma, start, stop)
                figures[f"{direction.value}_dma_gbps"] = round(lane.dma_bandwidth / 1e9, 2)
                if has_express:

                    def kernel(dst: int = dst_alias, src: int = src_alias, lane: _Lane = lane) -> None:
                        self._launch(dev, dst, src, express_bytes, lane.express_cu)

                    lane.express_bandwidth = express_bytes / self._time(kernel, lane.express, start, stop)
                    figures[f"{direction.value}_express_gbps"] = round(lane.express_bandwidth / 1e9, 2)
            self._log.info("cuda calibration", gpu=dev.index, name=dev.name, bytes=nbytes, **figures)
        finally:
            for event in (start, stop):
                if event is not None:
                    rt.cudaEventDestroy(event)
            for ptr in (dev_a, dev_b):
                if ptr:
                    rt.cudaFree(ptr)
            rt.cudaFreeHost(host)

    @staticmethod
    def _time(op: Callable[[], None], stream: Any, start: Any, stop: Any, reps: int = 3) -> float:
        """Median seconds of ``op`` on ``stream`` over ``reps`` runs after one warm-up."""
        rt = _rt
        op()
        check(rt.cudaStreamSynchronize(stream))
        seconds = []
        for _ in range(reps):
            check(rt.cudaEventRecord(start, stream))
            op()
            check(rt.cudaEventRecord(stop, stream))
            check(rt.cudaEventSynchronize(stop))
            seconds.append(float(check(rt.cudaEventElapsedTime(start, stop))) / 1e3)
        return max(_stats.median(seconds), 1e-9)

    # -- the Engine interface ----------------------------------------------------------------

    def lanes(self) -> list[LaneInfo]:
        return [
            LaneInfo(lane.key, lane.dma_bandwidth, lane.express_min, lane.express_max)
            for dev in self._devices.values()
            for lane in dev.lanes.values()
        ]

    def map_host(self, fd: int, nbytes: int) -> HostMemory:
        self._check_open()
        if nbytes <= 0:
            raise InvalidRequest(f"a host region needs at least one byte, not {nbytes}")
        mem = CudaHostMemory(fd, nbytes)
        rt = _rt
        try:
            # Allocate the pages first, outside CUDA. cudaHostRegister faults in pages it finds
            # missing while holding a driver lock, and the event loop's own CUDA calls (event
            # queries, launches) wait on that lock: an urgent copy waited as long as that took.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                pass  # e.g. a memfd sealed against writes: registration faults the pages in
            self._use(next(iter(self._devices)))
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
        self._hosts[id(mem)] = mem
        with self._register_lock:
            self._register_log.append((nbytes, mem.register_ms))
            self._register_count += 1
            self._register_bytes += nbytes
            self._register_ms += mem.register_ms
        return mem

    def release_host(self, mem: HostMemory) -> None:
        if self._hosts.pop(id(mem), None) is None:
            return  # released already (or not ours): nothing to undo
        assert isinstance(mem, CudaHostMemory)
        try:
            if mem.registered:
                mem.registered = False
                check(_rt.cudaHostUnregister(mem.address))
        finally:
            mem.unmap()

    def alloc_device(self, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0:
            raise InvalidRequest(f"a device region needs at least one byte, not {nbytes}")
        self._device(device)
        self._use(device)
        pointer = int(check(_rt.cudaMalloc(nbytes)))
        try:
            handle = _handle_to_bytes(check(_rt.cudaIpcGetMemHandle(pointer)))
        except BaseException:
            _rt.cudaFree(pointer)
            raise
        mem = CudaDeviceMemory(pointer, nbytes, device, owned=True, export=DeviceExport(ipc_handle=handle, offset=0))
        self._device_mems[id(mem)] = mem
        return mem

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0 or offset < 0:
            raise InvalidRequest(f"bad device region: offset {offset}, {nbytes} bytes")
        self._device(device)
        self._use(device)
        base = self._ipc.acquire(bytes(ipc_handle), device)
        mem = CudaDeviceMemory(base + offset, nbytes, device, owned=False, ipc_handle=bytes(ipc_handle))
        self._device_mems[id(mem)] = mem
        return mem

    def release_device(self, mem: DeviceMemory) -> None:
        if self._device_mems.pop(id(mem), None) is None:
            return
        assert isinstance(mem, CudaDeviceMemory) and mem.device is not None
        mem.released = True
        self._use(mem.device)
        if mem.owned:
            check(_rt.cudaFree(mem.pointer))
        elif mem.ipc_handle is not None:
            self._ipc.release(mem.ipc_handle, mem.device)

    def submit(
        self,
        lane: LaneKey,
        path: Path,
        dst: Memory,
        dst_offset: int,
        src: Memory,
        src_offset: int,
        nbytes: int,
        *,
        strict: bool = False,
    ) -> Completion:
        """Start one chunk. DMA chunks go on the lane's low-priority stream in FIFO order, or,
        with ``strict=True``, on its high-priority DMA stream (so that small host-to-device
        copies pass the bulk ones); express chunks run the copy kernel.

        Raises:
            InvalidRequest: The memories do not match the lane's direction or device, or the
                range falls outside them.
            EngineError: Express asked of a lane that has none; CudaError when CUDA refuses.
        """
        # The hot path: no Enum hashing (Enum.__hash__ is Python code), identity tests instead.
        dev = self._devices.get(lane.device)
        if dev is None or self._closed:
            self._check_open()
            raise InvalidRequest(f"this engine does not serve gpu{lane.device}")
        direction = lane.direction
        info = dev.h2d if direction is _H2D else dev.d2h if direction is _D2H else dev.d2d
        s_host = src if type(src) is CudaHostMemory else _host(src)
        d_host = dst if type(dst) is CudaHostMemory else _host(dst)
        if (s_host is not None) is not info.host_src or (d_host is not None) is not info.host_dst:
            raise InvalidRequest(f"lane {lane} needs {_ENDS_TEXT[direction]}, got {_what(src)} -> {_what(dst)}")
        if nbytes < 0 or src_offset < 0 or dst_offset < 0 or src_offset + nbytes > src.nbytes or dst_offset + nbytes > dst.nbytes:
            raise InvalidRequest(
                f"copy of {nbytes} bytes from offset {src_offset} (of {src.nbytes}) "
                f"to offset {dst_offset} (of {dst.nbytes}) is out of range"
            )
        if lane.device != src.device and lane.device != dst.device:
            raise InvalidRequest(f"lane {lane} got {_what(src)} -> {_what(dst)}: neither end is on gpu{lane.device}")
        if nbytes == 0:
            return _Done()
        self._use(lane.device)
        if path is _DMA:
            stream = info.strict if strict else info.dma
            sp = (s_host.host_pointer if s_host is not None else src.pointer) + src_offset  # type: ignore[attr-defined]
            dp = (d_host.host_pointer if d_host is not None else dst.pointer) + dst_offset  # type: ignore[attr-defined]
            check(_rt.cudaMemcpyAsync(dp, sp, nbytes, info.kind, stream))
        else:
            if info.express_max == 0:
                raise EngineError(f"lane {lane} has no express path ({self._express_error or 'express is off'}); submit it as DMA")
            stream = info.express
            sp = (s_host.device_pointer if s_host is not None else src.pointer) + src_offset  # type: ignore[attr-defined]
            dp = (d_host.device_pointer if d_host is not None else dst.pointer) + dst_offset  # type: ignore[attr-defined]
            if direction is _D2D and src.device != dst.device:
                # A kernel would need peer access between the two GPUs; a peer copy on the
                # express stream is always possible and does not queue behind this lane's DMA.
                check(_rt.cudaMemcpyAsync(dp, sp, nbytes, info.kind, stream))
            else:
                self._launch(dev, dp, sp, nbytes, info.express_cu)
        pool = dev.events
        event = pool.free.pop() if pool.free else pool.take()
        check(_rt.cudaEventRecord(event, stream))
        return _EventCompletion(event, pool)

    def _launch(self, dev: _Device, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Launch the copy kernel: enough threads for one unrolled step each, up to one wave."""
        mis = src ^ dst
        word = 16 if mis & 15 == 0 else 8 if mis & 7 == 0 else 4 if mis & 3 == 0 else 2 if mis & 1 == 0 else 1
        wanted = max(1, -(-(nbytes // word) // EXPRESS_UNROLL))
        threads = min(EXPRESS_THREADS, max(32, -(-wanted // 32) * 32))
        blocks = max(1, min(dev.sm_count * self.express_blocks_per_sm, -(-wanted // threads)))
        args = self._kargs
        args[0] = src
        args[1] = dst
        args[2] = nbytes
        check(_drv.cuLaunchKernel(dev.function, blocks, 1, 1, threads, 1, 1, 0, stream, self._kparams, 0))

    def statistics(self) -> dict[str, object]:
        lanes: dict[str, object] = {}
        devices: list[dict[str, object]] = []
        for dev in self._devices.values():
            devices.append(
                {
                    "index": dev.index,
                    "name": dev.name,
                    "pci_bus_id": dev.pci_bus_id,
                    "sm_count": dev.sm_count,
                    "kernel_registers": dev.kernel_registers,
                    "express_grid": f"<= {dev.sm_count * self.express_blocks_per_sm} x {EXPRESS_THREADS}",
                }
            )
            for lane in dev.lanes.values():
                lanes[str(lane.key)] = {
                    "dma_gbps": round(lane.dma_bandwidth / 1e9, 2),
                    "express_gbps": round(lane.express_bandwidth / 1e9, 2),
                    "express_min": lane.express_min,
                    "express_max": lane.express_max,
                }
        recent = [{"bytes": b, "ms": round(ms, 3)} for b, ms in self._register_log]
        return {
            "backend": self.name,
            "devices": devices,
            "lanes": lanes,
            "express": bool(self._express_wanted and self._express_error is None and self._devices),
            "express_error": self._express_error,
            "host_register": {
                "count": self._register_count,
                "bytes": self._register_bytes,
                "ms_total": round(self._register_ms, 3),
                "ms_per_gib": round(self._register_ms / (self._register_bytes / 2**30), 3) if self._register_bytes else None,
                "recent": recent,
            },
            "host_regions": len(self._hosts),
            "device_regions": len(self._device_mems),
        }

    def close(self) -> None:
        """Wait for our streams, then destroy events and streams and free everything. Idempotent.

        Errors (a GPU that already failed) are logged, not raised: close runs on the way out.
        """
        if self._closed:
            return
        self._closed = True
        rt, drv = _rt, _drv
        errors: list[BaseException] = []

        def attempt(result: tuple[Any, ...]) -> None:
            try:
                check(result)
            except CudaError as exc:
                errors.append(exc)

        for dev in self._devices.values():
            attempt(rt.cudaSetDevice(dev.index))
            for lane in dev.lanes.values():
                for stream in (lane.dma, lane.strict, lane.express):
                    if stream is not None:
                        attempt(rt.cudaStreamSynchronize(stream))
        for mem in list(self._hosts.values()):
            try:
                self.release_host(mem)
            except (CudaError, BufferError) as exc:
                errors.append(exc)
        for dmem in list(self._device_mems.values()):
            try:
                self.release_device(dmem)
            except CudaError as exc:
                errors.append(exc)
        errors.extend(self._ipc.close_all())
        for dev in self._devices.values():
            attempt(rt.cudaSetDevice(dev.index))
            dev.events.closed = True
            for event in dev.events.created:
                attempt(rt.cudaEventDestroy(event))
            dev.events.created.clear()
            dev.events.free.clear()
            for lane in dev.lanes.values():
                for stream in (lane.dma, lane.strict, lane.express):
                    if stream is not None:
                        attempt(rt.cudaStreamDestroy(stream))
                lane.dma = lane.strict = lane.express = lane.express_cu = None
            if dev.module is not None:
                attempt(drv.cuModuleUnload(dev.module))
                dev.module = dev.function = None
        self._current = None
        for problem in errors:
            self._log.warning("cuda close", error=str(problem))

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the cuda engine is closed")

    def _device(self, device: int) -> _Device:
        dev = self._devices.get(device)
        if dev is None:
            raise InvalidRequest(f"this engine does not serve gpu{device} (it serves {sorted(self._devices)})")
        return dev


_H2D, _D2H, _D2D = Direction.H2D, Direction.D2H, Direction.D2D
_DMA = Path.DMA
_HOST_ENDS = {Direction.H2D: (True, False), Direction.D2H: (False, True), Direction.D2D: (False, False)}
_ENDS_TEXT = {Direction.H2D: "host -> device", Direction.D2H: "device -> host", Direction.D2D: "device -> device"}


def _host(mem: Memory) -> CudaHostMemory | None:
    if isinstance(mem, CudaHostMemory):
        return mem
    if isinstance(mem, CudaDeviceMemory):
        if mem.released:
            raise InvalidRequest("device region was released")
        return None
    raise InvalidRequest(f"{type(mem).__name__} was not made by the cuda engine")


def _what(mem: Memory) -> str:
    return "host" if mem.is_host else f"gpu{mem.device}"


_kinds: dict[Direction, Any] = {}


def _kind(direction: Direction) -> Any:
    kind = _kinds.get(direction)
    if kind is None:
        kind = _kinds[direction] = getattr(_rt.cudaMemcpyKind, _KIND_NAMES[direction])
    return kind


# ---------------------------------------------------------------------------------------------
# Client side: share device memory with the daemon and open what the daemon shares.

_client_ipc = _IpcTable()


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
    _, drv = _bindings()
    check(drv.cuInit(0))
    device = int(check(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)))
    with _DeviceScope(device):
        base, _size = check(drv.cuMemGetAddressRange(pointer))
        base = int(base)
        try:
            handle = check(_rt.cudaIpcGetMemHandle(base))
        except CudaError as exc:
            raise EngineError(
                f"this array's memory cannot be shared by CUDA IPC ({exc}): allocate it with cudaMalloc "
                "(the default allocators of CuPy and PyTorch), not from a cudaMallocAsync pool or cuMemCreate"
            ) from exc
    return _handle_to_bytes(handle), pointer - base, nbytes, device


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
            with _DeviceScope(self.device):
                _client_ipc.release(self._handle, self.device)

    def __enter__(self) -> CudaBuffer:
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
    _bindings()
    with _DeviceScope(device):
        base = _client_ipc.acquire(bytes(ipc_handle), device)
    return CudaBuffer(bytes(ipc_handle), base, offset, nbytes, device)
