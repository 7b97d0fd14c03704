"""Urgent copies take the path that is faster now, and bulk shrinks its chunks while urgent
copies are about.

The co-tenant is the sim engine's model of another process computing on the GPU: express
chunks wait for its time slice, DMA does not (tests/test_sim_cotenant.py tests the model).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.cli import format_status
from priod.common.choice import PathChooser
from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.config import load_config
from priod.daemon.engines.sim import SimEngine
from priod.daemon.metrics import lane_labels
from priod.daemon.report import refresh_metrics
from priod.daemon.sched.policy import Policy
from priod.daemon.sched.scheduler import Chunk, Request, Scheduler
from priod.daemon.server import Daemon
from priod.errors import ConfigError

LANE = LaneKey(0, Direction.H2D)


# -- the chooser (pure) ---------------------------------------------------------------------------
def test_chooser_tries_both_then_keeps_the_faster_and_looks_again_later() -> None:
    c = PathChooser(explore_s=1.0, explore_every=1)  # explore_s alone
    assert c.choose(LANE, 65536, now=0.0) is Path.EXPRESS  # no figures yet: the calibrated default
    c.observe(LANE, Path.EXPRESS, 65536, 2e-3, now=0.0)
    assert c.choose(LANE, 65536, now=0.01) is Path.DMA  # the other path has no figure yet
    c.observe(LANE, Path.DMA, 65536, 1e-4, now=0.01)
    assert [c.choose(LANE, 65536, now=0.02 + i * 0.01) for i in range(5)] == [Path.DMA] * 5
    assert c.choose(LANE, 65536, now=1.5) is Path.EXPRESS  # express not tried for a second: once
    assert c.choose(LANE, 65536, now=1.51) is Path.DMA
    (est,) = c.estimates()
    assert (est.size_bytes, est.express_us, est.dma_us, est.choice) == (65536, 2000.0, 100.0, "dma")
    c.observe(LANE, Path.EXPRESS, 65536, 5e-5, now=1.6)  # express recovered: a stale figure is replaced
    assert c.choose(LANE, 65536, now=1.7) is Path.EXPRESS


def test_chooser_looks_again_only_after_explore_every_copies_too() -> None:
    """With ``explore_every`` the path not chosen is looked at once ``explore_s`` has passed *and*
    that many copies have taken the faster since the last look: a look costs its copy the slower
    path's time, which at a few copies per ``explore_s`` would reach their p99."""
    c = PathChooser(explore_s=1.0, explore_every=5)
    for path, latency in ((Path.EXPRESS, 2e-3), (Path.DMA, 1e-4)):  # each tried once, as at the start
        assert c.choose(LANE, 65536, now=0.0) is path
        c.observe(LANE, path, 65536, latency, now=0.0)
    # Two copies so far: a second passes, yet express waits for the fifth copy since its look.
    assert [c.choose(LANE, 65536, now=2.0 + i * 0.01) for i in range(6)] == [Path.DMA] * 3 + [Path.EXPRESS] + [
        Path.DMA
    ] * 2
    # Another second on, three copies since that look: two more go by DMA first.
    assert [c.choose(LANE, 65536, now=3.1 + i * 0.01) for i in range(4)] == [Path.DMA] * 2 + [Path.EXPRESS, Path.DMA]


def test_chooser_keeps_sizes_and_lanes_apart() -> None:
    c = PathChooser()
    c.observe(LANE, Path.EXPRESS, 65536, 1e-3, now=0.0)
    c.observe(LANE, Path.DMA, 65536, 1e-4, now=0.0)
    assert c.choose(LANE, 65536, now=0.0) is Path.DMA
    assert c.choose(LANE, 16 << 20, now=0.0) is Path.EXPRESS  # another size bucket: no figures
    assert c.choose(LaneKey(0, Direction.D2H), 65536, now=0.0) is Path.EXPRESS


