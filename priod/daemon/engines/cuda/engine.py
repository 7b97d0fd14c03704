"""`CudaEngine`: the `priod.daemon.engines.base.Engine` interface on NVIDIA GPUs, through cuda-python.

It wires the parts of this package together: each served GPU is opened (`device`: a context,
three streams per lane) with the express kernel loaded into it (`express`), then calibrated
(`calibrate`); regions are pinned, allocated or imported by `memory`; every chunk is one
``cudaMemcpyAsync`` (DMA) or one kernel launch (express), followed by an event from the
device's pool (`events`) that the daemon's poller queries. A ``submit`` costs 7-9 us of Python
down the DMA path and 8-10 us down the express path (measured on an H200).

Constructing `CudaEngine` needs cuda-bindings, a driver and a GPU, and says which is missing.

Threading: `submit` and completions run on the daemon's event loop; region set-up and teardown
(`map_host`, `alloc_device`, `import_device`, the releases) run on executor threads, since they
take milliseconds. CUDA calls are thread-safe; the tables they touch are single dict operations
or under a lock. The current device is set per call where it matters, so other code in the
process may use other devices.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from priod.common.cuda.batched import BULK_CALL_SEGMENTS, GATED_CALL_SEGMENTS, BatchedDma
from priod.common.cuda.driver import bindings, check, device_count, event_handle_from_bytes
from priod.common.cuda.express import ExpressKernel, read_ptx
from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.engines.base import ChunkJob, Completion, DeviceMemory, Engine, HostMemory, IpcEvent, Memory
from priod.daemon.engines.cuda.calibrate import Log, calibrate
from priod.daemon.engines.cuda.device import Device, Gates, Lane, open_device, open_gates
from priod.daemon.engines.cuda.events import CudaIpcEvent, Done, EventCompletion
from priod.daemon.engines.cuda.memory import CudaDeviceMemory, CudaHostMemory, Regions
from priod.daemon.engines.cuda.peer import open_peer_lanes
from priod.daemon.engines.cuda.pusher import Pusher
from priod.errors import CudaError, EngineError, InvalidRequest
from priod.wire.batch import column_peaks

__all__ = ["CudaEngine"]


class _StdLog:
    """A stdlib-logging stand-in for a structlog logger (``log.info("event", key=value)``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def info(self, event: str, /, **kw: Any) -> None:
        self._logger.info("%s %s", event, " ".join(f"{k}={v!r}" for k, v in kw.items()))

    def warning(self, event: str, /, **kw: Any) -> None:
        self._logger.warning("%s %s", event, " ".join(f"{k}={v!r}" for k, v in kw.items()))


class CudaEngine(Engine):
    """Copies on NVIDIA GPUs through cuda-python: a DMA lane and an express lane per direction.

    Args:
        devices: GPU ordinals to serve (default: all visible).
        express: Load the copy kernel and offer the express lane.
        calibrate_bytes: Size of the pinned copy timed per direction at start to measure each
            lane's bandwidth; 0 skips calibration and assumes the figures in `calibrate.NOMINAL`.
        log: A structlog-style logger (``log.info("event", key=value)``); stdlib logging if None.

    Raises:
        EngineError: No cuda-bindings, no driver or no GPU: the message says which, and that
            ``--backend sim`` runs without a GPU.
    """

    name = "cuda"

    def __init__(
        self,
        devices: list[int] | None = None,
        express: bool = True,
        calibrate_bytes: int = 256 << 20,
        log: Log | None = None,
    ) -> None:
        rt, drv = bindings()
        self._started = time.perf_counter()
        self._rt = rt
        """The runtime API module, held for the per-chunk path."""
        self._log: Log = log if log is not None else _StdLog(logging.getLogger("priod.daemon.engines.cuda"))
        self._closed = False
        self._devices: dict[int, Device] = {}
        self._regions = Regions(self._use)
        self._current: tuple[int, int] | None = None
        self._express_wanted = express
        self._express_error: str | None = None
        self._kernel = ExpressKernel()
        self._batched: BatchedDma
        """Batched DMA enqueued on the loop's thread: urgent (strict) chunks."""
        self._bulk_batched: BatchedDma
        """The same for the pusher's thread: bulk batch chunks, off the loop (pusher.py)."""
        self._pusher = Pusher("priod-cuda-pusher")
        self._ipc_events: set[CudaIpcEvent] = set()
        """Client events opened and not yet closed: destroyed at `close` if a session did not."""
        self._gate_of: dict[LaneKey, tuple[Gates, int]] = {}
        """Each gated lane's gate words and its index there (`set_gates`, `set_gate`); empty
        once closed."""
        self._gates_error: str | None = None
        """Why bulk chunks are not gated (None: they are, see `Gates`)."""
        self._wait_value = drv.cuStreamWaitValue32
        self._gate_eq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        self._write_value = drv.cuStreamWriteValue64

        count = device_count()
        wanted = list(range(count)) if devices is None else list(devices)
        for index in wanted:
            if not 0 <= index < count:
                raise EngineError(f"gpu {index} does not exist: this host has {count} (0..{count - 1})")
        ptx: bytes | None = None
        if express:
            ptx, self._express_error = read_ptx()
        try:
            self._batched, self._bulk_batched = BatchedDma(), BatchedDma(BULK_CALL_SEGMENTS)
            if self._batched.error:
                self._log.info("cuda batched copies", path="per segment", reason=self._batched.error)
            for index in wanted:
                open_device(index, self._devices, self._use, lambda dev: self._load_kernel(dev, ptx))
                self._gates_error = self._gates_error or open_gates(self._devices[index])
            if self._gates_error:
                self._log.info("cuda bulk gates off", reason=self._gates_error)
            self._gate_of = {
                lane.key: (dev.gates, i)
                for dev in self._devices.values()
                if dev.gates is not None
                for i, lane in enumerate(dev.local_lanes)
            }
            # Landed words are stream memory operations too: where the gates' wait works, so
            # does their store (the driver has both or neither).
            self.stores_landed = self._gates_error is None and bool(self._devices)
            for dev in self._devices.values():
                calibrate(
                    dev,
                    calibrate_bytes,
                    use=self._use,
                    kernel=self._kernel,
                    express=self._express_wanted,
                    log=self._log,
                )
            open_peer_lanes(self._devices, self._use, calibrate_bytes, self._log)  # nothing with one GPU
        except BaseException:
            self.close()
            raise
        if express and self._express_error:
            self._log.warning("cuda express lane off", reason=self._express_error)

    @property
    def express_blocks_per_sm(self) -> int:
        """Blocks per SM of the express kernel's largest grid."""
        return self._kernel.blocks_per_sm

    @express_blocks_per_sm.setter
    def express_blocks_per_sm(self, value: int) -> None:
        self._kernel.blocks_per_sm = value

    # -- setup -------------------------------------------------------------------------------

    def _use(self, device: int) -> None:
        """Make ``device`` current in this thread (skipped when it already is)."""
        key = (threading.get_ident(), device)
        if self._current != key:
            check(self._rt.cudaSetDevice(device))
            self._current = key

    def _load_kernel(self, dev: Device, ptx: bytes | None) -> None:
        """Load the express kernel into ``dev``, unless express is off or already failed."""
        if ptx is not None and self._express_error is None:
            self._express_error = self._kernel.load(dev, ptx)

    # -- the Engine interface ----------------------------------------------------------------

    def lanes(self) -> list[LaneInfo]:
        return [
            LaneInfo(lane.key, lane.dma_bandwidth, lane.express_min, lane.express_max, gate=lane.gate is not None)
            for dev in self._devices.values()
            for lane in dev.lanes
        ]

    def map_host(self, fd: int, nbytes: int) -> HostMemory:
        self._check_open()
        if nbytes <= 0:
            raise InvalidRequest(f"a host region needs at least one byte, not {nbytes}")
        return self._regions.map_host(fd, nbytes, next(iter(self._devices)))

    def release_host(self, mem: HostMemory) -> None:
        self._regions.release_host(mem)

    def alloc_device(self, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0:
            raise InvalidRequest(f"a device region needs at least one byte, not {nbytes}")
        self._device(device)
        return self._regions.alloc_device(nbytes, device, self._peers_of(device))

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0 or offset < 0:
            raise InvalidRequest(f"bad device region: offset {offset}, {nbytes} bytes")
        self._device(device)
        return self._regions.import_device(ipc_handle, offset, nbytes, device)

    def import_device_fd(self, fd: int, size: int, offset: int, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0 or offset < 0 or offset + nbytes > size:
            raise InvalidRequest(f"bad device region: offset {offset}, {nbytes} bytes, in an allocation of {size}")
        self._device(device)
        return self._regions.import_device_fd(fd, size, offset, nbytes, device, self._peers_of(device))

    def import_device_pool(self, fd: int, export: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        self._check_open()
        if nbytes <= 0 or offset < 0:
            raise InvalidRequest(f"bad device region: offset {offset}, {nbytes} bytes")
        self._device(device)
        return self._regions.import_device_pool(fd, export, offset, nbytes, device, self._peers_of(device))

    def _peers_of(self, device: int) -> list[int]:
        """The GPUs besides ``device`` whose peer lane to it copies directly. cuMemMap-ed and
        pool memory is reached only by the GPUs given access to it (peer access, which
        cudaMalloc memory gets from cudaDeviceEnablePeerAccess, does not extend to it): its
        own, and these."""
        return [
            other
            for other, dev in self._devices.items()
            if other != device and (lane := dev.peers.get(device)) is not None and lane.peer_access
        ]

    def release_device(self, mem: DeviceMemory) -> None:
        self._regions.release_device(mem)

    def submit_range(self, job: ChunkJob) -> Completion:
        """Start one chunk. DMA chunks go on the lane's low-priority stream in FIFO order, or,
        with ``strict=True``, on its high-priority DMA stream (so that small host-to-device
        copies pass the bulk ones); express chunks run the copy kernel.

        Raises:
            InvalidRequest: The memories do not match the lane's direction or device, or the
                range falls outside them.
            EngineError: Express asked of a lane that has none; CudaError when CUDA refuses.
        """
        lane, path, dst, src, nbytes = job.lane, job.path, job.dst, job.src, job.nbytes
        dst_offset, src_offset, strict, gated = job.dst_offset, job.src_offset, job.strict, job.gated
        dev, info, s_host, d_host = self._ends(lane, dst, src)
        if (
            nbytes < 0
            or src_offset < 0
            or dst_offset < 0
            or src_offset + nbytes > src.nbytes
            or dst_offset + nbytes > dst.nbytes
        ):
            raise InvalidRequest(
                f"copy of {nbytes} bytes from offset {src_offset} (of {src.nbytes}) "
                f"to offset {dst_offset} (of {dst.nbytes}) is out of range"
            )
        if nbytes == 0:
            return Done()
        self._use(lane.device)
        rt = self._rt
        direction = lane.direction
        if path is _DMA:
            stream = info.strict if strict else info.dma
            if gated and info.gate is not None:
                self._wait_gate(info)
            sp = (s_host.host_pointer if s_host is not None else src.pointer) + src_offset  # type: ignore[attr-defined]
            dp = (d_host.host_pointer if d_host is not None else dst.pointer) + dst_offset  # type: ignore[attr-defined]
            if direction is _PEER:
                # Names both GPUs, so it works with or without peer access (staged through the
                # host then); the stream is the source GPU's, as the lane is.
                check(rt.cudaMemcpyPeerAsync(dp, lane.peer, sp, lane.device, nbytes, stream))
            else:
                check(rt.cudaMemcpyAsync(dp, sp, nbytes, info.kind, stream))
            if job.landed is not None:
                self._store_landed(job.landed, info.strict_cu if strict else info.dma_cu)
        else:
            if info.express_max == 0:
                raise EngineError(
                    f"lane {lane} has no express path ({self._express_error or 'express is off'}); submit it as DMA"
                )
            stream = info.express
            sp = (s_host.device_pointer if s_host is not None else src.pointer) + src_offset  # type: ignore[attr-defined]
            dp = (d_host.device_pointer if d_host is not None else dst.pointer) + dst_offset  # type: ignore[attr-defined]
            self._kernel.launch(dev, dp, sp, nbytes, info.express_cu)
            if job.landed is not None:
                self._store_landed(job.landed, info.express_cu)
        return self._record(dev, info, stream)

    def submit_table(self, job: ChunkJob) -> Completion:
        """Start one chunk of a batch (``cells``: its (N, 3) rows), followed by one event. DMA: one ``cuMemcpyBatchAsync``
        where the driver has it, else a ``cudaMemcpyAsync`` per segment (`BatchedDma`), on the
        stream `submit` would use; a bulk chunk of several segments is enqueued by the pusher's
        thread (`_push_batch`), an urgent one at once. Express: the copy kernel's table form, one
        launch per `TABLE_MAX` (256) segments (a launch per segment where the kernel has no table form). A
        peer lane's chunk (DMA only) is one ``cudaMemcpyPeerAsync`` per segment."""
        lane, path, dst, src, strict, gated, peaks = (
            job.lane,
            job.path,
            job.dst,
            job.src,
            job.strict,
            job.gated,
            job.peaks,
        )
        cells = job.cells
        assert cells is not None
        dev, info, s_host, d_host = self._ends(lane, dst, src)
        if not len(cells):
            return Done()
        dst_offsets, src_offsets, sizes = cells[:, 0], cells[:, 1], cells[:, 2]
        # The daemon checked the batch (batch.py); a bound here costs little and keeps a wrong
        # table off the GPU. Largest offset plus largest size first: a few numpy calls fewer,
        # and none for a whole batch, whose peaks the daemon found when it read the table (the
        # three reductions cost an urgent batch's launch ~36 us at p50 on a thread just woken).
        dst_max, src_max, largest = peaks if peaks is not None else column_peaks(cells)
        fits = dst_max + largest <= dst.nbytes and src_max + largest <= src.nbytes
        if not fits and (
            int((dst_offsets + sizes).max()) > dst.nbytes or int((src_offsets + sizes).max()) > src.nbytes
        ):
            raise InvalidRequest(
                f"a segment of this chunk falls outside its region ({dst.nbytes} / {src.nbytes} bytes)"
            )
        self._use(lane.device)
        if path is _DMA:
            stream = info.strict if strict else info.dma
            sp = s_host.host_pointer if s_host is not None else src.pointer  # type: ignore[attr-defined]
            dp = d_host.host_pointer if d_host is not None else dst.pointer  # type: ignore[attr-defined]
            if lane.direction is _PEER:
                # Segment by segment: the batched call over peer memory has never run (no machine
                # with two GPUs was lent), and a first failure there would switch every lane's
                # batches to per-segment copies for good (`BatchedDma`).
                copy_peer = self._rt.cudaMemcpyPeerAsync
                dst_dev, src_dev = lane.peer, lane.device
                for d, s_, n in zip(
                    (dst_offsets + np.uint64(dp)).tolist(),
                    (src_offsets + np.uint64(sp)).tolist(),
                    sizes.tolist(),
                    strict=True,
                ):
                    check(copy_peer(d, dst_dev, s_, src_dev, n, stream))
            elif not strict and len(sizes) > 1:
                return self._push_batch(dev, info, dp, sp, dst_offsets, src_offsets, sizes, stream, gated)
            else:
                if gated and info.gate is not None:
                    self._wait_gate(info)
                self._batched.copy(dp, sp, dst_offsets, src_offsets, sizes, info.kind, stream)
                if job.landed is not None:
                    self._store_landed(job.landed, info.strict_cu if strict else info.dma_cu)
        else:
            if info.express_max == 0:
                raise EngineError(
                    f"lane {lane} has no express path ({self._express_error or 'express is off'}); submit it as DMA"
                )
            stream = info.express
            sp = s_host.device_pointer if s_host is not None else src.pointer  # type: ignore[attr-defined]
            dp = d_host.device_pointer if d_host is not None else dst.pointer  # type: ignore[attr-defined]
            self._kernel.launch_table(
                dev, dp, sp, cells, info.express_cu, largest=largest
            )  # the rows as they came: no table built
            if job.landed is not None:
                self._store_landed(job.landed, info.express_cu)
        return self._record(dev, info, stream)

    def _push_batch(
        self,
        dev: Device,
        info: Lane,
        dp: int,
        sp: int,
        dst_offsets: npt.NDArray[np.uint64],
        src_offsets: npt.NDArray[np.uint64],
        sizes: npt.NDArray[np.uint64],
        stream: Any,
        gated: bool,
    ) -> Completion:
        """A bulk batch chunk, enqueued and followed by its event on the pusher's thread: the
        driver's ~1 us a segment is spent there, not on the event loop (pusher.py). A gated
        chunk goes in calls of `GATED_CALL_SEGMENTS`, each behind a wait on the lane's gate."""
        pool = dev.events
        event = pool.take()
        rt, batched, kind, device = self._rt, self._bulk_batched, info.kind, dev.index
        each_call = functools.partial(self._wait_gate, info) if gated and info.gate is not None else None
        call_segments = GATED_CALL_SEGMENTS if each_call is not None else 0

        def enqueue() -> None:
            check(rt.cudaSetDevice(device))  # the runtime's current device is per thread
            batched.copy(
                dp, sp, dst_offsets, src_offsets, sizes, kind, stream, each_call=each_call, call_segments=call_segments
            )
            check(rt.cudaEventRecord(event, stream))

        return EventCompletion(event, pool, info.busy, stream, ticket=self._pusher.push(enqueue))

    def _ends(
        self, lane: LaneKey, dst: Memory, src: Memory
    ) -> tuple[Device, Lane, CudaHostMemory | None, CudaHostMemory | None]:
        """The device and lane of a chunk, and which ends are host memory; InvalidRequest if the
        memories do not fit the lane."""
        # The hot path: no Enum hashing (Enum.__hash__ is Python code), identity tests instead.
        dev = self._devices.get(lane.device)
        if dev is None or self._closed:
            self._check_open()
            raise InvalidRequest(f"this engine does not serve gpu{lane.device}")
        direction = lane.direction
        if direction is _PEER:
            peer = dev.peers.get(lane.peer)  # type: ignore[arg-type]
            if peer is None:
                raise InvalidRequest(f"this engine has no lane {lane}")
            info = peer
        else:
            info = dev.h2d if direction is _H2D else dev.d2h if direction is _D2H else dev.d2d
        s_host = src if type(src) is CudaHostMemory else _host(src)
        d_host = dst if type(dst) is CudaHostMemory else _host(dst)
        if (s_host is not None) is not info.host_src or (d_host is not None) is not info.host_dst:
            raise InvalidRequest(f"lane {lane} needs {_ENDS_TEXT[direction]}, got {_what(src)} -> {_what(dst)}")
        # Every device end must be on the lane's GPU (a peer lane: the source on it, the
        # destination on its peer); a copy between GPUs belongs on their peer lane.
        want_src, want_dst = lane.device, lane.peer if direction is _PEER else lane.device
        if (s_host is None and src.device != want_src) or (d_host is None and dst.device != want_dst):
            raise InvalidRequest(f"lane {lane} got {_what(src)} -> {_what(dst)}: a device end is on another GPU")
        return dev, info, s_host, d_host

    def _record(self, dev: Device, info: Lane, stream: Any) -> Completion:
        """An event from the device's pool, recorded on ``stream`` after the chunk (the lane's busy
        time counts from now until it is seen done)."""
        pool = dev.events
        event = pool.free.pop() if pool.free else pool.take()
        check(self._rt.cudaEventRecord(event, stream))
        return EventCompletion(event, pool, info.busy, stream)

    # -- GPU-side ordering: the client's IPC events ----------------------------------------

    def open_event(self, handle: bytes, device: int, region: Any) -> IpcEvent:
        """Open a client's ``cudaIpcEventHandle_t`` with GPU ``device`` current (an IPC event
        can be used on its own GPU only). About as costly as an event create; the session opens
        each handle once per connection."""
        self._check_open()
        dev = self._device(device)
        self._use(device)
        try:
            event = check(self._rt.cudaIpcOpenEventHandle(event_handle_from_bytes(handle)))
        except CudaError as exc:
            raise InvalidRequest(
                f"the event handle does not open on gpu{device} ({exc}): send cudaIpcGetEventHandle of an event made with "
                "cudaEventInterprocess | cudaEventDisableTiming on the copy's GPU, by a live process"
            ) from exc
        opened = CudaIpcEvent(event, device, dev.events, self._close_event)
        self._ipc_events.add(opened)
        return opened

    def _close_event(self, event: CudaIpcEvent) -> None:
        self._ipc_events.discard(event)
        if self._closed:
            return
        rt, handle = self._rt, event.event

        def destroy() -> None:
            try:
                check(rt.cudaEventDestroy(handle))
            except CudaError as exc:  # the client's process or the GPU failed: nothing to undo
                self._log.warning("cuda ipc event destroy", error=str(exc))

        # A record of this event may still wait in the pusher's queue (`record_event`).
        self._after_pusher(event.device, self._pusher.pending > 0, destroy, "cuda ipc event destroy")

    def record_event(self, event: IpcEvent, after: list[Completion]) -> None:
        """Record the client's event on the stream of the copy's last chunk, right behind it.

        A copy's chunks normally share one stream, so stream order alone makes the event
        complete after all of them. Where an earlier chunk went on another of the lane's
        streams (a reload moved its class), that stream's own pool event is waited on first:
        only our chunks' events, which complete whatever the client does, never the client's.
        Where a chunk is still waiting for the pusher (not on its stream yet), the record waits
        in the pusher's queue behind it; a failure there is logged.
        """
        assert isinstance(event, CudaIpcEvent)
        last = after[-1] if after else None
        if not isinstance(last, EventCompletion) or last.stream is None:
            raise EngineError("a signal_event needs the copy's last chunk in flight; none was")
        rt, device, stream, handle = self._rt, event.device, last.stream, event.event
        waits = [
            c.event
            for c in after[:-1]
            if isinstance(c, EventCompletion) and c.stream is not stream and c.event is not None
        ]

        def record() -> None:
            for chunk_event in waits:
                check(rt.cudaStreamWaitEvent(stream, chunk_event, 0))
            check(rt.cudaEventRecord(handle, stream))

        self._after_pusher(
            device, any(isinstance(c, EventCompletion) and c.pending for c in after), record, "cuda signal_event"
        )

    def _after_pusher(self, device: int, queued: bool, calls: Callable[[], None], what: str) -> None:
        """Make CUDA ``calls`` on ``device`` that must follow what the pusher's thread has
        queued: at once on this thread (their errors raised), or, with ``queued`` (something
        they must follow is still in the pusher's queue), in that queue behind it (their errors
        logged as ``what``)."""
        if not queued:
            self._use(device)
            calls()
            return
        rt = self._rt

        def later() -> None:
            try:
                check(rt.cudaSetDevice(device))  # the runtime's current device is per thread
                calls()
            except CudaError as exc:
                self._log.warning(what, error=str(exc))

        self._pusher.push(later)

    def busy_seconds(self) -> dict[LaneKey, float]:
        return {lane.key: lane.busy.total() for dev in self._devices.values() for lane in dev.lanes}

    def device_uuids(self) -> dict[int, str]:
        return {index: dev.uuid for index, dev in self._devices.items()}

    def statistics(self) -> dict[str, object]:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        lanes: dict[str, object] = {}
        devices: list[dict[str, object]] = []
        for dev in self._devices.values():
            devices.append(
                {
                    "index": dev.index,
                    "uuid": dev.uuid,
                    "name": dev.name,
                    "pci_bus_id": dev.pci_bus_id,
                    "sm_count": dev.sm_count,
                    "kernel_registers": dev.kernel_registers,
                    "express_grid": self._kernel.grid(dev),
                }
            )
            for lane in dev.lanes:
                lanes[str(lane.key)] = {
                    "dma_gbps": round(lane.dma_bandwidth / 1e9, 2),
                    "express_gbps": round(lane.express_bandwidth / 1e9, 2),
                    "express_min": lane.express_min,
                    "express_max": lane.express_max,
                    **({"peer_access": lane.peer_access} if lane.key.peer is not None else {}),
                }
        return {
            "backend": self.name,
            "busy_fraction": {str(lane): round(s / elapsed, 4) for lane, s in self.busy_seconds().items()},
            "devices": devices,
            "lanes": lanes,
            "express": bool(self._express_wanted and self._express_error is None and self._devices),
            "express_error": self._express_error,
            "batch_dma": "cuMemcpyBatchAsync" if self._batched.error is None else "per segment",
            "batch_dma_error": self._batched.error,
            "bulk_gates": self._gates_error is None and bool(self._devices),
            "bulk_gates_error": self._gates_error,
            **self._regions.statistics(),
        }

    def _store_landed(self, landed: tuple[HostMemory, int, int], stream: Any) -> None:
        """Enqueue the store of a copy's landed word on ``stream``, behind its last chunk and
        ahead of that chunk's event, so the event's completion means the store is done (the
        ring's memory may then go). The store's default memory barrier makes the copy's bytes
        visible before the word (as ``__threadfence_system``)."""
        mem, offset, value = landed
        if stream is not None:  # a peer lane's strict stream has no driver handle: the completion says
            check(self._write_value(stream, mem.device_pointer + offset, value, 0))  # type: ignore[attr-defined]

    def _wait_gate(self, info: Lane) -> None:
        """Enqueue, on the lane's bulk stream, the wait on its gate word that a gated chunk
        follows (`Gates`)."""
        check(self._wait_value(info.dma_cu, info.gate, 0, self._gate_eq))

    def set_gates(self, closed: frozenset[LaneKey]) -> None:
        """Write every local lane's gate word: 1 for a lane in ``closed``, else 0 (`Gates`)."""
        for lane, (gates, i) in self._gate_of.items():
            gates.set(i, lane in closed)

    def set_gate(self, lane: LaneKey, closed: frozenset[LaneKey]) -> None:
        """Write ``lane``'s gate word alone (`set_gates`' for one lane)."""
        gate = self._gate_of.get(lane)
        if gate is not None:
            gate[0].set(gate[1], lane in closed)

    def close(self) -> None:
        """Wait for our streams, then destroy events and streams and free everything. Idempotent.

        Errors (a GPU that already failed) are logged, not raised: close runs on the way out.
        """
        if self._closed:
            return
        self._closed = True
        self._gate_of = {}  # the gate words are freed with their devices below: no more writes
        self._pusher.close()  # what it has queued goes on its streams, and is waited for below
        errors: list[BaseException] = []

        def attempt(result: tuple[Any, ...]) -> None:
            try:
                check(result)
            except CudaError as exc:
                errors.append(exc)

        for dev in self._devices.values():
            if dev.gates is not None:
                dev.gates.open_all()  # a gated chunk must not wait on a word no one will write
            dev.synchronize(attempt)
        for ipc in list(self._ipc_events):
            self._use(ipc.device)
            attempt(self._rt.cudaEventDestroy(ipc.event))
        self._ipc_events.clear()
        errors.extend(self._regions.close())
        for dev in self._devices.values():
            dev.close(attempt)
        self._current = None
        for problem in errors:
            self._log.warning("cuda close", error=str(problem))

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the cuda engine is closed")

    def _device(self, device: int) -> Device:
        dev = self._devices.get(device)
        if dev is None:
            raise InvalidRequest(f"this engine does not serve gpu{device} (it serves {sorted(self._devices)})")
        return dev


_H2D, _D2H, _D2D, _PEER = Direction.H2D, Direction.D2H, Direction.D2D, Direction.PEER
_DMA = Path.DMA
_ENDS_TEXT = {
    Direction.H2D: "host -> device",
    Direction.D2H: "device -> host",
    Direction.D2D: "device -> device",
    Direction.PEER: "device -> device",
}


def _host(mem: Memory) -> CudaHostMemory | None:
    """``mem`` if it is a host region of this engine, None for a live device region."""
    if isinstance(mem, CudaHostMemory):
        return mem
    if isinstance(mem, CudaDeviceMemory):
        if mem.released:
            raise InvalidRequest("device region was released")
        return None
    raise InvalidRequest(f"{type(mem).__name__} was not made by the cuda engine")


def _what(mem: Memory) -> str:
    return "host" if mem.is_host else f"gpu{mem.device}"
