"""The simulated engine's model of the hardware: links, the host bus, copy-engine threads, events.

`priod.daemon.engines.sim.SimEngine` builds one `Link` per lane and one `Worker` thread per lane and
path on it; this module is what those do. A `Worker` is a copy engine (or the express path):
FIFO, one chunk (`Job`) at a time, never preempted, paced to its `Link`'s rate. A `Link` is
shared by its lane's copy engine and express path (the express copy gets ``express_share``
while DMA runs beside it); a host link under ``[sim] host_gbps`` also draws on the `HostBus`,
which scales every busy host link down in proportion while they ask for more than there is.
`SimCompletion` is what the daemon polls, and `SimIpcEvent` a client's event, set on the
thread that ends the last chunk it was recorded behind.

The bytes are moved by numpy in slices, and the thread sleeps between slices to keep to the
modelled rate: what the scheduler sees (FIFO order, time per byte, contention) is what it would
see on a copy engine, only slower.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from priod.common.types import Path
from priod.daemon.engines.base import Completion, IpcEvent
from priod.errors import EngineError

__all__ = ["HostBus", "Job", "Link", "SimCompletion", "SimIpcEvent", "Worker"]

OVERSHOOT_CREDIT_S = 200e-6
INLINE_MAX_S = 20e-6
"""Jobs the model times at or below this run at once on an idle engine (see run_inline)."""
INLINE_MAX_SEGMENTS = 16
"""A batch's chunk of more segments than this never runs inline, however few its bytes."""
GATHER_MAX_BYTES = 1 << 20
"""A batch's chunk of more than `INLINE_MAX_SEGMENTS` segments and at most this many bytes moves
in one gather (`gather_segments`), not a Python step per segment: step by step, 32,768 one- and
two-byte segments took the engine's thread 13-14 ms of the GIL the daemon's loop needs (one gather
0.8-4.6 ms), and a ping's p99 beside 8 uids' floods of such batches read 6.4-20.7 ms (2.4-3.0
with the gather). Its index arrays take 24 bytes per byte moved."""
SLICE_BYTES = 1 << 20
"""Granularity of pacing; the chunk as a whole is still never preempted."""
_DMA = Path.DMA
"""A module global: ``Path.DMA`` costs ~55 ns more on Python 3.11 (EnumType's __getattr__),
and `Link.rate` runs once per inline copy on the daemon's loop."""


class SimCompletion(Completion):
    __slots__ = ("_callbacks", "_error", "_finished")

    def __init__(self) -> None:
        self._finished = False
        self._error: EngineError | None = None
        self._callbacks: list[Callable[[], None]] | None = None
        """Run once on the thread that completes the chunk (a signal_event's set); rare, so the
        per-chunk path pays one attribute read."""

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._finished

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the chunk has ended (at once if it has), on the thread that ends it."""
        with _CALLBACKS:
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(fn)
        # Set, then look: the worker sets _finished, then looks for callbacks; one of the two
        # looks sees the other's write, and `_fire` hands the list to exactly one of them.
        if self._finished or self._error is not None:
            self._fire()

    def _fire(self) -> None:
        with _CALLBACKS:
            fns, self._callbacks = self._callbacks, None
        for fn in fns or ():
            fn()


_CALLBACKS = threading.Lock()


class SimIpcEvent(IpcEvent):
    """A client's sim event (priod.wire.ipc_event): one byte of a device region, read and written in
    place; nonzero means complete. The view keeps the mapping alive if the region is freed."""

    __slots__ = ("_flag", "_generation", "_lock", "device")

    def __init__(self, flag: npt.NDArray[np.uint8], device: int) -> None:
        self._flag: npt.NDArray[np.uint8] | None = flag
        self.device = device
        self._lock = threading.Lock()
        self._generation = 0
        """Records so far: as with a CUDA event, only the latest record's completion sets it."""

    def query(self) -> bool:
        flag = self._flag
        return flag is not None and bool(flag[0])

    def record(self, after: list[SimCompletion]) -> None:
        """Pending now; set on the copy engine's thread as soon as every chunk of ``after`` ended
        (at once if they all have), unless the event was recorded again meanwhile."""
        flag = self._flag
        if flag is None:
            return
        with self._lock:
            self._generation += 1
            generation = self._generation
            flag[0] = 0
        left = [len(after)]

        def one_done() -> None:
            with self._lock:
                left[0] -= 1
                if left[0] <= 0 and generation == self._generation:
                    flag[0] = 1

        if not after:
            left[0] = 1
            one_done()
        for c in after:
            c.on_done(one_done)

    def close(self) -> None:
        self._flag = None


