"""The poller's sub-millisecond wake-up on the event loop (a timerfd the loop watches)."""

from __future__ import annotations

import asyncio
import time

from priod.daemon.looptimer import LoopTimer


async def _woken_after(plan: list[float]) -> list[float]:
    """Arm a timer with each offset of ``plan`` in turn (seconds from now); when it woke, as
    offsets from the same start."""
    loop = asyncio.get_running_loop()
    woke: list[float] = []
    timer = LoopTimer(loop, lambda: woke.append(time.perf_counter()))
    try:
        start = time.perf_counter()
        for offset in plan:
            timer.wake_at(start + offset)
        await asyncio.sleep(max(plan) + 0.05)
    finally:
        timer.close()
    return [t - start for t in woke]


async def test_it_wakes_the_loop_at_the_time_asked_and_not_before() -> None:
    """Well under the loop's own 1 ms timer grain, once, and never early."""
    woke = await _woken_after([0.0003])
    assert len(woke) == 1
    assert 0.0003 <= woke[0] < 0.03, woke


async def test_the_earliest_time_asked_wins_and_it_fires_once() -> None:
    """A later time than the one armed is ignored (the poller re-plans when woken); an earlier
    one re-arms it."""
    woke = await _woken_after([0.02, 0.005, 0.01])
    assert len(woke) == 1
    assert 0.005 <= woke[0] < 0.015, woke


async def test_a_time_past_wakes_at_once_and_it_can_be_armed_again() -> None:
    loop = asyncio.get_running_loop()
    woke: list[float] = []
    timer = LoopTimer(loop, lambda: woke.append(time.perf_counter()))
    try:
        timer.wake_at(time.perf_counter() - 1.0)
        await asyncio.sleep(0.01)
        assert len(woke) == 1
        again = time.perf_counter() + 0.002
        timer.wake_at(again)
        await asyncio.sleep(0.03)
        assert len(woke) == 2 and woke[1] >= again
    finally:
        timer.close()
    timer.close()  # idempotent