def test_chooser_keeps_batches_apart_from_copies_of_their_size() -> None:
    """A batch's per-segment work makes its paths' times differ from a contiguous copy's
    (H200, beside a GEMM process: 16 MiB by DMA 0.6 ms as one copy, 2.2 as 256 segments): its
    figures must not decide for single copies, nor theirs for it."""
    c = PathChooser()
    for batch, dma in ((False, 6e-4), (True, 2.2e-3)):
        c.observe(LANE, Path.EXPRESS, 16 << 20, 2e-3, now=0.0, batch=batch)
        c.observe(LANE, Path.DMA, 16 << 20, dma, now=0.0, batch=batch)
    assert c.choose(LANE, 16 << 20, now=0.1) is Path.DMA
    assert c.choose(LANE, 16 << 20, now=0.1, batch=True) is Path.EXPRESS
    assert sorted((e.form, e.choice) for e in c.estimates()) == [("batch", "express"), ("copy", "dma")]


# -- the short bound (pure) -----------------------------------------------------------------------
def _bulk_chunks(s: Scheduler, i: int, now: float) -> list[int]:
    """The chunks a fresh bulk request gets at ``now`` (then cancelled: nothing stays in flight)."""
    s.enqueue(Request(i, "c", LANE, "bulk", 256 << 20, now), now)
    chunks = s.next_chunks(now)
    for c in chunks:
        s.chunk_done(c, now)
    s.cancel(i, now)
    return [c.nbytes for c in chunks]


def test_bulk_chunks_shrink_while_urgent_copies_are_recent() -> None:
    """Bulk runs long chunks until an urgent copy arrives on the lane, short ones for
    urgent_window_ms after it, and long ones again once the window has passed."""
    info = LaneInfo(LANE, bandwidth=55e9, express_min=4096, express_max=0)
    s = Scheduler(Policy(max_block_us=1000.0, urgent_block_us=150.0, urgent_window_ms=100.0), [info])
    long_chunk, short_chunk = s.lane_params(LANE).chunk_bytes, s.lane_params(LANE).urgent_chunk_bytes
    assert short_chunk * 5 < long_chunk
    assert _bulk_chunks(s, 1, 0.0) == [long_chunk, long_chunk]
    s.enqueue(Request(2, "c", LANE, "urgent", 65536, 1.0), 1.0)
    for c in s.next_chunks(1.0):
        s.chunk_done(c, 1.0001)
    assert s.urgent_recent(1.05)
    assert _bulk_chunks(s, 3, 1.05) == [short_chunk, short_chunk]
    assert not s.urgent_recent(1.2)
    assert _bulk_chunks(s, 4, 1.2) == [long_chunk, long_chunk]


# -- long chunks between the bursts of a steady urgent beat (pure) -------------------------------
def _beat_scheduler(beat_block_us: float) -> Scheduler:
    info = LaneInfo(LANE, bandwidth=55e9, express_min=4096, express_max=0)
    return Scheduler(
        Policy(max_block_us=1000.0, urgent_block_us=150.0, urgent_window_ms=100.0, beat_block_us=beat_block_us), [info]
    )


def _urgent_burst(s: Scheduler, ids: Iterator[int], at: float, copies: int = 2) -> float:
    """``copies`` urgent copies 50 us apart from ``at``, each done at once; when the last came."""
    now = at
    for k in range(copies):
        now = at + k * 50e-6
        s.enqueue(Request(next(ids), "u", LANE, "urgent", 65536, now), now)
        for c in s.next_chunks(now):
            s.chunk_done(c, now)
    return now


def test_a_steady_urgent_beat_gives_bulk_long_chunks_between_its_bursts() -> None:
    """Bursts of urgent copies every 5 ms: once four gaps are known, bulk runs the beat bound
    from 300 us after a burst until the beat bound plus 450 us before the next is due, and the
    short bound around the bursts; `status` shows the beat."""
    s = _beat_scheduler(600.0)
    p = s.lane_params(LANE)
    short, beat = p.urgent_chunk_bytes, p.beat_chunk_bytes
    assert short * 3 < beat < p.chunk_bytes  # 150 / 600 / 1000 us
    ids = itertools.count(100)
    for k in range(4):  # three gaps: not yet a beat
        _urgent_burst(s, ids, k * 5e-3)
        assert _bulk_chunks(s, next(ids), k * 5e-3 + 2e-3) == [short, short]
    last = _urgent_burst(s, ids, 20e-3)  # the fourth gap
    assert _bulk_chunks(s, next(ids), last + 100e-6) == [short, short]  # the burst may go on
    assert _bulk_chunks(s, next(ids), last + 400e-6) == [beat, beat]
    assert _bulk_chunks(s, next(ids), 20e-3 + 3.9e-3) == [beat, beat]  # 5 ms - 1.05 ms = 3.95 ms
    assert _bulk_chunks(s, next(ids), 20e-3 + 4.0e-3) == [short, short]  # the next burst is near
    assert s.statistics().lanes[0].beat_us == pytest.approx(5000.0)