class Job:
    __slots__ = (
        "completion",
        "dst",
        "dst_offset",
        "fail",
        "gated",
        "landed",
        "nbytes",
        "segments",
        "src",
        "src_offset",
        "stall_s",
        "strict",
    )

    def __init__(
        self,
        dst: npt.NDArray[np.uint8],
        src: npt.NDArray[np.uint8],
        nbytes: int,
        completion: SimCompletion,
        fail: bool,
        stall_s: float = 0.0,
        gated: bool = False,
        dst_offset: int = 0,
        src_offset: int = 0,
        strict: bool = False,
    ) -> None:
        self.dst, self.src, self.nbytes, self.completion, self.fail = dst, src, nbytes, completion, fail
        """``dst`` and ``src`` are the whole regions' bytes: a contiguous job's bytes are
        ``nbytes`` from ``dst_offset`` and ``src_offset``. No view is cut on the loop to submit
        it (two numpy slices, ~1 us of a small copy's round trip there): the inline run copies
        with one slice assignment, the engine's thread cuts its own as it paces."""
        self.dst_offset, self.src_offset = dst_offset, src_offset
        self.stall_s = stall_s
        """Co-tenant compute wait before the copy starts (express only), drawn at submission."""
        self.gated = gated
        """It may not begin while its engine's gate is closed (`Worker.set_gate`)."""
        self.strict = strict
        """An urgent DMA chunk: on CUDA it has a stream of its own (the lane's strict stream),
        so a gated chunk waiting at the gate on the bulk stream does not hold it up."""
        self.segments: npt.NDArray[np.uint64] | None = None
        """A batch's chunk: its rows [dst offset, src offset, bytes] into ``dst`` and ``src``
        (the offsets above are then unused). The views are cut on the engine's thread, not the loop's."""
        self.landed: tuple[npt.NDArray[np.uint64], int] | None = None
        """A copy ring's landed word (one aligned uint64 of the ring) and its value: stored once
        the bytes have landed, before the completion is (`ChunkJob.landed`)."""

    def spans(self) -> Iterable[Sequence[int]]:
        """(dst offset, src offset, bytes) of each part, in order: a batch chunk's segments,
        else the one range."""
        if self.segments is None:
            return ((self.dst_offset, self.src_offset, self.nbytes),)
        rows: list[list[int]] = self.segments.tolist()
        return rows


def gather_segments(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8], rows: npt.NDArray[np.uint64]) -> None:
    """Copy every row [dst offset, src offset, bytes] of ``rows`` from ``src`` to ``dst`` with one
    fancy-indexed assignment (segments that overlap in ``dst`` are refused before they get here)."""
    sizes = rows[:, 2].astype(np.int64)
    within = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    dst[np.repeat(rows[:, 0].astype(np.int64), sizes) + within] = src[
        np.repeat(rows[:, 1].astype(np.int64), sizes) + within
    ]


