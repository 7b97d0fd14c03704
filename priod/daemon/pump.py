"""The pump: hands the scheduler's chunks to the engine and finds them done.

    scheduler.next_chunks -> engine.submit -> (poll) Completion.done() -> scheduler.chunk_done
        -> on_finished(Finished)

It owns the chunks in flight and nothing else: what is queued and how many bytes are in
flight per lane is the scheduler's to count. Completion is found by polling (a flag read on the
sim engine, one ``cudaEventQuery`` on cuda), never by blocking the event loop; the poll loop
sleeps whenever polling cannot find anything new.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import structlog

from priod.common.types import LaneKey, Path
from priod.daemon.engines.base import ChunkJob, Completion, Engine, IpcEvent, Memory
from priod.daemon.gates import Gates
from priod.daemon.holds import Holds
from priod.daemon.log import error_fields
from priod.daemon.looptimer import LoopTimer
from priod.daemon.rings import LandedWord
from priod.daemon.sched.scheduler import Chunk, Finished, Request, Scheduler
from priod.errors import Cancelled, NotFound, PriodError

__all__ = ["BULK_POLL_MARGIN_S", "CopyTarget", "InFlight", "Pump", "next_poll_at", "reanchor_dues"]

log = structlog.get_logger("priod.daemon.pump")

TIMER_MIN_S = 100e-6
"""Shortest timer sleep: an overdue chunk is not re-polled more often than this."""
URGENT_SPIN_WITHIN_S = 50e-6
"""``[server] urgent_poll = "timer"``: a chunk due sooner than this is polled every loop turn,
not slept for (a timerfd wake-up and its loop turn cost about this much)."""
PUMP_ROUNDS = 16
"""Submit-and-collect rounds in one `kick`; the poll loop carries on with any that remain."""


class CopyTarget(Protocol):
    """What a request's payload tells the pump: where its bytes come from and go to."""

    @property
    def dst_mem(self) -> Memory: ...
    @property
    def src_mem(self) -> Memory: ...
    @property
    def dst_offset(self) -> int: ...
    @property
    def src_offset(self) -> int: ...


@dataclass(eq=False, slots=True)
class InFlight:
    """A chunk handed to the engine, and when it should be done: a hint for the poller's sleep."""

    chunk: Chunk
    completion: Completion
    submitted: float
    due: float


def reanchor_dues(waiting: list[InFlight], since: float, bandwidth: float) -> None:
    """Bring forward the due times of one lane's DMA chunks still in flight (in submission
    order) once one of them has been seen complete.

    That chunk was still running at the previous poll (``since``), and a lane's DMA chunks run
    one after another, so the next one started no earlier than ``since`` (or its own
    submission) and each later one as its predecessor ended. Estimating from the previous poll
    rather than from when the completion was noticed keeps each notice's lateness out of the
    next estimate: chained, those delays grow until the lane runs dry between chunks (on the
    H200 that cost 4-5% of bulk bandwidth). Due times only move earlier; the estimate made at
    submission, with every byte ahead counted whole, is the upper bound.
    """
    start = since
    for entry in waiting:
        start = max(start, entry.submitted) + entry.chunk.nbytes / bandwidth
        entry.due = min(entry.due, start)


BULK_POLL_MARGIN_S = 200e-6
"""Queued work a lane must still have when the poller wakes to top it up: the timer's slack
and a busy loop turn, with room to spare."""


