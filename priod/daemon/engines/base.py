"""The engine interface: what the daemon needs from a copy backend, and nothing more.

An engine owns memory (host regions it maps and pins, device regions it allocates or imports)
and runs copies between them. The scheduler decides *what* to submit and *when*; the engine
only executes, in FIFO order per lane, like the hardware's copy engines. Completion is found by
polling `Completion.done()` from the event loop, so nothing here may block for long.

Two paths per lane:
- ``dma``: the copy engine. FIFO and non-preemptive per submitted chunk: a chunk submitted
  behind 64 MiB of other chunks waits for all of them.
- ``express``: a path that does not queue behind the copy engine (on CUDA, a copy kernel on the
  highest-priority stream over mapped host memory). Optional: `Engine.express_range` says for
  which sizes a lane has it.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import numpy as np
import numpy.typing as npt

from priod.common.gpus import uuid_key
from priod.common.types import LaneInfo, LaneKey, Path
from priod.errors import InvalidRequest
from priod.wire.batch import Cells

__all__ = [
    "AllOf",
    "ChunkJob",
    "Completion",
    "DeviceExport",
    "DeviceMemory",
    "Engine",
    "HostMemory",
    "IpcEvent",
    "Memory",
    "map_fd",
    "release_mapping",
]


class Memory:
    """A buffer an engine can copy to or from. Subclasses carry the engine's own handle."""

    nbytes: int
    device: int | None
    """The GPU index for device memory, None for host memory."""

    @property
    def is_host(self) -> bool:
        return self.device is None


class HostMemory(Memory):
    """Host memory shared with a client through a memfd, mapped (and on CUDA pinned) once."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.device = None
        self.mapping, self.array = map_fd(fd, nbytes)

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    def unmap(self) -> None:
        release_mapping(self)


@dataclass(frozen=True)
class DeviceExport:
    """How a client reaches a device region the daemon allocated: by ``fd``, a file the client
    keeps, so that the memory outlives the daemon (docs/reliability.md).

    ``kind`` says what ``fd`` is: ``memfd`` (sim: a memfd the client maps) or ``vmm_fd`` (cuda:
    the POSIX fd of a ``cuMemCreate`` allocation of ``size`` bytes, which the client imports
    and maps, and registers again with a restarted daemon).
    """

    fd: int
    kind: str = "memfd"
    offset: int = 0
    size: int = 0


class DeviceMemory(Memory):
    """Device memory; ``export`` says how a client reaches it (None if the client owns it)."""

    export: DeviceExport | None = None


class Completion(ABC):
    """The token for one submitted chunk."""

    @abstractmethod
    def done(self) -> bool:
        """True once the chunk's bytes have landed; raises `EngineError` if the chunk failed.

        Cheap (a flag read or one ``cudaEventQuery``) and never blocks: the poller calls it
        for every chunk in flight.
        """

    def release(self) -> None:  # noqa: B027 - optional hook
        """Give back resources (an event to its pool). Called once, after `done()` is final."""


class AllOf(Completion):
    """Done when every one of ``parts`` is: a chunk submitted as several engine operations."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list[Completion]) -> None:
        self._parts = parts

    def done(self) -> bool:
        # A failed part is reported only once every part has ended: the caller releases all of
        # them then, and a part still running must not have its token given back.
        failure: Exception | None = None
        for part in self._parts:
            try:
                if not part.done():
                    return False
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return True

    def release(self) -> None:
        for part in self._parts:
            part.release()


class IpcEvent(ABC):
    """An event a client shares for GPU-side ordering (docs/design.md): opened once per
    connection by `Engine.open_event`, then polled (a ``wait_event``) or recorded after a copy
    (a ``signal_event``). Never waited on by a stream the daemon shares between clients."""

    device: int
    """The daemon's ordinal of the GPU the event belongs to."""

    @abstractmethod
    def query(self) -> bool:
        """True once the work recorded before it has completed (or it was never recorded).

        Cheap and never blocks: a copy's ``wait_event`` is polled from the loop. Raises
        `EngineError` if the engine reports the event broken.
        """

    @abstractmethod
    def close(self) -> None:
        """Give the event back (the client's connection ended). Idempotent. A record still
        pending completes on its own; the client's event is not destroyed, only our import."""


@dataclass(slots=True)
class ChunkJob:
    """One chunk for an engine to start: where it runs, what it copies, and how it may queue.

    Made once per chunk on the daemon's loop, so not frozen: a frozen dataclass sets each of its
    11 fields through ``object.__setattr__`` (1.47 us a job against 0.52, 2-vCPU VM). Engines
    read it and never change it."""

    lane: LaneKey
    path: Path
    dst: Memory
    src: Memory
    _: KW_ONLY
    dst_offset: int = 0
    src_offset: int = 0
    nbytes: int = 0
    """A contiguous chunk's size; a batch chunk's rows carry their own."""
    cells: Cells | None = None
    """A batch chunk's (N, 3) uint64 rows ``(dst_offset, src_offset, nbytes)``, C order; None
    for a contiguous chunk."""
    peaks: tuple[int, int, int] | None = None
    """A batch chunk's largest destination offset, source offset and size where the caller has
    them (a whole batch's, `Segments.peaks`), so that an engine bounding the rows again need not
    look for them."""
    strict: bool = False
    gated: bool = False
    landed: tuple[HostMemory, int, int] | None = None
    """(memory, byte offset, value): store the 8-byte ``value`` there right behind this chunk,
    before its completion is seen done: a copy ring's landed word (`priod.wire.ring`), which the
    client waiting for the copy spins on. Only where `Engine.stores_landed` is true."""