class HostBus:
    """Host-memory bandwidth shared by the links that touch host memory (``[sim] host_gbps``).

    ``demand`` is the sum of the nominal rates of the host links moving bytes now; while it
    exceeds ``bandwidth`` every such link runs at ``bandwidth / demand`` of its rate, so
    together they move exactly ``bandwidth``. Read without the lock on the pacing path (a
    float read is atomic under the GIL; a stale value costs one slice at the old rate).
    """

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.demand = 0.0
        self._lock = threading.Lock()

    def scale(self) -> float:
        demand = self.demand
        return 1.0 if demand <= self.bandwidth else self.bandwidth / demand

    def add(self, rate: float) -> None:
        with self._lock:
            self.demand = max(0.0, self.demand + rate)


class Link:
    """One lane's bandwidth, shared by its copy engine and its express path (and, for host
    links under ``host_gbps``, with every other host link through the bus)."""

    def __init__(self, bandwidth: float, express_share: float, bus: HostBus | None = None) -> None:
        self.bandwidth = bandwidth
        self.express_share = express_share
        self.bus = bus
        self.dma_busy = False
        self.express_busy = 0
        self.busy_seconds = 0.0
        self._active = 0
        self._active_lock = threading.Lock()

    def rate(self, path: Path) -> float:
        if path is _DMA:
            rate = self.bandwidth * (1 - self.express_share) if self.express_busy else self.bandwidth
        else:
            rate = self.bandwidth * self.express_share if self.dma_busy else self.bandwidth
        return rate if self.bus is None else rate * self.bus.scale()

    def enter(self, path: Path) -> None:
        """A worker of this link starts moving bytes."""
        if path is _DMA:
            self.dma_busy = True
        else:
            self.express_busy += 1
        if self.bus is not None:
            with self._active_lock:
                self._active += 1
                first = self._active == 1
            if first:  # the link asks the bus for its rate once, however many paths use it
                self.bus.add(self.bandwidth)

    def leave(self, path: Path) -> None:
        if path is _DMA:
            self.dma_busy = False
        else:
            self.express_busy -= 1
        if self.bus is not None:
            with self._active_lock:
                self._active -= 1
                last = self._active == 0
            if last:
                self.bus.add(-self.bandwidth)