def next_poll_at(inflight: Sequence[InFlight], bandwidth: Mapping[LaneKey, float], now: float) -> float:
    """When a polled engine's chunks are next worth a look, while nothing urgent is about.

    An express chunk, and a chunk that ends its copy (a reply waits for it): its due time. A
    lane's other DMA chunks run one after another, so its work cannot run out before its oldest
    chunk ends and the chunks queued behind it have run: the poller waits until that is
    `BULK_POLL_MARGIN_S` away (never before the oldest should be done), finds a chunk done
    nearly every time it looks, and tops the lane up while the link is still busy. Looking at
    every due time instead, which are lower bounds (`reanchor_dues`), took about four polls a
    chunk on the H200: 8,000 polls/s and 0.4-0.5 CPU s/s with bulk alone.
    """
    soonest = math.inf
    oldest_due: dict[LaneKey, float] = {}
    queued: dict[LaneKey, float] = {}
    """Seconds of DMA work behind each lane's oldest chunk."""
    for entry in inflight:
        chunk = entry.chunk
        lane = chunk.request.lane
        if chunk.path is not Path.DMA or chunk.offset + chunk.nbytes == chunk.request.nbytes:
            soonest = min(soonest, entry.due)
        if chunk.path is Path.DMA:
            if lane in oldest_due:
                queued[lane] += chunk.nbytes / bandwidth.get(lane, 1e9)
            else:
                oldest_due[lane], queued[lane] = entry.due, 0.0
    for lane, due in oldest_due.items():
        soonest = min(soonest, max(due, now + queued[lane] - BULK_POLL_MARGIN_S))
    return soonest


