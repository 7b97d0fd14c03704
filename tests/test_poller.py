"""The poller on an engine that must be polled (as cuda is): ``[server] bulk_poll`` modes.

The sim engine normally wakes the daemon on every completion; here that is switched off, so
the daemon finds completions only by polling, as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np
import pytest

import priod
from priod.common.types import Direction, LaneKey, Path
from priod.daemon.config import load_config
from priod.daemon.engines.base import Completion
from priod.daemon.engines.sim import SimEngine
from priod.daemon.pump import BULK_POLL_MARGIN_S, InFlight, next_poll_at, reanchor_dues
from priod.daemon.sched.scheduler import Chunk, Request
from priod.daemon.server import Daemon
from priod.testing.fakes import ManualEngine

NBYTES = 64 << 20  # 32 chunks of ~1 MB at the sim's 2 GB/s: 32 ms of bulk


async def _copy_counting_polls(mode: str) -> int:
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path, "bulk_poll": mode}, log={"level": "warning"})
    engine = SimEngine(cfg.sim)
    engine.wakes_on_completion = False  # completions are found by polling only, as on a GPU
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            h, d = await c.alloc_host(NBYTES), await c.alloc_device(NBYTES)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(NBYTES, dtype=np.uint32).astype(np.uint8)
            r = await c.copy(d, h, priority="bulk")
            assert r.nbytes == NBYTES and np.array_equal(d.array, h.array)
            small = await c.copy(d, h, 4096, priority="urgent")  # urgent work is polled tightly in both modes
            assert small.nbytes == 4096
        polls = daemon.status()["polls"]
        assert isinstance(polls, int)
    finally:
        await daemon.stop()
    return polls


@pytest.mark.parametrize("mode", ["spin", "timer"])
async def test_polled_engine_completes_every_copy(mode: str) -> None:
    """With completions found by polling alone, bulk and urgent copies complete in both modes."""
    assert await _copy_counting_polls(mode) > 0


async def test_timer_mode_polls_far_less_than_spin() -> None:
    """While only bulk chunks are in flight, "timer" sleeps until a chunk is due instead of
    polling every loop turn: several times fewer polls for the same copy."""
    spin = await _copy_counting_polls("spin")
    timer = await _copy_counting_polls("timer")
    assert timer * 3 < spin, (timer, spin)


async def test_a_completion_found_costs_one_poll_not_three() -> None:
    """On a polled engine, the poll that finds a bulk chunk done is the only one in its turn:
    the chunk handed out in its place has only begun, so neither the hand-out nor the loop polls
    again at once. (Both did: three polls a chunk on the H200, two of which never found anything.)
    The engine here completes chunks only when told, and its lane is slow enough that no timer
    poll falls inside the test."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path, "bulk_poll": "timer"}, log={"level": "warning"})
    engine = ManualEngine(bandwidth=1e6, wakes_on_completion=False)  # 256 KiB chunks due ~0.25 s apart
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            n = 8 << 20
            h, d = await c.alloc_host(n), await c.alloc_device(n)
            handle = c.start_copy(d, h, n, priority="bulk")
            while len(engine.pending) < 2:
                await asyncio.sleep(0.001)
            for _ in range(3):
                submitted, polls = len(engine.submitted), daemon.pump.polls
                engine.complete(1)
                daemon.pump.kick()  # wakes the poll loop now rather than at the chunk's due time
                while len(engine.submitted) == submitted:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.01)
                assert daemon.pump.polls - polls == 1
            cancelling = asyncio.ensure_future(handle.cancel())
            while not cancelling.done():  # the chunks in flight finish first
                engine.complete_all()
                await asyncio.sleep(0.005)
    finally:
        await daemon.stop()


# -- due times (pure) -----------------------------------------------------------------------------
class _NeverDone(Completion):
    def done(self) -> bool:
        return False


LANE = LaneKey(0, Direction.H2D)


