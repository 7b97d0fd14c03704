"""The poll loop on the sim engine while urgent copies are recent (`Pump.run`), with
``[server] urgent_poll = "spin"``.

For ``urgent_window_ms`` after an urgent copy the loop stays awake, turning instead of sleeping
in epoll, so the next urgent request is read at once; other connections are served between its
turns; with a chunk in flight on the engine's threads it sleeps until their wake-up (a turning
loop would hold the GIL those threads need); and once the window is over it sleeps with no
timeout at all: no CPU when idle. Asserted on the pump's own count of awake turns, not on times.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import numpy as np

import priod
from priod.daemon.config import load_config
from priod.daemon.engines.sim import SimEngine
from priod.daemon.server import Daemon

WINDOW_MS = 1000.0  # long, so that a slow machine still does all of the in-window part inside it
BULK_BYTES = 32 << 20  # 16 ms at the sim's 2 GB/s: chunks stay in flight on the engine's thread


async def test_loop_stays_awake_in_the_urgent_window_only_and_sleeps_after() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(
        server={"socket": path, "urgent_poll": "spin"}, tuning={"urgent_window_ms": WINDOW_MS}, log={"level": "warning"}
    )
    engine = SimEngine(cfg.sim)
    assert engine.wakes_on_completion  # the case this file is about
    daemon = Daemon(cfg, engine)
    await daemon.start()
    pump = daemon.pump
    try:
        async with priod.connect(path, copy_path="daemon") as c, priod.connect(path) as other:
            h, d = await c.alloc_host(BULK_BYTES), await c.alloc_device(BULK_BYTES)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(BULK_BYTES, dtype=np.uint32).astype(np.uint8)
            oh, od = await other.alloc_host(64), await other.alloc_device(64)

            # No urgent copy yet: a normal copy and an idle pause cost no awake turn.
            await c.copy(d, h, 64, priority="normal")
            await asyncio.sleep(0.02)
            assert pump.awake_turns == 0

            # An urgent copy opens the window: the loop turns while nothing happens...
            await c.copy(d, h, 64, priority="urgent")
            started = time.perf_counter()
            before = pump.awake_turns
            await asyncio.sleep(0.02)
            idle_turns = pump.awake_turns - before
            assert idle_turns > 0
            # ...and serves other connections between its turns.
            assert (await other.copy(od, oh, 64, priority="normal")).nbytes == 64
            assert pump.awake_turns > before + idle_turns

            # A bulk copy in flight on the engine's thread: the loop sleeps until the engine
            # wakes it, it does not turn beside the thread (generous bound: a few turns between
            # chunks against thousands while idle).
            before = pump.awake_turns
            r = await c.copy(d, h, priority="bulk")
            assert r.nbytes == BULK_BYTES and np.array_equal(d.array, h.array)
            assert time.perf_counter() - started < WINDOW_MS / 1e3, (
                "the machine was too slow to stay inside the window; rerun"
            )
            assert (pump.awake_turns - before) * 4 < idle_turns, (pump.awake_turns - before, idle_turns)

            # The window over, the loop sleeps with nothing to wake it: no turn, no timer.
            await asyncio.sleep(WINDOW_MS / 1e3 + 0.05)
            after_window = pump.awake_turns
            await asyncio.sleep(0.05)
            assert pump.awake_turns == after_window
            assert pump._wake is not None and not pump._wake.done()  # asleep in `run`
    finally:
        await daemon.stop()


async def test_direct_copies_with_no_bulk_about_leave_the_loop_asleep() -> None:
    """A client's direct copies give the daemon nothing to read, and nothing to hold back while no
    bulk is about: the loop does not turn for them (it would only take a core from the clients).
    Bulk that comes while one is announced still waits for it, and lands whole after."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    long_holds = {"urgent_window_ms": WINDOW_MS, "direct_hold_max_ms": 3000.0, "direct_hold_burst_ms": 10000.0}
    cfg = load_config(None, environ={}).replace(
        server={"socket": path, "urgent_poll": "spin"}, tuning=long_holds, log={"level": "warning"}
    )
    daemon = Daemon(cfg, SimEngine(cfg.sim))
    await daemon.start()
    pump = daemon.pump
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            page = await c.hold_page()
            slot = page.slot(page.lanes[0]["device_uuid"], "h2d")
            hs, ds = await c.alloc_host(64), await c.alloc_device(64)
            for _ in range(20):  # direct copies announced and ended, no bulk anywhere
                page.begin(slot)
                # A small copy the other way meanwhile: the daemon looks at the page (it does
                # before anything is handed out), so it sees the direct copy begin.
                await c.copy(hs, ds, 64, priority="normal")
                page.end(slot)
                await asyncio.sleep(0.002)
            assert pump.awake_turns == 0
            assert sum(pump.holds.copies.values()) >= 10  # it saw them (a scan can miss a begin-end pair)
            assert pump._wake is not None and not pump._wake.done()  # asleep in `run`

            h, d = await c.alloc_host(BULK_BYTES), await c.alloc_device(BULK_BYTES)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(BULK_BYTES, dtype=np.uint32).astype(np.uint8)
            page.begin(slot)
            bulk = asyncio.ensure_future(c.copy(d, h, priority="bulk"))
            await asyncio.sleep(0.1)  # 16 ms of bulk at the sim's 2 GB/s
            assert not bulk.done()
            page.end(slot)
            r = await asyncio.wait_for(bulk, 10)
            assert r.nbytes == BULK_BYTES and np.array_equal(d.array, h.array)
            page.close()
    finally:
        await daemon.stop()


async def test_the_loop_wakes_for_a_beats_next_burst_and_sleeps_once_it_has_passed() -> None:
    """``[server] urgent_poll = "timer"`` (the default): urgent copies every 10 ms through an
    idle daemon make a beat, and the loop turns awake around each next burst (``beat_spin_us``)
    rather than sleeping until the copy's doorbell wakes it; every copy lands. Once the copies
    stop, the watch for the burst that did not come passes and the loop sleeps; with
    ``beat_spin_us = 0`` it never turns for a beat at all."""
    turns = {}
    for spin_us in (200.0, 0.0):
        path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
        cfg = load_config(None, environ={}).replace(
            server={"socket": path}, tuning={"beat_spin_us": spin_us}, log={"level": "warning"}
        )
        daemon = Daemon(cfg, SimEngine(cfg.sim))
        await daemon.start()
        pump = daemon.pump
        try:
            async with priod.connect(path, copy_path="daemon") as c:
                h, d = await c.alloc_host(4096), await c.alloc_device(4096)
                assert h.array is not None and d.array is not None
                loop = asyncio.get_running_loop()
                start = loop.time()
                for i in range(40):
                    await asyncio.sleep(max(0.0, start + i * 0.01 - loop.time()))
                    h.array[:] = i + 1
                    r = await c.copy(d, h, priority="urgent")
                    assert r.nbytes == 4096 and np.array_equal(d.array, h.array)
                turns[spin_us] = pump.beat_turns
                await asyncio.sleep(0.05)  # the next burst's watch (10 ms on) comes and goes
                after = pump.beat_turns
                await asyncio.sleep(0.05)
                assert pump.beat_turns == after, "the loop kept turning after the beat stopped"
                assert pump._wake is not None and not pump._wake.done()  # asleep in `run`
        finally:
            await daemon.stop()
    assert turns[200.0] > 0 and turns[0.0] == 0, turns