def test_an_early_burst_turns_the_long_chunks_off_until_the_beat_is_steady_again() -> None:
    """A burst 1.5 ms after the one before: the shortest of the last four gaps is then 1.5 ms,
    which leaves no millisecond for long chunks, so the short bound holds until that gap has
    aged out of the last four."""
    s = _beat_scheduler(600.0)
    short, beat = s.lane_params(LANE).urgent_chunk_bytes, s.lane_params(LANE).beat_chunk_bytes
    ids = itertools.count(100)
    for k in range(5):
        _urgent_burst(s, ids, k * 5e-3)
    assert _bulk_chunks(s, next(ids), 22e-3) == [beat, beat]
    _urgent_burst(s, ids, 21.5e-3)  # early
    assert _bulk_chunks(s, next(ids), 22.5e-3) == [short, short]
    at = 21.5e-3
    for _ in range(3):  # three steady gaps more: the 1.5-ms one is still among the last four
        at += 5e-3
        _urgent_burst(s, ids, at)
        assert _bulk_chunks(s, next(ids), at + 2e-3) == [short, short]
    at += 5e-3
    _urgent_burst(s, ids, at)
    assert _bulk_chunks(s, next(ids), at + 2e-3) == [beat, beat]


def test_the_beat_is_the_lanes_so_another_uids_copy_off_it_turns_the_long_chunks_off() -> None:
    """Two uids on one lane: uid 1000's urgent copies keep a 5-ms beat, and bulk runs long chunks
    between them. uid 2000's one urgent copy off that beat is served first like any urgent copy,
    and makes the gap the lane goes by 1.5 ms: the short bound holds from then on, so uid 1000's
    beat cannot keep long chunks ahead of uid 2000's next copies (docs/operations.md)."""
    s = _beat_scheduler(600.0)
    p = s.lane_params(LANE)
    ids = itertools.count(100)

    def urgent(uid: int, at: float) -> list[Chunk]:
        """One urgent copy of ``uid`` at ``at``: the chunks handed out then, each done at once."""
        s.enqueue(Request(next(ids), f"conn{uid}", LANE, "urgent", 65536, at, uid=uid), at)
        chunks = s.next_chunks(at)
        for c in chunks:
            s.chunk_done(c, at)
        return chunks

    for k in range(5):
        urgent(1000, k * 5e-3)
    assert _bulk_chunks(s, next(ids), 21e-3) == [p.beat_chunk_bytes] * 2
    served = urgent(2000, 21.5e-3)
    assert served and served[0].request.uid == 2000 and served[0].strict  # first, as any urgent copy
    for at in (22.5e-3, 24e-3):  # before and where uid 1000's next copy is due
        assert _bulk_chunks(s, next(ids), at) == [p.urgent_chunk_bytes] * 2
    assert s.statistics().lanes[0].beat_us is None  # 1.5 and 5 ms: no steady beat


def _arrivals_during_long_chunks(gaps: list[float]) -> tuple[int, int]:
    """Urgent copies with these gaps between them: how many came while bulk was handed long
    chunks (each such copy waits for the one running), and of how many."""
    s = _beat_scheduler(600.0)
    beat = s.lane_params(LANE).beat_chunk_bytes
    ids = itertools.count(100)
    at, hits = 0.0, 0
    for gap in gaps:
        at += gap
        hits += _bulk_chunks(s, next(ids), at - 1e-6) == [beat, beat]
        _urgent_burst(s, ids, at, copies=1)
    return hits, len(gaps)


def test_copies_at_random_times_rarely_find_long_chunks_running() -> None:
    """Exponential gaps (mean 5 and 10 ms) now and then leave four gaps long enough for long
    chunks, and the next copy then comes early. The beat needs its gaps steady (`BEAT_STEADY`):
    without that rule 8-17% of such copies met a long chunk; with it, under 2%."""
    rnd = random.Random(7)
    for mean in (5e-3, 10e-3):
        hits, n = _arrivals_during_long_chunks([rnd.expovariate(1 / mean) for _ in range(600)])
        assert hits < 0.02 * n, (mean, hits)