def _inflight(
    nbytes: int, submitted: float, due: float, *, offset: int = 0, of: int | None = None, path: Path = Path.DMA
) -> InFlight:
    """A chunk of ``nbytes`` at ``offset`` of a copy of ``of`` bytes (default: the whole copy)."""
    request = Request(1, "owner", LANE, "bulk", of if of is not None else nbytes, arrival=submitted)
    return InFlight(Chunk(request, offset, nbytes, path, strict=False), _NeverDone(), submitted, due)


def test_reanchor_counts_from_the_previous_poll_and_only_moves_earlier() -> None:
    """At 1 byte/s: the chunks behind a completed one are due one after another from the
    previous poll (or their own submission, if later); a due time already earlier stays."""
    a, b, c = _inflight(10, 0.0, 100.0), _inflight(10, 0.0, 25.0), _inflight(10, 40.0, 100.0)
    reanchor_dues([a, b, c], since=5.0, bandwidth=1.0)
    assert (a.due, b.due, c.due) == (15.0, 25.0, 50.0)


def _lane_model(
    reanchor: bool, late_s: float, *, chunks: int = 400, chunk_s: float = 500e-6, by_next_poll: bool = False
) -> tuple[float, float]:
    """A model of one DMA lane polled as the daemon polls it: chunks of one long copy run back
    to back in submission order, two in flight; the poller wakes at the earliest due time (or,
    ``by_next_poll``, at `next_poll_at`) plus a fixed lateness (timer and wake-up), and no sooner
    than 100 us after its last poll. Returns the lane's busy fraction and polls per chunk."""
    bw = 1.0 / chunk_s  # one byte per chunk
    inflight: list[tuple[InFlight, float]] = []  # entry, when the engine finishes it
    lane_free = now = last_poll = 0.0
    submitted = done = polls = 0

    def submit() -> None:
        nonlocal lane_free, submitted
        ahead = len(inflight) + 1
        finish = max(lane_free, now) + chunk_s
        lane_free = finish
        inflight.append((_inflight(1, now, now + ahead / bw, offset=submitted, of=chunks + 1), finish))
        submitted += 1

    while submitted < 2:
        submit()
    while done < chunks:
        entries = [e for e, _ in inflight]
        wake = next_poll_at(entries, {LANE: bw}, now) if by_next_poll else min(e.due for e in entries)
        now = max(wake, last_poll + 100e-6) + late_s
        since, last_poll = last_poll, now
        polls += 1
        finished = [x for x in inflight if x[1] <= now]
        if not finished:
            continue
        inflight[:] = [x for x in inflight if x[1] > now]
        done += len(finished)
        if reanchor:
            reanchor_dues([e for e, _ in inflight], since, bw)
        while len(inflight) < 2 and submitted < chunks:
            submit()
    return chunks * chunk_s / lane_free, polls / chunks


def _lane_busy_fraction(reanchor: bool, late_s: float) -> float:
    return _lane_model(reanchor, late_s)[0]


def test_late_wakeups_do_not_chain_into_an_idle_lane() -> None:
    """Each wake-up 200 us late (timer thread, GIL, self-pipe, loop turn): with due times
    re-estimated from the previous poll the lane stays busy; estimated only at submission, the
    lateness accumulates until the lane runs dry between chunks (the model loses 3%; the H200
    lost 4-5% of raw bandwidth that way)."""
    assert _lane_busy_fraction(reanchor=True, late_s=200e-6) > 0.99
    assert _lane_busy_fraction(reanchor=False, late_s=200e-6) < 0.98