class Engine(ABC):
    """A copy backend. All methods are called from the daemon's event-loop thread."""

    name: str
    wakes_on_completion: bool = False
    """True if the engine calls the wakeup hook on every completion (the poller may then sleep)."""
    stores_landed: bool = False
    """True if the engine honours `ChunkJob.landed` (CUDA: stream memory operations work)."""

    @abstractmethod
    def lanes(self) -> list[LaneInfo]:
        """Every lane this engine serves, with its bandwidth and express range."""

    @abstractmethod
    def map_host(self, fd: int, nbytes: int) -> HostMemory:
        """Map ``fd`` (a memfd of at least ``nbytes``) and make it copyable (pin it on CUDA).

        The engine keeps its own mapping; the caller may close ``fd`` afterwards.
        """

    @abstractmethod
    def release_host(self, mem: HostMemory) -> None:
        """Unpin and unmap. Only called once no chunk touching ``mem`` is in flight."""

    @abstractmethod
    def alloc_device(self, nbytes: int, device: int) -> DeviceMemory:
        """Allocate device memory that a client can reach through ``mem.export``."""

    @abstractmethod
    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """Open client-owned device memory from its IPC handle (cuda only)."""

    def import_device_fd(self, fd: int, size: int, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """Import and map client-owned ``cuMemCreate`` memory from its POSIX fd (``size``: the
        whole allocation) and take ``nbytes`` at ``offset`` (cuda only). ``fd`` stays the caller's."""
        raise InvalidRequest(
            f"register_device of cuMemCreate memory (kind 'vmm_fd') needs the cuda engine; this daemon runs the {self.name} engine: "
            "use alloc_device and view it with Region.torch()"
        )

    def import_device_memfd(self, fd: int, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """Take a memfd as device memory (sim only: a sim device region's memfd, registered
        again by its client after a daemon restart). ``fd`` stays the caller's."""
        raise InvalidRequest(
            f"register_device of a memfd (kind 'memfd') is for the sim engine's device regions; this daemon runs the {self.name} engine: "
            "register your CUDA buffer itself (register_device), or allocate again with alloc_device"
        )

    def import_device_pool(self, fd: int, export: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """Import client-owned memory of a stream-ordered pool: the pool from its POSIX fd, the
        allocation from its ``CUmemPoolPtrExportData`` bytes, and take ``nbytes`` at ``offset``
        (cuda only). ``fd`` stays the caller's."""
        raise InvalidRequest(
            f"register_device of stream-ordered pool memory (kind 'pool_fd') needs the cuda engine; this daemon runs the {self.name} engine: "
            "use alloc_device and view it with Region.torch()"
        )

    @abstractmethod
    def release_device(self, mem: DeviceMemory) -> None:
        """Free (or close the imported handle of) device memory. Nothing is in flight on it."""

    def submit(self, job: ChunkJob) -> Completion:
        """Start one chunk and return at once. DMA chunks of one lane run in submission order.

        A contiguous chunk (``job.cells is None``) copies ``job.nbytes`` from ``job.src_offset``
        to ``job.dst_offset``. A batch chunk copies each row ``(dst_offset, src_offset, nbytes)``
        of ``job.cells``, in no set order, as one unit (one completion, FIFO with the lane's
        other chunks); the caller has checked the table (priod/wire/batch.py). ``strict`` marks an
        urgent DMA chunk: an engine with a separate queue for those (CUDA: a second stream, which
        small copies can use to pass the bulk stream) may use it. ``gated`` (a bulk DMA chunk):
        it may not begin while its lane's gate is closed (`set_gates`); an engine without gates
        runs it as any other.
        """
        return self.submit_range(job) if job.cells is None else self.submit_table(job)

    @abstractmethod
    def submit_range(self, job: ChunkJob) -> Completion:
        """Start a contiguous chunk (`submit`)."""

    def submit_table(self, job: ChunkJob) -> Completion:
        """Start a batch chunk (`submit`): here one contiguous chunk per row, for engines
        without a batched call."""
        assert job.cells is not None
        parts = [
            self.submit(
                ChunkJob(
                    job.lane,
                    job.path,
                    job.dst,
                    job.src,
                    dst_offset=d,
                    src_offset=s_,
                    nbytes=n,
                    strict=job.strict,
                    gated=job.gated,
                )
            )
            for d, s_, n in job.cells.tolist()
        ]
        return parts[0] if len(parts) == 1 else AllOf(parts)

    def set_gates(self, closed: frozenset[LaneKey]) -> None:  # noqa: B027 - optional hook
        """Close the gates of the ``closed`` lanes and open every other: a gated chunk of a
        closed lane that has not begun waits, on the device, until its gate opens (one
        running keeps running). The pump closes a lane's gate while a client's direct copy
        holds it, so that copy waits for the chunk running, not for the one queued behind it.
        An engine without gates ignores this."""

    def set_gate(self, lane: LaneKey, closed: frozenset[LaneKey]) -> None:
        """`set_gates` where only ``lane``'s gate changed: the pump's call as one of its urgent
        DMA chunks goes or ends, so that it costs one lane rather than every lane of every
        GPU (80 on eight GPUs with their peer links). This default sets them all."""
        self.set_gates(closed)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Register a thread-safe callable the engine may call when some chunk completes.

        Polling stays the source of truth; a wakeup only lets the poller sleep longer. The
        CUDA engine never calls it (it is polled), the sim engine calls it from its threads.
        """

    def statistics(self) -> dict[str, object]:
        """Engine-specific figures for `priod status` (calibration, registration times...)."""
        return {}

    def device_uuids(self) -> dict[int, str]:
        """Each served GPU's UUID (``GPU-xxxxxxxx-...``, as nvidia-smi prints it) by this
        daemon's ordinal. Empty for an engine that has none (test fakes)."""
        return {}

    def device_uuid(self, ordinal: int) -> str:
        """What names GPU ``ordinal`` in status, logs and metric labels: its UUID, or
        ``gpu<ordinal>`` where the engine reports none. The one place that label is made."""
        return self.device_uuids().get(ordinal) or f"gpu{ordinal}"

    def device_ordinal(self, device_uuid: str) -> int:
        """This daemon's ordinal of the GPU a client named by UUID (its own ordinal may differ:
        ``CUDA_VISIBLE_DEVICES`` renumbers what each process sees).

        Raises:
            InvalidRequest: ``device_uuid`` is malformed, or names no GPU this engine serves;
                the message lists the GPUs it does serve.
        """
        key = uuid_key(device_uuid)
        served = self.device_uuids()
        for ordinal, text in served.items():
            if uuid_key(text) == key:
                return ordinal
        have = ", ".join(f"gpu{i}={u}" for i, u in sorted(served.items())) or "none with a UUID"
        raise InvalidRequest(
            f"this daemon serves no GPU {device_uuid}; it serves {have}. Check the UUID your process reports "
            "(nvidia-smi -L) and that the daemon sees that GPU ([cuda] devices, its own CUDA_VISIBLE_DEVICES)"
        )

    def host_bandwidth(self) -> float:
        """Bytes per second of host memory that all h2d and d2h lanes of all GPUs share, where
        the engine knows it binds below the sum of their rates; 0: no shared limit known (the
        scheduler then takes each lane's rate as its own)."""
        return 0.0

    def busy_seconds(self) -> dict[LaneKey, float]:
        """Per lane, the running total of seconds its copy engine was busy (the metrics' busy
        counter); an engine that cannot tell returns no lane."""
        return {}

    def open_event(self, handle: bytes, device: int, region: Callable[[int], Memory]) -> IpcEvent:
        """Open a client's event from its 64-byte handle (cuda: a ``cudaIpcEventHandle_t``) with
        GPU ``device`` current. ``region`` resolves a region id that the client may use (the sim
        engine's handles name a byte of a device region; it raises if the client may not).

        Raises:
            InvalidRequest: the handle does not open, naming what to send instead.
        """
        raise InvalidRequest(
            f"the {self.name} engine has no IPC events; send the copy without wait_event and signal_event"
        )

    def record_event(self, event: IpcEvent, after: list[Completion]) -> None:
        """Record ``event`` so that it completes once every chunk in ``after`` has (the copy's
        chunks in flight, its last one last), on the stream of the last one: no stream waits
        for anything of the client's. Returns at once."""
        raise InvalidRequest(f"the {self.name} engine has no IPC events; send the copy without signal_event")

    @abstractmethod
    def close(self) -> None:
        """Stop the engine's threads and free what it holds. Idempotent."""


def release_mapping(mem: HostMemory | DeviceMemory) -> None:
    """Drop ``mem``'s view and close its mapping; if some slice of it is still referenced
    (a finished job not yet collected), the mapping closes when that slice goes."""
    mapping = mem.mapping  # type: ignore[union-attr]
    del mem.array  # type: ignore[union-attr]
    try:
        mapping.close()
    except BufferError:
        pass


def map_fd(fd: int, nbytes: int) -> tuple[mmap.mmap, npt.NDArray[np.uint8]]:
    """Map ``nbytes`` of ``fd`` shared and read-write, and view it as uint8.

    Raises ValueError if the file is shorter than ``nbytes`` (a client passing a short memfd
    must get an error, not a SIGBUS on the first copy).
    """
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ValueError(f"the passed file holds {size} bytes but the region asks for {nbytes}; ftruncate it first")
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)