def test_a_jittered_beat_keeps_its_long_chunks_and_a_wandering_one_gets_none() -> None:
    """5 ms +- 0.3 ms between copies is a beat: bulk runs long chunks between them, and no copy
    meets one (the chunks stop 750 us before the shortest recent gap has passed). At +- 1 ms a
    copy now and then comes that early. Gaps alternating 2.5 and 5.5 ms are no beat: the short
    bound throughout."""
    rnd = random.Random(3)
    jittered = [5e-3 + rnd.uniform(-0.3e-3, 0.3e-3) for _ in range(200)]
    assert _arrivals_during_long_chunks(jittered) == (0, 200)
    hits, n = _arrivals_during_long_chunks([5e-3 + rnd.uniform(-1e-3, 1e-3) for _ in range(400)])
    assert hits <= 0.03 * n, hits
    s = _beat_scheduler(600.0)
    p = s.lane_params(LANE)
    ids = itertools.count(100)
    at = 0.0
    for gap in jittered[:8]:
        at += gap
        _urgent_burst(s, ids, at, copies=1)
    assert _bulk_chunks(s, next(ids), at + 1e-3) == [p.beat_chunk_bytes] * 2
    s = _beat_scheduler(600.0)
    at = 0.0
    for k in range(12):
        at += 2.5e-3 if k % 2 else 5.5e-3
        _urgent_burst(s, ids, at, copies=1)
        assert _bulk_chunks(s, next(ids), at + 1e-3) == [p.urgent_chunk_bytes] * 2
    assert s.statistics().lanes[0].beat_us is None


def test_a_reload_that_sets_beat_block_us_to_0_stops_the_long_chunks_at_once() -> None:
    """A steady beat runs long chunks; a reload (SIGHUP) with ``beat_block_us = 0`` puts the
    lane back on the short bound between the same bursts, and forgets the beat."""
    s = _beat_scheduler(600.0)
    p = s.lane_params(LANE)
    ids = itertools.count(100)
    for k in range(6):
        _urgent_burst(s, ids, k * 5e-3)
    assert _bulk_chunks(s, next(ids), 25e-3 + 2e-3) == [p.beat_chunk_bytes] * 2
    s.set_policy(Policy(max_block_us=1000.0, urgent_block_us=150.0, urgent_window_ms=100.0, beat_block_us=0.0))
    assert _bulk_chunks(s, next(ids), 25e-3 + 2.5e-3) == [p.urgent_chunk_bytes] * 2
    for k in range(6, 12):
        _urgent_burst(s, ids, k * 5e-3)
        assert _bulk_chunks(s, next(ids), k * 5e-3 + 2e-3) == [p.urgent_chunk_bytes] * 2
    assert s.statistics().lanes[0].beat_us is None


def test_without_beat_block_us_the_short_bound_holds_throughout_the_window() -> None:
    s = _beat_scheduler(0.0)
    short = s.lane_params(LANE).urgent_chunk_bytes
    ids = itertools.count(100)
    for k in range(8):
        _urgent_burst(s, ids, k * 5e-3)
        assert _bulk_chunks(s, next(ids), k * 5e-3 + 2e-3) == [short, short]
    assert s.statistics().lanes[0].beat_us is None


def test_the_loop_watches_for_a_beats_next_burst_from_beat_spin_us_before_it_is_due() -> None:
    """Bursts of urgent requests every 5 ms: once four gaps are known, the scheduler asks the
    loop to be awake from 200 us (``beat_spin_us``) before the next burst is due until 200 us
    and the gaps' spread after; a burst that comes moves the watch a beat on, and one that does
    not come ends it (the loop sleeps again)."""
    s = _beat_scheduler(600.0)
    ids = itertools.count(100)
    assert s.beat_watch_at(0.0) == float("inf")
    for k in range(4):
        _urgent_burst(s, ids, k * 5e-3)
        assert s.beat_watch_at(k * 5e-3 + 1e-3) == float("inf"), "three gaps are no beat yet"
    _urgent_burst(s, ids, 20e-3)
    assert s.beat_watch_at(21e-3) == pytest.approx(25e-3 - 200e-6)
    assert s.beat_watch_at(24.9e-3) <= 24.9e-3, "awake 100 us before the burst is due"
    assert s.beat_watch_at(25.1e-3) <= 25.1e-3, "and a little after it"
    assert s.beat_watch_at(25.3e-3) == float("inf"), "the burst did not come: asleep again"
    _urgent_burst(s, ids, 25.25e-3)
    assert s.beat_watch_at(26e-3) == pytest.approx(30.25e-3 - 200e-6, abs=1e-9)