class Pump:
    """Feeds ``engine`` from ``scheduler`` and reports every request that ends to ``on_finished``.

    Call `kick` after anything that may let the scheduler hand out a chunk (a copy queued, a
    cancel, a reload); `run` is the poll loop, one task for the daemon's life.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        engine: Engine,
        on_finished: Callable[[Finished], None],
        *,
        bulk_poll: Literal["spin", "timer"] = "timer",
        urgent_poll: Literal["spin", "timer"] = "timer",
        on_signalled: Callable[[Request, Exception | None], None] | None = None,
    ) -> None:
        """``on_signalled``: told when a copy's ``signal_event`` was recorded (None) or could
        not be (the error); the copy goes on either way."""
        self.scheduler = scheduler
        self.engine = engine
        self._stores_landed = engine.stores_landed
        self._on_finished = on_finished
        self._on_signalled = on_signalled
        self.gates = Gates()
        """Copies held until their client's wait_event completes (gates.py)."""
        self._batching = 0
        self._kick_pending = False
        self._gates_closed: frozenset[LaneKey] = frozenset()
        """The lanes whose gate the engine was last told to close (`_set_gates`)."""
        self._held: frozenset[LaneKey] = frozenset()
        """The lanes clients' direct copies hold, as of the last `scan_holds`."""
        self.holds = Holds()
        """Clients' hold pages for their direct urgent copies (holds.py), read before each submission."""
        self.configure_holds()
        self._bulk_poll = bulk_poll
        self.urgent_poll = urgent_poll
        """``[server] urgent_poll``: "timer" keeps no core spinning while urgent work is recent."""
        self._inflight: list[InFlight] = []
        self._dma_tail: dict[LaneKey, float] = {}
        """Per lane, when its last DMA chunk in flight should be done: the next one starts then."""
        self._last_poll = 0.0
        self._paced_by_polls = not engine.wakes_on_completion
        """Due times pace the poller only on an engine that is polled (cuda); sim wakes us."""
        self._bandwidth = {info.key: info.bandwidth for info in engine.lanes()}
        self.lane_bytes = {info.key: 0 for info in engine.lanes()}
        """Bytes landed per lane, counted per chunk (throughput without per-copy granularity)."""
        self.polls = 0
        """Engine polls so far: what polling costs, shown in status (spin vs timer)."""
        self._timer: LoopTimer | None = None
        self._working = False
        """Inside `kick` or `_poll`: a nested kick waits for a later turn."""
        self._kick_later = False
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.urgent_spins = 0
        """Loop turns ``urgent_poll = "timer"`` spent polling a chunk due within `URGENT_SPIN_WITHIN_S`."""
        self.awake_turns = 0
        """Loop turns `run` spent awake, neither polling nor sleeping, because urgent copies were
        recent: what keeping the loop awake for the next one costs."""
        self.beat_turns = 0
        """Loop turns `run` spent awake for a lane's next burst on its beat (``beat_spin_us``)."""

    @property
    def inflight_chunks(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        """Hook the engine's completion wake-ups (and the poll timer) to this loop."""
        loop = self._loop = asyncio.get_running_loop()
        pending = threading.Event()

        def wake_from_thread() -> None:
            # Runs on the loop: clear first, then poll, so no completion is missed.
            pending.clear()
            self._wakeup()

        def wake_from_engine_thread() -> None:
            # One wake-up in flight is enough: a burst of completions costs one self-pipe write.
            if not pending.is_set():
                pending.set()
                loop.call_soon_threadsafe(wake_from_thread)

        self.engine.set_wakeup(wake_from_engine_thread)
        if self._bulk_poll == "timer":
            # Sub-millisecond wake-ups: a polled engine's chunks when due, and on either engine
            # the start of a beat's watch (`run`); the loop's own timers are ~1 ms coarse.
            self._timer = LoopTimer(loop, self._wakeup)

    def stop(self) -> None:
        if self._gates_closed:
            self._held = frozenset()
            self._gates_closed = frozenset()
            self.engine.set_gates(self._gates_closed)  # what is queued must be free to drain
        if self._timer is not None:
            self._timer.close()
            self._timer = None

    # -- the scheduler side ----------------------------------------------------------------
    def kick(self) -> None:
        """Hand every chunk the scheduler releases to the engine.

        Chunks an engine finished at once (a tiny copy on an idle sim lane) are collected here
        and their room refilled, rather than a loop turn later: that turn is most of a small
        copy's round trip. Called again while the pump is at work (a finished copy's reply led,
        through its session, to a new copy), it goes on a later turn instead: the chunks in
        flight are being walked.
        """
        if self._batching:
            self._kick_pending = True  # one kick when the batch of requests has been taken
            return
        if self._working:
            if not self._kick_later:
                self._kick_later = True
                assert self._loop is not None
                self._loop.call_soon(self._deferred_kick)
            return
        self._working = True
        try:
            self._kick()
        finally:
            self._working = False

    def begin_batch(self) -> None:
        """Take a burst of requests (a connection's drain turn) with one kick at its end
        (`end_batch`) instead of one per copy: 256 pipelined copies are then dispatched
        together. A single copy in the turn is kicked when the turn ends, microseconds later."""
        self._batching += 1

    def end_batch(self) -> None:
        self._batching -= 1
        if not self._batching and self._kick_pending:
            self._kick_pending = False
            self.kick()

    def configure_holds(self) -> None:
        """Take the hold limits from the scheduler's policy (at start and on reload)."""
        p = self.scheduler.policy
        self.holds.configure(
            p.direct_hold_max_ms, p.urgent_budget_share, p.direct_hold_burst_ms, p.direct_hold_total_share
        )

    def scan_holds(self) -> None:
        """Read the hold pages and tell the scheduler which lanes clients' direct copies hold."""
        now = time.perf_counter()
        scan = self.holds.scan(now)
        self.scheduler.set_holds(scan.held, scan.begun, now)
        if scan.held != self._held:
            self._held = scan.held
            self._set_gates()

    def _set_gates(self) -> None:
        """Close the gates of the lanes a direct copy holds or an urgent DMA chunk of ours is in
        flight on, and open the rest.

        A gated bulk chunk that has not begun then waits on the device, so the urgent copy waits
        for the chunk running only (design.md, "Bulk gates"); it goes on the moment the gate
        opens. A hold keeps it closed within the hold's limits: a cut hold opens it."""
        closed = self._held | self.scheduler.strict_dma_lanes()
        if closed != self._gates_closed:
            self._gates_closed = closed
            self.engine.set_gates(closed)

    def _strict_dma_moved(self, lane: LaneKey) -> None:
        """A strict DMA chunk on ``lane`` was handed out or ended: set that lane's gate alone
        where it should change (`Engine.set_gate`), an O(1) look instead of `_set_gates`' walk
        over every lane for each urgent chunk (eight GPUs and their peer links: 80 lanes)."""
        shut = lane in self._held or self.scheduler.strict_dma_on(lane)
        if shut != (lane in self._gates_closed):
            self._gates_closed = self._gates_closed | {lane} if shut else self._gates_closed - {lane}
            self.engine.set_gate(lane, self._gates_closed)

    def hold_rung(self) -> None:
        """A client rang its hold doorbell (it announced a direct copy): read the pages now, so
        the lane's gate closes before the next bulk chunk begins, without polling to find out.
        With no bulk about there is nothing to hold (and no budget to charge): bulk that comes
        reads the pages before anything is handed out (`_kick`)."""
        if self._inflight or self.scheduler.has_queued:
            self.scan_holds()
            self._wakeup()

    def close_holds(self, owner: int) -> None:
        """A connection's hold page goes with it; a lane it held is free again at once."""
        if owner in self.holds.pages:
            self.holds.close(owner)
            self.kick()

    def _deferred_kick(self) -> None:
        self._kick_later = False
        self.kick()

    def _kick(self) -> None:
        if self.holds.pages or self.holds.held:
            self.scan_holds()  # before anything is handed out: a direct copy holds bulk back
        for _ in range(PUMP_ROUNDS):
            # An engine that finishes small copies at once (sim) has them done by now: collect
            # them and refill their room in this turn. A polled engine's (cuda's) chunks have only
            # begun; the poll loop looks when they are due (on the H200 two polls a chunk of three
            # found nothing, this one among them). `_poll_once`, not `_poll`: this runs inside
            # `kick`, which holds ``_working``.
            if not (
                self._submit(self.scheduler.next_chunks(time.perf_counter()))
                and not self._paced_by_polls
                and self._poll_once()
            ):
                break
        else:
            # Bounded, so other connections get the loop between rounds; carry on next turn.
            assert self._loop is not None
            self._loop.call_soon(self.kick)
        self._wakeup()

    def cancel(self, request_id: int) -> bool:
        """Cancel at the next chunk boundary; True if it ended at once (nothing in flight)."""
        held = self.gates.take(request_id)
        if held is not None:
            self._on_finished(Finished(held, "cancelled", 0))
            return True
        try:
            f = self.scheduler.cancel(request_id, time.perf_counter())
        except NotFound:
            return False  # already cancelled, its last chunk is still in flight
        if f is None:
            return False
        self._on_finished(f)
        return True

    def drop_owner(self, owner: object) -> None:
        """End every request of ``owner`` (a connection that left); chunks in flight finish."""
        for held in self.gates.take_owner(owner):
            self._on_finished(Finished(held, "cancelled", 0))
        for f in self.scheduler.drop_owner(owner, time.perf_counter()):
            self._on_finished(f)

    # -- GPU-side ordering -----------------------------------------------------------------
    def hold(self, req: Request, event: IpcEvent, now: float) -> None:
        """Queue ``req`` once ``event`` (its client's wait_event) has completed: at once if it
        has, else from the poll loop (gates.py). ``req`` must have passed `Scheduler.check`.
        An event that fails to query fails this copy alone."""
        try:
            done = event.query()
        except PriodError as exc:
            self._on_finished(Finished(req, "failed", 0, error=exc))
            return
        if done:
            self._admit(req, now)
            self.kick()
            return
        self.gates.hold(req, event, now)
        self._wakeup()

    def _admit(self, req: Request, now: float) -> None:
        """Queue a request whose event completed; waiting for it earns no aging."""
        req.held_s = now - req.arrival
        req.arrival = now
        try:
            self.scheduler.enqueue(req, now)
        except PriodError as exc:  # a reload removed its class meanwhile, or took it away from this uid
            self._on_finished(Finished(req, "failed", 0, error=exc))

    def _poll_gates(self) -> float | None:
        """Poll the held copies that are due, queue those whose event completed; seconds until
        the next poll is due (None with nothing held)."""
        now = time.perf_counter()
        opened, failed = self.gates.poll(now)
        for req, exc in failed:
            if isinstance(exc, Cancelled):  # held past [limits] max_event_wait_s
                log.warning(
                    "wait_event_timed_out", request=req.id, owner=str(req.owner), held_s=round(now - req.arrival, 3)
                )
                self._on_finished(Finished(req, "cancelled", 0, error=exc))
            else:
                self._on_finished(Finished(req, "failed", 0, error=exc))
        for req in opened:
            self._admit(req, now)
        if opened:
            self.kick()
        due = self.gates.next_due()
        return None if due is None else max(0.0, due - now)

    def _signal(self, chunk: Chunk, event: IpcEvent) -> None:
        """Record a copy's signal_event behind its last chunk, just submitted (and behind any
        other chunk of it still in flight)."""
        req = chunk.request
        error: Exception | None = None
        try:
            self.engine.record_event(event, [e.completion for e in self._inflight if e.chunk.request is req])
        except PriodError as exc:
            log.warning("signal_event_failed", **error_fields(exc))
            error = exc
        if self._on_signalled is not None:
            self._on_signalled(req, error)

    # -- the engine side -------------------------------------------------------------------
    def _submit(self, chunks: list[Chunk]) -> bool:
        """Submit ``chunks`` to the engine; True if any was submitted."""
        for chunk in chunks:
            req = chunk.request
            target: CopyTarget = req.payload  # type: ignore[assignment]  # not typing.cast: a call per chunk
            last = chunk.offset + chunk.nbytes == req.nbytes
            landed = self._landed_word(chunk, target) if last and chunk.strict and self._stores_landed else None
            try:
                if req.segments is None:
                    job = ChunkJob(
                        req.lane,
                        chunk.path,
                        target.dst_mem,
                        target.src_mem,
                        dst_offset=target.dst_offset + chunk.offset,
                        src_offset=target.src_offset + chunk.offset,
                        nbytes=chunk.nbytes,
                        strict=chunk.strict,
                        gated=chunk.gated,
                    )
                else:
                    # A batch's chunk: the parts of its segments that bytes [offset, +nbytes) cover.
                    segments = req.segments
                    cells = segments.piece(chunk.offset, chunk.nbytes)
                    peaks = (
                        segments.peaks if cells is segments.cells else None
                    )  # the whole batch: found when it was read
                    job = ChunkJob(
                        req.lane,
                        chunk.path,
                        target.dst_mem,
                        target.src_mem,
                        cells=cells,
                        peaks=peaks,
                        strict=chunk.strict,
                        gated=chunk.gated,
                    )
                if landed is not None:
                    job.landed = landed.job(
                        req.first_submit or time.perf_counter(), req.arrival, chunk.path is Path.EXPRESS
                    )
                if chunk.strict and chunk.path is Path.DMA:
                    self._strict_dma_moved(req.lane)  # counted in flight: shut the gate before it goes
                completion = self.engine.submit(job)
                if landed is not None and job.landed is not None:
                    landed.handed()
            except PriodError as exc:
                log.error("submit_failed", **error_fields(exc))
                for f in self.scheduler.chunk_done(chunk, time.perf_counter(), exc):
                    self._on_finished(f)
                if chunk.strict and chunk.path is Path.DMA:
                    self._strict_dma_moved(req.lane)
                continue
            now = time.perf_counter()
            # Due times pace only a polled engine's poller (`next_poll_at`); sim wakes the loop.
            self._inflight.append(
                InFlight(chunk, completion, now, self._due(chunk, now) if self._paced_by_polls else now)
            )
            if last:
                signal = getattr(target, "signal_event", None)  # test payloads have none
                if signal is not None:
                    self._signal(chunk, signal)
        return bool(chunks)

    def _landed_word(self, chunk: Chunk, target: CopyTarget) -> LandedWord | None:
        """The landed word to store behind ``chunk``, the last of its copy, if the copy asked for
        one (a ring descriptor's `WANT_LANDED`) and stream order alone puts the store after every
        byte of it: no other chunk of the copy is still in flight on another stream."""
        landed: LandedWord | None = getattr(target, "landed", None)  # test payloads have none
        if landed is None:
            return None
        req, path = chunk.request, chunk.path
        for e in self._inflight:
            c = e.chunk
            if c.request is req and (c.path is not path or c.strict is not chunk.strict):
                return None  # the client waits for the completion instead
        return landed

    def _due(self, chunk: Chunk, now: float) -> float:
        """When the chunk just submitted should be done at the calibrated bandwidth.

        An express chunk runs at once; a lane's DMA chunks run one after another, so a DMA
        chunk starts when the one ahead of it should be done. `reanchor_dues` refines this as
        the chunks ahead complete. The poller sleeps until the earliest due time (a hint, not a
        promise).
        """
        lane = chunk.request.lane
        took = chunk.nbytes / self._bandwidth.get(lane, 1e9)
        if chunk.path is Path.EXPRESS:
            return now + took
        due = max(now, self._dma_tail.get(lane, 0.0)) + took
        self._dma_tail[lane] = due
        return due

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _poll(self) -> bool:
        """Query every chunk in flight once; True if any completed. A kick from inside (a
        finished copy's session queuing the next) waits for a later turn: see `kick`."""
        if self._working:
            return self._poll_once()
        self._working = True
        try:
            return self._poll_once()
        finally:
            self._working = False

    def _poll_once(self) -> bool:
        since, self._last_poll = self._last_poll, time.perf_counter()
        self.polls += 1
        still: list[InFlight] = []
        reanchor: set[LaneKey] = set()
        completed = False
        for entry in self._inflight:
            chunk, completion = entry.chunk, entry.completion
            error: Exception | None = None
            try:
                if not completion.done():
                    still.append(entry)
                    continue
            except PriodError as exc:
                error = exc
            completion.release()
            completed = True
            lane = chunk.request.lane
            if self._paced_by_polls and chunk.path is Path.DMA:
                reanchor.add(lane)
            if error is None:
                self.lane_bytes[lane] += chunk.nbytes
            for f in self.scheduler.chunk_done(chunk, time.perf_counter(), error):
                self._on_finished(f)
            if chunk.strict and chunk.path is Path.DMA:
                self._strict_dma_moved(lane)  # open it once the lane's last urgent DMA chunk is done
        self._inflight = still
        for lane in reanchor:
            waiting = [e for e in still if e.chunk.path is Path.DMA and e.chunk.request.lane == lane]
            reanchor_dues(waiting, since, self._bandwidth.get(lane, 1e9))
            self._dma_tail[lane] = waiting[-1].due if waiting else 0.0
        return completed

    async def run(self) -> None:
        """Find completions by polling; never block the loop, and sleep when polling is useless.

        - Nothing in flight: sleep until a submission wakes us (no CPU when idle), except while
          urgent copies are recent: then turn the loop, awake.
        - The engine wakes us on completions (sim): sleep until then, polling as a safety net.
        - A strict-class chunk in flight, or urgent copies recent (small bulk chunks): poll every
          loop turn.
        - Otherwise, with the next poll worth making (`next_poll_at`) 2 ms or more away: sleep
          until 1 ms before it (uvloop's timers are about 1 ms coarse). Sooner: ``[server] bulk_poll`` decides:
          "timer" sleeps until the chunk is due on a timerfd the loop watches (looptimer.py;
          sub-millisecond, no other thread), "spin" polls every loop turn (about one core).
        """
        loop = asyncio.get_running_loop()
        engine_wakes = not self._paced_by_polls
        while True:
            # Copies held for their client's event: the soonest poll due bounds every sleep below.
            gate_wait = self._poll_gates() if len(self.gates) else None
            if self._inflight and self._poll():
                self.kick()
                if not self._paced_by_polls:
                    continue  # sim: its threads may have finished more meanwhile
                # Polled (cuda): what was just handed out has only begun; wait for it as below
                # rather than poll again at once (that poll never found anything).
            if gate_wait == 0.0:
                await asyncio.sleep(0)  # a copy held for under GATE_SPIN_S: poll it every turn
                continue
            if self.holds.held and (self._inflight or self.scheduler.has_queued):
                # A client's direct copy holds bulk back: look again every turn, so bulk goes
                # on as soon as the copy is over (the client writes its end; nothing wakes us).
                # With no bulk about there is nothing to hold: bulk that comes scans the pages
                # before anything is handed out (`_kick`).
                await asyncio.sleep(0)
                self.kick()
                continue
            timeout: float | None = None  # None: no CPU at all until something wakes us
            spin_urgent = self.urgent_poll == "spin"
            if spin_urgent and not self._inflight and self.scheduler.urgent_requests_recent(time.perf_counter()):
                # Urgent copies are about: keep the loop awake (one core) so the next one is read
                # at once instead of after a wake-up from epoll, for urgent_window_ms. On both
                # engines: on the 2-vCPU VM (sim) that wake-up was 20 of a 64-byte copy's 81 us
                # round trip. Only with nothing in flight: on sim, chunks in flight run on the
                # engine's threads, and a loop turning beside them holds the GIL they need (under
                # bulk an urgent 64 KiB copy took 470-490 us p50 instead of 370-380); their
                # completion wakes the loop (below) within the window as outside it. Not for
                # clients' direct copies: they send nothing to read, and a loop spinning beside
                # them only takes a core (and the host's caches) from the clients.
                self.awake_turns += 1
                await asyncio.sleep(0)
                continue
            if self._inflight and engine_wakes:
                timeout = 0.05  # the wakeup is a hint; polling stays the source of truth
            elif self._inflight:
                now = time.perf_counter()
                # Poll every turn while an urgent chunk is in flight, and while a lane runs its
                # short bound: its small bulk chunks end every ~100 us, too often for a timer.
                # (Checked first: that loop turns thousands of times a second.)
                urgent = self.scheduler.strict_in_flight or self.scheduler.urgent_recent(now)
                wait: float | None = None  # `next_poll_at` walks every chunk in flight: once a turn
                if urgent and not spin_urgent and self._timer is not None:
                    # urgent_poll "timer": sleep until the next chunk is due; turn the loop only
                    # when that is within URGENT_SPIN_WITHIN_S (a timerfd wake-up costs about as
                    # much). A direct copy's hold rings its doorbell (`hold_rung`) instead of
                    # being found by a scan every turn.
                    wait = next_poll_at(self._inflight, self._bandwidth, now) - now
                    # An overdue bulk chunk (the estimate ran short) is looked at again on the
                    # timer, as outside the window; an urgent one every turn.
                    if wait <= URGENT_SPIN_WITHIN_S and (wait > 0 or self.scheduler.strict_in_flight):
                        self.urgent_spins += 1
                        await asyncio.sleep(0)
                        continue
                    # else: the timer below, as for bulk
                elif urgent:
                    if self.holds.pages:
                        # A direct copy announced now should close its lane's gate before the
                        # bulk chunk queued behind the running one begins (a chunk, ~75 us).
                        self.scan_holds()
                    await asyncio.sleep(0)  # one loop turn: other connections are served between polls
                    continue
                if wait is None:
                    wait = next_poll_at(self._inflight, self._bandwidth, now) - now
                if wait < 0.002 and self._timer is None:
                    await asyncio.sleep(0)  # bulk_poll "spin"
                    continue
                if wait >= 0.002:
                    timeout = wait - 0.001
                else:
                    assert self._timer is not None
                    self._timer.wake_at(time.perf_counter() + max(wait, TIMER_MIN_S))
            if self.urgent_poll == "timer" and not self._inflight:
                # A lane's urgent requests keep a steady beat (an inference step's): be awake
                # from `beat_spin_us` before its next burst is due until it comes, so the burst's
                # first copy is read on a loop turn, not after a wake-up from epoll. Only with
                # nothing in flight: with chunks in flight the loop wakes for their polls anyway,
                # and polling them every turn cost the urgent copy's GPU step 20 us p50 under
                # bulk (H100, `scripts/bench_gpu_steps.py`); on sim a loop turning would hold
                # the GIL the engine's threads need.
                now = time.perf_counter()
                watch = self.scheduler.beat_watch_at(now)
                if watch <= now:
                    self.beat_turns += 1
                    await asyncio.sleep(0)
                    continue
                if watch < math.inf:
                    if self._timer is not None:
                        self._timer.wake_at(watch)
                    elif timeout is None or watch - now < timeout:
                        timeout = watch - now
            if gate_wait is not None and (timeout is None or gate_wait < timeout):
                if gate_wait < 0.002 and self._timer is not None:
                    self._timer.wake_at(time.perf_counter() + max(gate_wait, TIMER_MIN_S))
                else:
                    timeout = gate_wait
            self._wake = loop.create_future()
            handle = loop.call_later(timeout, self._wakeup) if timeout is not None else None
            try:
                await self._wake
            finally:
                self._wake = None
                if handle is not None:
                    handle.cancel()

    async def settle(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for the chunks in flight to finish."""
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