class Worker(threading.Thread):
    """A copy engine (or the express path) of one lane: FIFO, one chunk at a time."""

    def __init__(self, name: str, link: Link, path: Path, wakeup: Callable[[], Callable[[], None]]) -> None:
        super().__init__(name=name, daemon=True)
        self.link, self.path, self._wakeup = link, path, wakeup
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._held: deque[Job | None] = deque()
        """Jobs taken from ``jobs`` while a gated one waited at the closed gate, in their order
        (the worker's alone): they go before anything still in ``jobs``."""
        self._last_due = 0.0
        # Jobs handed to the thread, and jobs it finished: one writer each (the loop, the
        # worker), so their difference is the queue's length without a lock.
        self.submitted = 0
        self.completed = 0
        # Co-tenant waits served (express only); written by the worker alone.
        self.stalled = 0
        self.stalled_seconds = 0.0
        # Another CUDA context's copies on this engine (`foreign_copy`): the engine serves one
        # context at a time, so the worker holds its next chunk while one of those runs.
        self._contexts = threading.Condition()
        self._running = False
        self._foreign_since: float | None = None
        """When the other context's copy waiting for this engine arrived (None: none waits)."""
        self._foreign_running = False
        self._slice_s = 0.0
        self._gate_closed = False
        """The daemon's gate for gated jobs (`set_gate`), as a stream waiting on a memory word."""
        self._at_gate = False
        """The worker waits at the closed gate: the daemon's context has nothing it can run."""

    def run_inline(self, job: Job) -> bool:
        """Run the tiny ``job`` on the caller's thread if this engine is idle; False if it must queue.

        A copy the model says takes a few microseconds should not take two thread wake-ups
        (about 150 us on a small VM): a real copy engine finishes a 4 KiB copy in 7-10 us.
        Only when nothing is queued or running, so FIFO order is kept.
        """
        if job.stall_s > 0 or self.submitted != self.completed or job.nbytes / self.link.rate(self.path) > INLINE_MAX_S:
            return False
        if self._foreign_running or self._foreign_since is not None:
            return False  # another context has the engine, or is owed it: queue behind it
        if job.gated and self._gate_closed:
            return False
        if job.segments is not None and len(job.segments) > INLINE_MAX_SEGMENTS:
            return False  # a Python step per segment: thousands of tiny ones would hold the loop
        started = time.perf_counter()
        if job.segments is None:  # the usual inline job, one slice assignment (see `Job`)
            d, s, n = job.dst_offset, job.src_offset, job.nbytes
            job.dst[d : d + n] = job.src[s : s + n]
        else:
            dst, src = job.dst, job.src
            for d, s, n in job.spans():
                dst[d : d + n] = src[s : s + n]
        self._complete(job)
        self.link.busy_seconds += time.perf_counter() - started
        return True

    def put(self, job: Job) -> None:
        """Hand ``job`` to the thread (the loop's side). A strict job wakes a thread waiting at
        the gate at once, to go ahead of the gated job there (`_take_turn`)."""
        self.submitted += 1
        self.jobs.put(job)
        if job.strict and self._at_gate:  # read without the lock: a stale False costs one 1 ms poll
            with self._contexts:
                self._contexts.notify_all()

    @staticmethod
    def _complete(job: Job) -> None:
        if job.fail:
            job.completion._error = EngineError(
                f"injected engine fault on a chunk of {job.nbytes} bytes ([sim] fault_on_nbytes); the copy did not complete"
            )
        else:
            if job.landed is not None:
                word, value = job.landed
                word[0] = value  # one aligned 8-byte store, as the GPU's, before the completion
            job.completion._finished = True
        if job.completion._callbacks is not None:
            job.completion._fire()

    def run(self) -> None:
        while (job := self._take_turn()) is not None:
            if job.stall_s > 0:
                self._stall(job.stall_s)
            started = time.perf_counter()
            self.link.enter(self.path)
            try:
                self._move(job)
            finally:
                self.link.leave(self.path)
                self.link.busy_seconds += time.perf_counter() - started
                with self._contexts:
                    self.completed += 1
                    self._running = False
                    self._contexts.notify_all()
            job = None  # drop the views now, so a freed region's mapping can close
            self._wakeup()()

    def _take_turn(self) -> Job | None:
        """The next chunk of the daemon's context, once it may begin (None: the engine closes).

        In submission order, waiting while another context's copy runs, or is owed the engine
        (its time slice came while this context still had work), and while a gated chunk's
        gate is closed. Waiting at the gate leaves the engine to another context at once, as a
        CUDA stream waiting on a memory word was measured to (H200); and a strict chunk queued
        behind the waiting one goes first, as it does on CUDA from its own stream. A chunk
        that is neither waits behind it: on CUDA it is on the gated chunk's stream."""
        job = self._held.popleft() if self._held else self.jobs.get()
        if job is None:
            return None
        with self._contexts:
            while (
                self._foreign_running
                or (self._foreign_since is not None and time.perf_counter() >= self._foreign_since + self._slice_s)
                or (job.gated and self._gate_closed)
            ):
                if job.gated and self._gate_closed:
                    if not self._at_gate:
                        self._at_gate = True
                        self._contexts.notify_all()
                    strict = self._strict_behind()
                    if strict is not None:
                        self._held.appendleft(job)
                        job = strict
                        continue
                self._contexts.wait(0.001)
            self._at_gate = False
            self._running = True
        return job

    def _strict_behind(self) -> Job | None:
        """The first strict chunk submitted after the gated one at the gate, taken out of the
        queue (those before it keep their order in ``_held``); None if there is none."""
        while True:
            try:
                self._held.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for i, job in enumerate(self._held):
            if job is None:
                return None  # the engine closes: nothing after it runs first
            if job.strict:
                del self._held[i]
                return job
        return None

    def set_gate(self, closed: bool) -> None:
        """Close or open the gate gated jobs wait at before they begin (one running goes on)."""
        with self._contexts:
            if closed != self._gate_closed:
                self._gate_closed = closed
                self._contexts.notify_all()

    def foreign_copy(self, nbytes: int, slice_s: float, switch_s: float) -> float:
        """Another CUDA context's copy of ``nbytes`` on this engine (a client's own DMA, such
        as a direct urgent copy), on the caller's thread; the seconds from its arrival to its
        end. Copy engines time-slice between contexts (measured on an H200: a switch of ~80 us,
        a slice of ~1 ms): the engine goes on with the daemon's context until that has nothing
        queued, or for at most ``slice_s`` (then at its next chunk boundary, chunks are never
        preempted), switches (``switch_s``) and runs the copy at the link's rate while the
        daemon's chunks wait. One such copy at a time per engine. Moves no bytes: it models what
        the daemon's lanes see and what the other context waits for."""
        arrived = time.perf_counter()
        with self._contexts:
            self._slice_s = slice_s
            self._foreign_since = arrived
            while self._running or (
                self.submitted != self.completed and not self._at_gate and time.perf_counter() < arrived + slice_s
            ):
                self._contexts.wait(0.0005)
            self._foreign_running = True
            self._foreign_since = None
        try:
            until = time.perf_counter() + switch_s + nbytes / self.link.rate(self.path)
            while (delay := until - time.perf_counter()) > 0:
                time.sleep(delay)
        finally:
            with self._contexts:
                self._foreign_running = False
                self._contexts.notify_all()
        return time.perf_counter() - arrived

    def _stall(self, seconds: float) -> None:
        """Wait for the co-tenant's time slice: the kernel is launched but not running, so the
        link is not marked busy (DMA beside it keeps the whole bandwidth) and no bytes move."""
        began = time.perf_counter()
        until = began + seconds
        while (delay := until - time.perf_counter()) > 0:
            time.sleep(delay)
        # The copy starts when the slice came, not when the sleep happened to end; and the
        # overshoot credit in _move must not count the wait as time the bytes were moving.
        self._last_due = max(self._last_due, until)
        self.stalled_seconds += time.perf_counter() - began
        self.stalled += 1

    def _move(self, job: Job) -> None:
        # A chunk queued behind the previous one starts when that one was due, not when its
        # sleep happened to end: sleep overshoots by ~50-100 us, which would otherwise cost
        # every back-to-back chunk. The credit is capped well below a chunk's time, so an
        # engine left idle by the scheduler still shows as idle.
        now = time.perf_counter()
        due = max(self._last_due, now - OVERSHOOT_CREDIT_S)
        moved = 0  # bytes since the last pause: a batch's small segments are paced together
        dst, src = job.dst, job.src
        if job.segments is not None and len(job.segments) > INLINE_MAX_SEGMENTS and job.nbytes <= GATHER_MAX_BYTES:
            gather_segments(dst, src, job.segments)
            self._last_due = self._pace(due, job.nbytes)
            self._complete(job)
            return
        # Offsets into the two arrays, not a view per segment: a batch of 512 blocks of 16 KiB
        # moved in 1.0 ms through views, 0.77 without (this VM).
        for d, s, size in job.spans():
            if moved + size < SLICE_BYTES:  # a batch's small block: one slice, paced with the next
                dst[d : d + size] = src[s : s + size]
                moved += size
                continue
            done = 0
            while done < size:
                k = min(SLICE_BYTES - moved, size - done)
                dst[d + done : d + done + k] = src[s + done : s + done + k]
                done += k
                moved += k
                if moved >= SLICE_BYTES:
                    due = self._pace(due, moved)
                    moved = 0
        if moved:
            due = self._pace(due, moved)
        self._last_due = due
        self._complete(job)

    def _pace(self, due: float, nbytes: int) -> float:
        """Sleep until ``nbytes`` more would have moved at the modelled rate; the new due time."""
        due += nbytes / self.link.rate(self.path)
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return due