def test_only_urgent_requests_make_the_loop_watch_and_beat_spin_us_0_turns_it_off() -> None:
    """Clients' direct copies on a beat give bulk its long chunks but never keep the loop awake
    (they ring their doorbell, and a turning loop takes a core from them); with
    ``beat_spin_us = 0`` a beat of requests does not either, nor does a beat under 1 ms."""
    s = _beat_scheduler(600.0)
    for k in range(6):
        s.set_holds(frozenset(), frozenset({LANE}), k * 5e-3)
    assert s.statistics().lanes[0].beat_us == pytest.approx(5000.0)
    assert all(s.beat_watch_at(25e-3 + dt) == float("inf") for dt in (-1e-3, -100e-6, 0.0, 100e-6))
    info = LaneInfo(LANE, bandwidth=55e9, express_min=4096, express_max=0)
    off = Scheduler(Policy(urgent_block_us=150.0, beat_block_us=600.0, beat_spin_us=0.0), [info])
    ids = itertools.count(100)
    for k in range(6):
        _urgent_burst(off, ids, k * 5e-3)
    assert off.statistics().lanes[0].beat_us == pytest.approx(5000.0)
    assert off.beat_watch_at(30e-3 - 100e-6) == float("inf")
    fast = _beat_scheduler(600.0)  # a beat under 1 ms (BEAT_MIN_S) would keep the loop turning most of the time
    for k in range(6):
        _urgent_burst(fast, ids, k * 600e-6, copies=1)
    assert fast.statistics().lanes[0].beat_us == pytest.approx(600.0)
    assert fast.beat_watch_at(6 * 600e-6 - 100e-6) == float("inf")


# -- the daemon reacting to a co-tenant -----------------------------------------------------------
async def _urgent_paths(daemon: Daemon, c: Any, dev: Any, host: Any, n: int) -> list[str]:
    paths = []
    for i in range(n):
        host.array[:4096] = i % 251
        r = await c.copy(dev, host, 4096 * 4, priority="urgent")
        assert int(dev.array[0]) == i % 251, "urgent bytes did not land"
        paths.append(r.path)
    return paths


