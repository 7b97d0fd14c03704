"""Fakes for tests of the daemon's parts: an engine whose copies finish only when the test says
so, and connected framed sockets without a daemon.

`ManualEngine` is a real `priod.daemon.engines.base.Engine`: it maps host memfds, allocates device
memory (a memfd, as the sim engine does, so a test or a client can read what landed) and
really copies the bytes of a chunk, but only when the test calls `ManualEngine.complete`
(or `fail`). Nothing runs by itself, so a scheduler or poller test decides exactly what is in
flight at each step, and can count how often the daemon polled. Its lanes (devices,
bandwidth, express range) and whether it wakes the poller on completion (the sim engine does,
the CUDA engine is polled) are set at construction.

`framed_pair` gives two `priod.wire.transport.FramedSocket` ends over a real Unix socket pair, so
frames and file descriptors (SCM_RIGHTS) pass between them as they would between a client and
the daemon; `blocking_framed_pair` the same for blocking code.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from priod.common.types import LOCAL_DIRECTIONS, Direction, LaneInfo, LaneKey, Path
from priod.daemon.engines.base import (
    ChunkJob,
    Completion,
    DeviceExport,
    DeviceMemory,
    Engine,
    HostMemory,
    Memory,
    map_fd,
    release_mapping,
)
from priod.daemon.engines.sim import sealed_memfd
from priod.errors import EngineError, InvalidRequest, PriodError
from priod.wire.frames import DEFAULT_MAX_FRAME
from priod.wire.transport import BlockingFramedSocket, FramedSocket

__all__ = [
    "ManualChunk",
    "ManualDeviceMemory",
    "ManualEngine",
    "blocking_framed_pair",
    "framed_pair",
    "memfd",
]

ChunkState = Literal["pending", "done", "failed"]


def memfd(nbytes: int, name: str = "priod-test") -> int:
    """A memfd of ``nbytes`` (zeros) that cannot shrink: what a client passes for a host region."""
    return sealed_memfd(name, nbytes)


class ManualDeviceMemory(DeviceMemory):
    """The manual engine's device memory: a memfd, mapped here and exported by its fd (as on sim).

    Imported memory (`ManualEngine.import_device`) is a memfd too, with no export.
    """

    def __init__(self, nbytes: int, device: int, *, exported: bool = True) -> None:
        self.nbytes = nbytes
        self.device = device
        self.fd = memfd(nbytes, f"priod-manual-gpu{device}")
        self.mapping, self.array = map_fd(self.fd, nbytes)
        self.export = DeviceExport(fd=self.fd) if exported else None
        self.released = False


@dataclass(eq=False)
class ManualChunk(Completion):
    """One submitted chunk, as `Engine.submit` got it; also its `Completion` token."""

    engine: ManualEngine = field(repr=False)
    seq: int
    """Position in submission order, from 0."""
    lane: LaneKey
    path: Path
    dst: Memory = field(repr=False)
    dst_offset: int
    src: Memory = field(repr=False)
    src_offset: int
    nbytes: int
    strict: bool
    gated: bool = False
    state: ChunkState = "pending"
    error: PriodError | None = None
    polls: int = 0
    """How often `done` was called on this chunk."""
    releases: int = 0
    """How often `release` was called (the engine contract: once, after `done` is final)."""

    def done(self) -> bool:
        self.polls += 1
        self.engine.polls += 1
        if self.state == "failed":
            assert self.error is not None
            raise self.error
        return self.state == "done"

    def release(self) -> None:
        self.releases += 1


def _array(mem: Memory) -> npt.NDArray[np.uint8]:
    if not isinstance(mem, (HostMemory, ManualDeviceMemory)):
        raise TypeError(f"the manual engine cannot copy {type(mem).__name__}; give it memory it mapped or allocated")
    if not hasattr(mem, "array"):
        raise RuntimeError("a chunk touches memory that was released while the chunk was in flight")
    return mem.array


class ManualEngine(Engine):
    """An engine whose chunks complete only when the test says so (see the module docstring).

    ``devices`` GPUs, each with a lane per direction in ``directions``; ``bandwidth`` in bytes
    per second (one figure, or one per direction) is what `lanes` reports to the scheduler;
    ``express_range`` is (smallest, largest) copy the express path takes, (0, 0) for none.
    With ``wakes_on_completion`` the engine calls the wakeup hook (`set_wakeup`) on every
    completion or failure, like the sim engine; without it the daemon must poll, like CUDA.

    The test drives it with `complete`, `complete_all`, `complete_chunk` and `fail` (safe from
    any thread) and inspects `submitted`, `pending`, `polls` and `wakeups`.
    """

    name = "manual"

    def __init__(
        self,
        devices: int = 1,
        *,
        bandwidth: float | Mapping[Direction, float] = 2e9,
        express_range: tuple[int, int] = (4096, 64 << 20),
        directions: Iterable[Direction] = LOCAL_DIRECTIONS,
        wakes_on_completion: bool = False,
    ) -> None:
        if devices < 1:
            raise ValueError(f"devices = {devices}: a ManualEngine needs at least one device")
        self.devices = devices
        self.wakes_on_completion = wakes_on_completion
        self.express_range = express_range
        dirs = tuple(directions)
        self._lanes = {
            LaneKey(device, d): LaneInfo(
                LaneKey(device, d),
                float(bandwidth[d] if isinstance(bandwidth, Mapping) else bandwidth),
                express_range[0],
                express_range[1],
            )
            for device in range(devices)
            for d in dirs
        }
        self.submitted: list[ManualChunk] = []
        """Every chunk submitted, in submission order (completed ones stay)."""
        self.polls = 0
        """`Completion.done` calls on any chunk so far."""
        self.wakeups = 0
        """Calls of the wakeup hook so far."""
        self.imports: list[tuple[bytes, ManualDeviceMemory]] = []
        """(IPC handle, memory) of every `import_device`."""
        self.host_memory: list[HostMemory] = []
        """Host memory mapped and not yet released."""
        self.device_memory: list[ManualDeviceMemory] = []
        """Device memory allocated or imported and not yet released."""
        self.gates: list[frozenset[LaneKey]] = []
        """Every `set_gates` call's closed lanes, in order."""
        self.closed = False
        self._wakeup: Callable[[], None] | None = None
        self._lock = threading.Lock()

    # -- the Engine interface ------------------------------------------------------------
    def lanes(self) -> list[LaneInfo]:
        return [self._lanes[k] for k in sorted(self._lanes)]

    def map_host(self, fd: int, nbytes: int) -> HostMemory:
        mem = HostMemory(fd, nbytes)
        self.host_memory.append(mem)
        return mem

    def release_host(self, mem: HostMemory) -> None:
        self._check_idle(mem)
        self.host_memory.remove(mem)
        mem.unmap()

    def alloc_device(self, nbytes: int, device: int) -> DeviceMemory:
        if not 0 <= device < self.devices:
            raise InvalidRequest(f"device {device} does not exist; the manual engine has devices 0..{self.devices - 1}")
        mem = ManualDeviceMemory(nbytes, device)
        self.device_memory.append(mem)
        return mem

    def import_device(self, ipc_handle: bytes, offset: int, nbytes: int, device: int) -> DeviceMemory:
        """Stands in for opening a client's CUDA memory: fresh memory, recorded in `imports`."""
        if not 0 <= device < self.devices:
            raise InvalidRequest(f"device {device} does not exist; the manual engine has devices 0..{self.devices - 1}")
        mem = ManualDeviceMemory(nbytes, device, exported=False)
        self.imports.append((ipc_handle, mem))
        self.device_memory.append(mem)
        return mem

    def release_device(self, mem: DeviceMemory) -> None:
        assert isinstance(mem, ManualDeviceMemory), f"not memory of this engine: {mem!r}"
        self._check_idle(mem)
        self.device_memory.remove(mem)
        self._free(mem)

    def submit_range(self, job: ChunkJob) -> Completion:
        """Record the chunk (in `submitted`) and return it; nothing moves until the test says so."""
        lane, path, dst, src, nbytes = job.lane, job.path, job.dst, job.src, job.nbytes
        dst_offset, src_offset, strict, gated = job.dst_offset, job.src_offset, job.strict, job.gated
        if self.closed:
            raise RuntimeError("submit on a closed ManualEngine")
        info = self._lanes.get(lane)
        if info is None:
            raise ValueError(
                f"lane {lane} does not exist; this engine has {', '.join(str(k) for k in sorted(self._lanes))}"
            )
        if path is Path.EXPRESS and info.express_max == 0:
            raise ValueError(
                f"express chunk submitted on {lane}, which has no express path (express_range {self.express_range})"
            )
        for what, mem, off in (("dst", dst, dst_offset), ("src", src, src_offset)):
            if off < 0 or nbytes < 1 or off + nbytes > mem.nbytes:
                raise ValueError(f"chunk {what} [{off}, {off + nbytes}) falls outside its memory of {mem.nbytes} bytes")
        with self._lock:
            chunk = ManualChunk(
                self, len(self.submitted), lane, path, dst, dst_offset, src, src_offset, nbytes, strict, gated
            )
            self.submitted.append(chunk)
        return chunk

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def set_gates(self, closed: frozenset[LaneKey]) -> None:
        """Recorded in `gates`; the test decides what a closed gate holds back."""
        self.gates.append(closed)

    def statistics(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "submitted": len(self.submitted),
            "pending": len(self.pending),
            "polls": self.polls,
        }

    def close(self) -> None:
        """Idempotent; frees the memory nobody released (pending chunks stay pending)."""
        if self.closed:
            return
        self.closed = True
        for dev in self.device_memory:
            self._free(dev)
        for host in self.host_memory:
            host.unmap()
        self.device_memory.clear()
        self.host_memory.clear()

    # -- what the test drives --------------------------------------------------------------
    @property
    def pending(self) -> list[ManualChunk]:
        """Chunks neither completed nor failed, in submission order."""
        with self._lock:
            return [c for c in self.submitted if c.state == "pending"]

    def complete(self, n: int = 1, *, lane: LaneKey | None = None, path: Path | None = None) -> list[ManualChunk]:
        """Complete the ``n`` oldest pending chunks (of ``lane`` / ``path`` if given), in order.

        Each chunk's bytes are copied from its source to its destination, then it reports done,
        then the wakeup hook runs (with ``wakes_on_completion``). ValueError if fewer than ``n``
        chunks are pending.
        """
        chosen = self._pending_of(lane, path)
        if len(chosen) < n:
            raise ValueError(
                f"asked to complete {n} chunks but {len(chosen)} are pending"
                + (f" on {lane}" if lane else "")
                + (f" by {path.value}" if path else "")
            )
        for chunk in chosen[:n]:
            self.complete_chunk(chunk)
        return chosen[:n]

    def complete_all(self, *, lane: LaneKey | None = None, path: Path | None = None) -> list[ManualChunk]:
        """Complete every pending chunk (of ``lane`` / ``path`` if given), oldest first."""
        chosen = self._pending_of(lane, path)
        for chunk in chosen:
            self.complete_chunk(chunk)
        return chosen

    def complete_chunk(self, chunk: ManualChunk) -> ManualChunk:
        """Complete one given chunk, whatever its place in the queue (an express chunk passing DMA)."""
        self._require_pending(chunk)
        _array(chunk.dst)[chunk.dst_offset : chunk.dst_offset + chunk.nbytes] = _array(chunk.src)[
            chunk.src_offset : chunk.src_offset + chunk.nbytes
        ]
        self._finish(chunk, "done")
        return chunk

    def fail(self, chunk: ManualChunk | None = None, error: PriodError | str | None = None) -> ManualChunk:
        """Fail ``chunk`` (default: the oldest pending one): no bytes move, and its `done` raises
        ``error`` (an `EngineError`, with that message if a string is given)."""
        if chunk is None:
            pending = self.pending
            if not pending:
                raise ValueError("no chunk is pending, so none can fail")
            chunk = pending[0]
        self._require_pending(chunk)
        if not isinstance(error, PriodError):
            error = EngineError(
                error
                or f"injected failure of chunk {chunk.seq} ({chunk.nbytes} bytes on {chunk.lane}); the copy did not complete"
            )
        chunk.error = error
        self._finish(chunk, "failed")
        return chunk

    # -- internals -----------------------------------------------------------------------------
    def _pending_of(self, lane: LaneKey | None, path: Path | None) -> list[ManualChunk]:
        return [c for c in self.pending if (lane is None or c.lane == lane) and (path is None or c.path is path)]

    def _require_pending(self, chunk: ManualChunk) -> None:
        if chunk.engine is not self:
            raise ValueError(f"chunk {chunk.seq} belongs to another engine")
        if chunk.state != "pending":
            raise ValueError(f"chunk {chunk.seq} is already {chunk.state}")

    def _finish(self, chunk: ManualChunk, state: ChunkState) -> None:
        with self._lock:
            chunk.state = state
        if self.wakes_on_completion and self._wakeup is not None:
            self.wakeups += 1
            self._wakeup()

    def _check_idle(self, mem: Memory) -> None:
        busy = [c.seq for c in self.pending if c.dst is mem or c.src is mem]
        if busy:
            raise RuntimeError(f"memory released while chunks {busy} touching it are in flight")

    @staticmethod
    def _free(mem: ManualDeviceMemory) -> None:
        if not mem.released:
            mem.released = True
            release_mapping(mem)
            os.close(mem.fd)


def framed_pair(
    *, max_frame: int = DEFAULT_MAX_FRAME, max_output: int = 4 << 20, max_inbox: int = 1024
) -> tuple[FramedSocket, FramedSocket]:
    """Two connected `FramedSocket` ends (a Unix stream socket pair): frames and fds pass both ways.

    Call it inside a running event loop (each end registers with it); close both ends when done.
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        return (
            FramedSocket(a, max_frame=max_frame, max_output=max_output, max_inbox=max_inbox),
            FramedSocket(b, max_frame=max_frame, max_output=max_output, max_inbox=max_inbox),
        )
    except BaseException:
        a.close()
        b.close()
        raise


def blocking_framed_pair(*, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[BlockingFramedSocket, BlockingFramedSocket]:
    """Two connected `BlockingFramedSocket` ends, for code without an event loop (or one end
    in a thread). A receive with nothing sent blocks: set a timeout on ``end.sock`` if needed."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return BlockingFramedSocket(a, max_frame=max_frame), BlockingFramedSocket(b, max_frame=max_frame)