def test_polls_wait_for_the_queued_work_not_each_due_time() -> None:
    """Polling when a lane's queued work nears its end (`next_poll_at`) instead of at each due
    time (lower bounds): the lane stays as busy, late wake-ups or not, with 1-1.6 polls a chunk
    where due times take 1.5-2.9 (the H200 made ~4 a chunk, 8,000 polls/s with bulk alone)."""
    for late_s in (20e-6, 200e-6):
        busy_due, polls_due = _lane_model(reanchor=True, late_s=late_s)
        busy, polls = _lane_model(reanchor=True, late_s=late_s, by_next_poll=True)
        assert busy > 0.99 and busy >= busy_due - 0.005, (late_s, busy, busy_due)
        assert polls < 1.6 and polls < polls_due - 0.4, (late_s, polls, polls_due)


def test_next_poll_at_looks_at_ends_of_copies_and_express_chunks_on_time() -> None:
    """At 1 byte/s: a lane's two bulk chunks are looked at when the work queued behind the oldest
    is within the margin of running out (not before the oldest is due); a chunk that ends its
    copy, or an express chunk, at its own due time; the soonest lane wins."""
    now = 100.0
    first, second = _inflight(10, now, now + 4, offset=0, of=100), _inflight(10, now, now + 14, offset=10, of=100)
    assert next_poll_at([first, second], {LANE: 1.0}, now) == now + 10 - BULK_POLL_MARGIN_S
    slow = _inflight(10, now, now + 12, offset=0, of=100)
    assert next_poll_at([slow, second], {LANE: 1.0}, now) == now + 12  # not before the oldest is due
    last = _inflight(10, now, now + 2, offset=90, of=100)  # behind the oldest, but a reply waits for it
    assert next_poll_at([first, second, last], {LANE: 1.0}, now) == now + 2
    express = _inflight(10, now, now + 1, offset=10, of=100, path=Path.EXPRESS)
    assert next_poll_at([first, second, express], {LANE: 1.0}, now) == now + 1
    assert next_poll_at([first], {LANE: 1.0}, now) == now + 4  # nothing queued behind: its due time


async def _urgent_beside_bulk(urgent_poll: str) -> dict[str, int]:
    """Urgent copies every 2 ms beside bulk on a polled engine: what the loop did meanwhile."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(
        server={"socket": path, "urgent_poll": urgent_poll}, log={"level": "warning"}
    )
    engine = SimEngine(cfg.sim)
    engine.wakes_on_completion = False  # found by polling only, as on a GPU
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            h, d = await c.alloc_host(NBYTES), await c.alloc_device(NBYTES)
            uh, ud = await c.alloc_host(65536), await c.alloc_device(65536)
            assert h.array is not None and d.array is not None and uh.array is not None and ud.array is not None
            h.array[:] = np.arange(NBYTES, dtype=np.uint32).astype(np.uint8)
            uh.array[:] = 9
            bulk = c.start_copy(d, h, priority="bulk")
            polls0, turns0 = daemon.pump.polls, daemon.pump.awake_turns
            while not bulk.done():
                assert (await c.copy(ud, uh, priority="urgent")).nbytes == 65536
                await asyncio.sleep(0.002)
            assert (await bulk).nbytes == NBYTES and np.array_equal(d.array, h.array)
            assert (ud.array == 9).all()
            return {
                "polls": daemon.pump.polls - polls0,
                "awake_turns": daemon.pump.awake_turns - turns0,
                "urgent_spins": daemon.pump.urgent_spins,
            }
    finally:
        await daemon.stop()


async def test_urgent_poll_timer_keeps_no_core_spinning_beside_bulk() -> None:
    """``[server] urgent_poll = "timer"``: while urgent copies come beside bulk, the loop sleeps
    until the next chunk is due instead of polling every turn: fewer than half the polls (its
    short bulk chunks still end every ~150 us), no awake turns, and every byte right (the GPU figures: docs/benchmarks.md, "Daemon CPU")."""
    spin = await _urgent_beside_bulk("spin")
    timer = await _urgent_beside_bulk("timer")
    assert timer["awake_turns"] == 0
    assert timer["polls"] * 2 < spin["polls"], (timer, spin)