async def test_urgent_copies_leave_a_stalled_express_path_and_come_back() -> None:
    """Urgent copies under bulk on the same lane. A co-tenant starts computing (express chunks
    wait 20-40 ms): within a few copies the daemon sends urgent copies by DMA. It stops: after
    explore_ms, and explore_every copies by DMA, the daemon looks at express again and its figure
    is fresh. Every byte is checked."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(
        server={"socket": path},
        tuning={"explore_ms": 1000.0, "explore_every": 4},
        sim={"express_min_bytes": 4096},
        log={"level": "warning"},
    )
    engine = SimEngine(cfg.sim)
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            host, dev = await c.alloc_host(1 << 20), await c.alloc_device(1 << 20)
            bulk_host, bulk_dev = await c.alloc_host(64 << 20), await c.alloc_device(64 << 20)
            assert host.array is not None and dev.array is not None
            stop = False

            async def stream() -> None:
                while not stop:
                    await c.copy(bulk_dev, bulk_host, priority="bulk")

            streamer = asyncio.ensure_future(stream())
            await asyncio.sleep(0.05)
            calm = await _urgent_paths(daemon, c, dev, host, 6)
            engine.set_cotenant_stall(40_000)
            busy = await _urgent_paths(daemon, c, dev, host, 12)
            engine.set_cotenant_stall(0)
            # Past explore_ms: the next copy looks at express again. (1 s, longer than the busy
            # phase's copies take even on a loaded 2-core VM: with 300 ms, a slow busy phase
            # could look at express again within its last four copies.)
            await asyncio.sleep(1.1)
            after = await _urgent_paths(daemon, c, dev, host, 6)
            status = await c.status()
            stop = True
            await streamer
    finally:
        await daemon.stop()
    assert calm[0] == "express", calm
    assert busy[-4:] == ["dma"] * 4, busy  # at most a few slow copies before the switch
    assert "express" in after, after  # looked at again once explore_ms had passed
    est = next(e for e in status["urgent_paths"] if e["lane"] == "gpu0/h2d" and e["size_bytes"] == 16384)
    assert est["express_us"] < 10_000, est  # the stalled figure (20-40 ms) was replaced, not averaged in
    assert est["express_chosen"] >= 2 and est["dma_chosen"] >= 4


def test_short_bound_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"^\[tuning\] urgent_block_us = -1.0 is invalid"):
        load_config(None, environ={"PRIOD_TUNING__URGENT_BLOCK_US": "-1.0"})
    with pytest.raises(ConfigError, match=r"^\[tuning\] explore_ms = 0.0 is invalid"):
        load_config(None, environ={"PRIOD_TUNING__EXPLORE_MS": "0.0"})
    with pytest.raises(ConfigError, match=r"^\[tuning\] explore_every = 0 is invalid; set a whole number >= 1"):
        load_config(None, environ={"PRIOD_TUNING__EXPLORE_EVERY": "0"})
    for bad in ("-1.0", "6000.0", "nan"):
        with pytest.raises(
            ConfigError, match=r"^\[tuning\] beat_spin_us = .* is invalid; set 0 <= beat_spin_us <= 5000"
        ):
            load_config(None, environ={"PRIOD_TUNING__BEAT_SPIN_US": bad})
    assert np.isfinite(load_config(None, environ={}).tuning.urgent_block_us)


async def test_a_daemon_learns_the_beat_of_urgent_copies_and_every_byte_lands() -> None:
    """The sim daemon with ``beat_block_us`` set, a bulk stream and an urgent copy every 10 ms:
    `status` and the metric show the lane's beat once four steady gaps are known (within 30
    copies, a loaded machine's late wake-ups allowed for), and every urgent and bulk byte lands
    (the long chunks between bursts are chunks like any other)."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(
        server={"socket": path}, tuning={"beat_block_us": 2000.0, "urgent_block_us": 500.0}, log={"level": "warning"}
    )
    daemon = Daemon(cfg, SimEngine(cfg.sim))
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            host, dev = await c.alloc_host(1 << 20), await c.alloc_device(1 << 20)
            bulk_host, bulk_dev = await c.alloc_host(16 << 20), await c.alloc_device(16 << 20)
            assert (
                host.array is not None
                and dev.array is not None
                and bulk_host.array is not None
                and bulk_dev.array is not None
            )
            bulk_host.array[:] = np.arange(16 << 20, dtype=np.uint64).astype(np.uint8)
            stop = False

            async def stream() -> int:
                n = 0
                while not stop:
                    await c.copy(bulk_dev, bulk_host, priority="bulk")
                    n += 1
                return n

            streamer = asyncio.ensure_future(stream())
            loop = asyncio.get_running_loop()
            for i in range(30):
                t0 = loop.time()
                host.array[:4096] = i + 1
                await c.copy(dev, host, 65536, priority="urgent")
                assert int(dev.array[0]) == i + 1, "urgent bytes did not land"
                status = await c.status()
                if i >= 5 and any(ln["urgent_beat_us"] for ln in status["lanes"]):
                    break
                await asyncio.sleep(max(0.0, t0 + 0.01 - loop.time()))
            refresh_metrics(daemon)
            gpu, uuid, direction = lane_labels(LaneKey(0, Direction.H2D), daemon.metrics.gpu_names)
            beat_metric = daemon.metrics.registry.get_sample_value(
                "priod_urgent_beat_seconds", {"gpu": gpu, "UUID": uuid, "direction": direction}
            )
            stop = True
            bulk_copies = await streamer
    finally:
        await daemon.stop()
    lane = next(ln for ln in status["lanes"] if ln["lane"] == "gpu0/h2d")
    assert beat_metric == pytest.approx(lane["urgent_beat_us"] / 1e6, rel=0.01), beat_metric
    assert lane["beat_chunk_bytes"] > lane["urgent_chunk_bytes"]
    assert lane["urgent_beat_us"] is not None and 5_000 < lane["urgent_beat_us"] < 20_000, lane
    assert f"(urgent beat {lane['urgent_beat_us'] / 1e3:.1f} ms)" in format_status(status)
    assert bulk_copies >= 1 and np.array_equal(bulk_dev.array, bulk_host.array)
