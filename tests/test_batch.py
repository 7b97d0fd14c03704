"""Batched copies (copy_batch): the segment table's checks, its chunking, and the whole path on
the sim engine with every byte verified; cancels in whole segments, urgent batches passing bulk
ones, timeouts, hostile tables; SyncClient's start/poll/cancel."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

import priod
from priod.common.types import Direction, LaneInfo, LaneKey
from priod.daemon.config import load_config
from priod.daemon.engines.base import ChunkJob, Completion
from priod.daemon.engines.sim import SimEngine, SimSettings
from priod.daemon.engines.sim_model import gather_segments
from priod.daemon.sched.policy import Policy
from priod.daemon.sched.scheduler import Request, Scheduler
from priod.daemon.server import Daemon
from priod.errors import Cancelled, CopyTimeout, EngineError, InvalidRequest, LimitExceeded
from priod.testing import DaemonProcess, daemon_process
from priod.wire.batch import MAX_SEGMENTS, SEGMENT_BYTES, SEGMENT_COST_S, URGENT_DMA_SEGMENTS, Segments, encode_segments

BLOCK = 16 << 10


def scattered(n: int, block: int, slots: int, seed: int) -> npt.NDArray[np.int64]:
    """``n`` blocks from distinct random slots to distinct random slots (both of ``slots`` blocks)."""
    rng = np.random.default_rng(seed)
    dst = rng.choice(slots, n, replace=False) * block
    src = rng.choice(slots, n, replace=False) * block
    return np.stack([dst, src, np.full(n, block)], axis=1).astype(np.int64)


def expect(
    dst: npt.NDArray[np.uint8],
    before: npt.NDArray[np.uint8],
    src: npt.NDArray[np.uint8],
    segs: npt.NDArray[np.int64],
    upto: int | None = None,
) -> None:
    """``dst`` holds ``before`` except where the first ``upto`` segments put ``src``'s bytes."""
    want = before.copy()
    for d, s, n in segs[:upto]:
        want[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, want)


# -- the table on its own -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", r"^segments is empty; a batch holds at least one segment$"),
        (bytes(25), r"^segments holds 25 bytes, not a multiple of 24"),
        (
            np.array([[0, 0, 8], [8, 8, 0]], "<u8").tobytes(),
            r"^segment 1 has nbytes = 0; every segment copies at least 1 byte$",
        ),
        (np.array([[1 << 63, 0, 8]], "<u8").tobytes(), r"^a segment's offset or size is 2\*\*62 or more"),
        (
            bytes(SEGMENT_BYTES * (MAX_SEGMENTS + 1)),
            rf"^{MAX_SEGMENTS + 1} segments exceed the {MAX_SEGMENTS} one batch may hold; split them",
        ),
    ],
    ids=["empty", "ragged", "zero-size", "huge-offset", "too-many"],
)
def test_malformed_tables_are_refused_naming_the_fix(raw: bytes, match: str) -> None:
    """Every malformed table is refused at decode with a message that says what to send instead."""
    with pytest.raises(InvalidRequest, match=match):
        Segments.decode(raw)


def test_bounds_and_overlaps_are_checked_as_a_unit() -> None:
    """Out of bounds, two destinations over one byte, and a destination over a source of the
    same memory are each refused; touching (not overlapping) ranges pass."""
    ok = Segments.decode(encode_segments([(0, 64, 64), (64, 128, 64), (1000, 0, 24)]))
    ok.check_regions(1024, 1024, None, 1, 2)
    assert ok.total == 152 and len(ok) == 3
    with pytest.raises(
        InvalidRequest, match=r"^segment 2: dst_offset 1000 \+ nbytes 24 is outside region 1 of 1016 bytes"
    ):
        ok.check_regions(1016, 1024, None, 1, 2)
    with pytest.raises(
        InvalidRequest, match=r"^segment 1: src_offset 128 \+ nbytes 64 is outside region 2 of 191 bytes"
    ):
        ok.check_regions(1024, 191, None, 1, 2)
    two_writes = Segments.decode(encode_segments([(0, 0, 64), (500, 0, 8), (63, 0, 2)]))
    with pytest.raises(InvalidRequest, match=r"^destination segments 0 and 2 overlap"):
        two_writes.check_regions(1024, 1024, None, 1, 2)
    # One region: segment 1 reads bytes [100, 164) that segment 0 writes ([64, 128)).
    self_overlap = Segments.decode(encode_segments([(64, 512, 64), (256, 100, 64)]))
    self_overlap.check_regions(1024, 1024, None, 1, 2)  # two memories: fine
    with pytest.raises(InvalidRequest, match=r"^source segment 1 overlaps destination segment 0 in the same memory"):
        self_overlap.check_regions(1024, 1024, 0, 1, 1)
    # The same ranges in two views of one allocation 36 bytes apart: source 1 now reads [136, 200).
    self_overlap.check_regions(1024, 1024, 36, 1, 2)
    with pytest.raises(InvalidRequest, match=r"^source segment 0 overlaps destination segment 1"):
        Segments.decode(encode_segments([(0, 200, 64), (256, 0, 64)])).check_regions(1024, 1024, 100, 1, 2)
    Segments.decode(encode_segments([(0, 64, 64), (128, 192, 64)])).check_regions(
        1024, 1024, 0, 1, 1
    )  # interleaved, touching


def test_destination_overlap_check_agrees_with_brute_force_for_blocks_of_one_size() -> None:
    """Two memories (no source to compare): tables of blocks of one size take the sort-only
    check, others the full one; each refuses exactly the tables whose destinations a byte map
    says overlap. Blocks of one size also give the total without a sum."""
    rng = np.random.default_rng(11)
    refused = {True: 0, False: 0}
    for i in range(600):
        n = int(rng.integers(1, 8))
        uniform = i % 2 == 0
        sizes = np.full(n, int(rng.integers(1, 24))) if uniform else rng.integers(1, 24, n)
        segs = np.stack([rng.integers(0, 200, n), rng.integers(0, 200, n), sizes], axis=1)
        writes = np.zeros(256, np.int64)
        for d, _, k in segs:
            writes[d : d + k] += 1
        table = Segments.decode(encode_segments(segs))
        assert (table.smallest == table.peaks[2]) == (uniform or len(set(sizes.tolist())) == 1)
        assert table.total == int(sizes.sum())
        try:
            table.check_regions(256, 256, None, 1, 2)
        except InvalidRequest as exc:
            refused[uniform] += 1
            assert (writes > 1).any() and "destination segments" in str(exc), segs
        else:
            assert not (writes > 1).any(), segs
    assert all(30 < r < 270 for r in refused.values()), refused  # both outcomes, both kinds of table


def test_cumulative_sizes_wait_until_a_chunk_needs_them() -> None:
    """A batch taken whole (an express batch, or one chunk) and finished never builds its
    cumulative sizes; a partial count or a cut of part of it does, and they are right."""
    table = Segments.decode(encode_segments([(0, 64, 64), (64, 128, 32), (1000, 0, 24)]))
    table.check_regions(1024, 1024, None, 1, 2)
    assert table.cut(0, 1 << 20, 0) == 120 and table.piece(0, 120) is table.cells
    assert table.segments_done(120) == 3
    assert table._ends is None
    assert table.segments_done(100) == 2 and table.ends.tolist() == [64, 96, 120]


def test_overlap_check_agrees_with_brute_force() -> None:
    """On random small tables, the sort-based check refuses exactly the tables a byte map says overlap."""
    rng = np.random.default_rng(7)
    refused = 0
    for _ in range(400):
        n = int(rng.integers(1, 6))
        segs = np.stack([rng.integers(0, 200, n), rng.integers(0, 200, n), rng.integers(1, 20, n)], axis=1)
        writes = np.zeros(256, np.int64)
        reads = np.zeros(256, bool)
        for d, s, k in segs:
            writes[d : d + k] += 1
            reads[s : s + k] = True
        clash = bool((writes > 1).any() or ((writes > 0) & reads).any())
        try:
            Segments.decode(encode_segments(segs)).check_regions(256, 256, 0, 1, 1)
        except InvalidRequest:
            refused += 1
            assert clash, segs
        else:
            assert not clash, segs
    assert 50 < refused < 350  # both outcomes were exercised


def test_chunks_cover_every_segment_byte_exactly_once() -> None:
    """Cutting a table into chunks of random cost and reading back their pieces gives every
    segment's bytes once, in order; a chunk's bytes plus its segments' cost stay within its size
    unless it is the rest of one segment."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        sizes = rng.integers(1, 5000, n)
        gaps = np.arange(n) * 11  # segments never touch, so glued pieces give back each one
        segs = np.stack([np.cumsum(sizes) - sizes + gaps + 7, np.cumsum(sizes) - sizes + gaps + 3, sizes], axis=1)
        table = Segments.decode(encode_segments(segs))
        cost = int(rng.integers(0, 3000))
        got: list[tuple[int, int, int]] = []
        offset = 0
        while offset < table.total:
            size = int(rng.integers(1, 20000))
            nbytes = table.cut(offset, size, cost)
            assert 1 <= nbytes <= min(size, table.total - offset)
            rows = table.piece(offset, nbytes)
            k = rows[:, 2]
            assert rows.shape == (len(k), 3) and int(k.sum()) == nbytes and (k > 0).all()
            assert nbytes + cost * len(k) <= size or len(k) == 1
            got.extend(map(tuple, rows.tolist()))
            offset += nbytes
        # Glue the pieces back together and compare with the table, byte range by byte range.
        merged: list[list[int]] = []
        for pd, ps, pk in got:
            if merged and merged[-1][0] + merged[-1][2] == pd and merged[-1][1] + merged[-1][2] == ps:
                merged[-1][2] += pk
            else:
                merged.append([pd, ps, pk])
        assert merged == segs.tolist()
        assert table.segments_done(table.total) == n and table.segments_done(0) == 0
        assert table.segments_done(int(sizes[0])) == 1 and table.segments_done(int(sizes[0]) - 1) == 0


def test_a_whole_batch_is_one_piece_of_its_own_rows() -> None:
    """An express batch goes out whole: its cut is every byte and its piece the wire table
    itself (no copy, rows as the copy kernel reads them); a part gets a copy, never a view
    that trimming would write through."""
    segs = scattered(300, 64, 1024, seed=5)
    table = Segments.decode(encode_segments(segs))
    assert table.cut(0, 1 << 40, 0) == table.total == 300 * 64
    assert table.cut(0, 1000, 0) == 1000
    whole = table.piece(0, table.total)
    assert whole is table.cells and whole.flags.c_contiguous and whole.tolist() == segs.tolist()
    head = table.piece(0, table.total - 1)
    assert (
        head[-1, 2] == 63 and not np.shares_memory(head, table.cells) and head[:, :2].tolist() == segs[:, :2].tolist()
    )
    tail = table.piece(10, table.total - 10)
    assert tail[0].tolist() == [segs[0, 0] + 10, segs[0, 1] + 10, 54] and tail[1:].tolist() == segs[1:].tolist()
    assert table.cells.tolist() == segs.tolist()  # trimming the pieces left the table as it came


def test_largest_batch_is_checked_quickly() -> None:
    """The checks of a batch at the cap (32,768 scattered segments) take a few milliseconds of
    the daemon's loop, and a table past the cap is refused before any O(N) work."""
    segs = scattered(MAX_SEGMENTS, 64, 2 * MAX_SEGMENTS, seed=1)
    segs[:, 1] += 128 * MAX_SEGMENTS  # one region: sources in its upper half, so it passes every check
    raw = encode_segments(segs)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        table = Segments.decode(raw)
        table.check_regions(256 * MAX_SEGMENTS, 256 * MAX_SEGMENTS, 0, 1, 1)
        best = min(best, time.perf_counter() - t0)
    print(f"decode + check of {MAX_SEGMENTS} segments: {best * 1e3:.2f} ms")
    assert best < 0.05
    huge = bytes(SEGMENT_BYTES * 100_000)
    refusal = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest, match="split them into several batches"):
            Segments.decode(huge)
        refusal = min(refusal, time.perf_counter() - t0)
    assert refusal < 0.001


def test_a_batch_within_one_chunk_is_cut_whole_and_one_byte_less_is_not() -> None:
    """A batch whose bytes plus its segments' cost fit the chunk's budget is one chunk (the
    shortcut without numpy calls); a budget one byte short of that is cut by the general rule,
    its bytes and the cost of the segments it touches within the budget, and the chunks cover
    the batch in order."""
    table = Segments.decode(encode_segments(scattered(300, 1000, 600, seed=5)))
    cost = 100
    whole = table.total + cost * len(table)
    assert table.cut(0, whole, cost) == table.total
    assert table.cut(0, whole, cost, most=len(table) - 1) < table.total  # the segment cap still cuts
    short = table.cut(0, whole - 1, cost)
    assert 0 < short < table.total and short + cost * len(table.piece(0, short)) <= whole - 1
    offset = 0
    while offset < table.total:
        offset += table.cut(offset, whole - 1, cost)
    assert offset == table.total


def test_scheduler_cuts_a_batch_by_segment_cost_in_every_mode() -> None:
    """A batch is one request; its chunks cost (bytes + a per-segment cost) no more than a
    bulk batch's chunk (``batch_block_us``), and fifo mode hands out all of it too."""
    lane = LaneKey(0, Direction.H2D)
    info = LaneInfo(lane, bandwidth=1e9, express_min=0, express_max=0)
    per_segment = int(info.bandwidth * SEGMENT_COST_S)  # 100 bytes at 0.1 us a segment
    table = Segments.decode(encode_segments(scattered(2000, 1000, 4000, seed=2)))
    for mode in ("priod", "fifo"):
        s = Scheduler(Policy(mode=mode, min_chunk_bytes=4096), [info])
        s.enqueue(Request(1, "a", lane, "bulk", table.total, 0.0, segments=table), 0.0)
        chunks = s.next_chunks(0.0)
        assert chunks and all(c.request.id == 1 for c in chunks)
        if mode == "priod":
            chunk_bytes = s.lane_params(lane).batch_chunk_bytes
            assert all(c.nbytes + per_segment * len(table.piece(c.offset, c.nbytes)) <= chunk_bytes for c in chunks)
        done = handed = 0
        while not s.idle:
            handed += len(chunks)
            for c in chunks:
                for f in s.chunk_done(c, 0.0):
                    assert f.outcome == "done" and f.bytes_done == table.total
                done += c.nbytes
            chunks = s.next_chunks(0.0)
        assert done == table.total
        if mode == "priod":
            # Each chunk is cut against a whole chunk's budget, also when less than that is left:
            # as few chunks as the cost allows (not ever smaller ones as the batch runs out).
            cost = table.total + per_segment * len(table)
            assert handed <= -(-cost // chunk_bytes) + 1, (handed, cost, chunk_bytes)


# -- through the daemon -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    # Small segment limits so that the limit test is cheap; a slow link so cancels land mid-batch.
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_QUEUED_SEGMENTS": "40000"}
    with daemon_process(env) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
async def test_scattered_blocks_land_byte_for_byte(daemon: DaemonProcess, direction: str) -> None:
    """512 scattered 16 KiB blocks in one batch land exactly where their segments say, each way,
    and nothing else in the destination changes; the reply counts bytes and segments."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        size = 1024 * BLOCK
        host, dev, dev2 = await c.alloc_host(size), await c.alloc_device(size), await c.alloc_device(size)
        src, dst = {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, dev2)}[direction]
        assert src.array is not None and dst.array is not None
        rng = np.random.default_rng(5)
        src.array[:] = rng.integers(0, 256, size, dtype=np.uint8)
        dst.array[:] = rng.integers(0, 256, size, dtype=np.uint8)
        before = dst.array.copy()
        segs = scattered(512, BLOCK, 1024, seed=11)
        r = await c.copy_batch(dst, src, segs, priority="high")
        assert (r.nbytes, r.segments, r.path) == (512 * BLOCK, 512, "dma")
        assert r.total_us >= r.transfer_us > 0
        expect(dst.array, before, src.array, segs)


def tiny_scattered(n: int, slot: int, seed: int) -> npt.NDArray[np.int64]:
    """``n`` segments of 1 to ``slot`` bytes, each at the start of a distinct random slot of
    ``slot`` bytes on either side (the destinations never overlap)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, slot + 1, n)
    dst = rng.choice(2 * n, n, replace=False) * slot
    src = rng.choice(2 * n, n, replace=False) * slot
    return np.stack([dst, src, sizes], axis=1).astype(np.int64)


def test_a_gather_moves_what_a_step_per_segment_moves() -> None:
    """The sim engine's one-gather move of many small segments (`gather_segments`) leaves the
    destination as copying segment by segment does."""
    rng = np.random.default_rng(3)
    segs = tiny_scattered(5000, 64, seed=4)
    src = rng.integers(0, 256, 2 * 5000 * 64, dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    before = dst.copy()
    gather_segments(dst, src, segs.astype(np.uint64))
    expect(dst, before, src, segs)


@pytest.mark.parametrize("priority", ["high", "urgent"])
async def test_thousands_of_tiny_segments_land_byte_for_byte(daemon: DaemonProcess, priority: str) -> None:
    """A batch of 8,192 segments of 1-64 bytes (under the sim's gather bound, so each chunk moves
    in one gather) lands exactly where its segments say, and nothing else changes."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        segs = tiny_scattered(8192, 64, seed=9)
        size = 2 * 8192 * 64
        host, dev = await c.alloc_host(size), await c.alloc_device(size)
        assert host.array is not None and dev.array is not None
        rng = np.random.default_rng(10)
        host.array[:] = rng.integers(0, 256, size, dtype=np.uint8)
        dev.array[:] = rng.integers(0, 256, size, dtype=np.uint8)
        before = dev.array.copy()
        r = await c.copy_batch(dev, host, segs, priority=priority)
        assert (r.nbytes, r.segments) == (int(segs[:, 2].sum()), 8192)
        expect(dev.array, before, host.array, segs)


async def test_one_region_batch_and_sequence_of_triples(daemon: DaemonProcess) -> None:
    """Within one device region, disjoint source and destination segments copy; a list of
    triples works as well as an array, and an urgent batch may take the express path."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        dev = await c.alloc_device(1 << 20)
        assert dev.array is not None
        dev.array[:] = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        before = dev.array.copy()
        segs = [(0, 512 << 10, 8192), (100_000, 600_000, 5), (200_000, 700_000, 70_000)]
        r = await c.copy_batch(dev, dev, segs, priority="urgent")
        assert r.segments == 3 and r.nbytes == 78_197
        expect(dev.array, before, before, np.array(segs))


async def test_hostile_batches_get_clear_errors_and_harm_no_one(daemon: DaemonProcess) -> None:
    """Every bad table is refused with bad_request naming the fix, nothing of it is copied, the
    connection goes on, and another client's copy meanwhile lands intact."""
    async with (
        priod.connect(daemon.socket_path, copy_path="daemon") as bad,
        priod.connect(daemon.socket_path) as honest,
    ):
        h, d = await bad.alloc_host(1 << 20), await bad.alloc_device(1 << 20)
        assert d.array is not None
        d.array[:] = 7
        hh, hd = await honest.alloc_host(4 << 20), await honest.alloc_device(4 << 20)
        assert hh.array is not None and hd.array is not None
        hh.array[:] = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8)
        honest_copy = honest.start_copy(hd, hh, priority="normal")
        base = {"op": "copy_batch", "dst": d.id, "src": h.id}
        cases = [
            (
                encode_segments([(0, 0, 4096), ((1 << 20) - 10, 0, 11)]),
                r"segment 1: dst_offset 1048566 \+ nbytes 11 is outside region",
            ),
            (encode_segments([(0, 0, 4096), (4095, 8192, 2)]), r"destination segments 0 and 1 overlap"),
            (b"\x01" * 23, r"not a multiple of 24"),
            (np.array([[0, 0, 0]], "<u8").tobytes(), r"has nbytes = 0"),
            (bytes(SEGMENT_BYTES * (MAX_SEGMENTS + 1)), r"split them into several batches"),
            ((b"text, not a table: 24 B." * 2), r"outside region|has nbytes = 0|2\*\*62"),
        ]
        for raw, match in cases:
            with pytest.raises(InvalidRequest, match=match):
                await bad.raw_request({**base, "segments": raw})
        with pytest.raises(InvalidRequest, match=r"field 'segments' must be bytes, got str"):
            await bad.raw_request({**base, "segments": "0,0,4096"})
        with pytest.raises(InvalidRequest, match=r"source segment 0 overlaps destination segment 0 in the same memory"):
            await bad.copy_batch(d, d, [(0, 100, 200)])
        assert np.all(d.array == 7)  # nothing of a refused batch was copied
        with pytest.raises(InvalidRequest, match=r"an \(N, 3\) array"):
            bad.start_copy_batch(d, h, [(1, 2)])
        with pytest.raises(InvalidRequest, match=r"negative"):
            bad.start_copy_batch(d, h, np.array([(-1, 0, 5)], dtype=np.int32))  # converted on the client, refused there
        with pytest.raises(InvalidRequest, match=r"negative figure"):
            await bad.copy_batch(d, h, [(-1, 0, 5)])  # int64, sent as it is: the daemon refuses it
        await bad.ping()
        await honest_copy
        assert np.array_equal(hd.array, hh.array)


async def test_segment_limit_refuses_at_once(daemon: DaemonProcess) -> None:
    """Past [limits] max_queued_segments the batch is refused with LimitExceeded naming it."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        h, d = await c.alloc_host(64 << 20), await c.alloc_device(64 << 20)
        big = c.start_copy_batch(d, h, scattered(30000, 1024, 65536, seed=3), priority="bulk")
        with pytest.raises(
            LimitExceeded,
            match=r"^20000 more segments would exceed \[limits\] max_queued_segments = 40000 pending on this connection",
        ):
            await c.copy_batch(d, h, scattered(20000, 1024, 65536, seed=4), priority="bulk")
        assert (await big).segments == 30000


async def test_cancel_mid_batch_reports_whole_segments(daemon: DaemonProcess) -> None:
    """A cancelled batch says how many of its first segments landed whole; exactly those (and
    at most the next one, in part) changed the destination."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        size = 96 << 20
        h, d = await c.alloc_host(size), await c.alloc_device(size)
        assert h.array is not None and d.array is not None
        h.array[:] = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
        before = d.array.copy()
        segs = scattered(96, 1 << 20, 96, seed=6)
        handle = c.start_copy_batch(d, h, segs, priority="bulk")
        d0, s0, n0 = segs[0]
        deadline = time.monotonic() + 10
        while not np.array_equal(d.array[d0 : d0 + n0], h.array[s0 : s0 + n0]):  # the first segment landed
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        bytes_done = await handle.cancel()  # 2 GB/s: the other 95 MiB would take 47 ms more
        done = handle.segments_done
        assert done is not None and 0 < done < 96, (done, bytes_done)
        assert done << 20 <= bytes_done < (done + 1) << 20
        first = segs[:done]
        for dd, ss, n in first:
            assert np.array_equal(d.array[dd : dd + n], h.array[ss : ss + n])
        untouched = np.ones(size, bool)
        for dd, _, n in segs[: done + 1]:
            untouched[dd : dd + n] = False
        assert np.array_equal(d.array[untouched], before[untouched])


async def test_urgent_batch_overtakes_a_bulk_batch(daemon: DaemonProcess) -> None:
    """An urgent batch sent after a large bulk batch (same lane, same client) finishes first,
    long before the bulk one, and both land intact.

    The urgent batch waits for the bulk chunk running when it comes (`batch_block_us`, which
    the sim's per-block Python stretches to ~10 ms) and, now and then, for the GIL behind the
    engine's threads: 12-54 ms on the 2-vCPU VM, against 135-160 ms for 128 MiB of bulk."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        size = 128 << 20
        h, d = await c.alloc_host(size), await c.alloc_device(size)
        uh, ud = await c.alloc_host(1 << 20), await c.alloc_device(1 << 20)
        assert h.array is not None and d.array is not None and uh.array is not None and ud.array is not None
        h.array[:] = 3
        uh.array[:] = np.random.default_rng(8).integers(0, 256, 1 << 20, dtype=np.uint8)
        bulk = c.start_copy_batch(d, h, scattered(2048, 64 << 10, 2048, seed=9), priority="bulk")
        await asyncio.sleep(0.002)
        segs = scattered(64, BLOCK, 64, seed=10)
        t0 = time.perf_counter()
        r = await c.copy_batch(ud, uh, segs, priority="urgent")
        urgent_s = time.perf_counter() - t0
        assert not bulk.done()
        b = await bulk
        assert r.total_us < b.total_us / 2 and urgent_s < 0.1, (r.total_us, b.total_us, urgent_s)
        for dd, ss, n in segs:
            assert np.array_equal(ud.array[dd : dd + n], uh.array[ss : ss + n])
        assert np.all(d.array == 3)


async def test_copy_timeout_cancels_in_the_daemon(daemon: DaemonProcess) -> None:
    """copy(timeout=) raises CopyTimeout (a Cancelled and a TimeoutError) with the bytes done,
    and the daemon has stopped the copy: the connection holds nothing pending afterwards."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        size = 128 << 20
        h, d = await c.alloc_host(size), await c.alloc_device(size)
        t0 = time.perf_counter()
        with pytest.raises(CopyTimeout) as info:
            await c.copy(d, h, priority="bulk", timeout=0.01)
        assert time.perf_counter() - t0 < 0.5  # not the 64 ms the whole copy takes... nor more
        exc = info.value
        assert isinstance(exc, Cancelled) and isinstance(exc, TimeoutError)
        assert 0 < exc.bytes_done < size and exc.segments_done is None
        with pytest.raises(CopyTimeout) as binfo:
            await c.copy_batch(d, h, scattered(128, 1 << 20, 128, seed=12), priority="bulk", timeout=0.01)
        assert binfo.value.segments_done is not None and 0 <= binfo.value.segments_done < 128
        mine = [cl for cl in (await c.status())["clients"] if cl["pid"] == c.server.peer["pid"]]
        assert mine and mine[0]["pending"] == 0
        r = await c.copy(d, h, 4096, timeout=5.0)  # a copy that makes it returns as usual
        assert r.nbytes == 4096


def test_sync_client_start_poll_cancel_and_batches(daemon: DaemonProcess) -> None:
    """SyncClient: start_copy returns at once, poll() is None until the copy lands, other
    requests go meanwhile; cancel() reports bytes (segments for a batch); copy_batch and
    timeouts work as on the async client."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        size = 64 << 20
        h, d = c.alloc_host(size), c.alloc_device(size)
        assert h.array is not None and d.array is not None
        h.array[:] = np.random.default_rng(13).integers(0, 256, size, dtype=np.uint8)
        handle = c.start_copy(d, h, priority="bulk")
        assert handle.poll() is None
        c.ping()  # another request while the copy runs
        deadline = time.monotonic() + 10
        while (result := handle.poll()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert result.nbytes == size and np.array_equal(d.array, h.array)

        segs = scattered(64, 1 << 20, 64, seed=14)
        batch = c.start_copy_batch(d, h, segs, priority="bulk")
        time.sleep(0.01)
        done_bytes = batch.cancel()
        assert batch.segments_done is not None and 0 <= batch.segments_done < 64
        assert batch.segments_done << 20 <= done_bytes

        small = scattered(16, BLOCK, 64, seed=15)
        r = c.copy_batch(d, h, small, priority="urgent")
        assert r.segments == 16
        for dd, ss, n in small:
            assert np.array_equal(d.array[dd : dd + n], h.array[ss : ss + n])
        with pytest.raises(CopyTimeout) as info:
            c.copy(d, h, priority="bulk", timeout=0.005)
        assert 0 < info.value.bytes_done < size
        c.ping()


async def test_a_flood_of_largest_batches_does_not_stall_others(daemon: DaemonProcess) -> None:
    """A client that sends 24 batches at the segment cap, each checked in full and refused at its
    last segment, holds the daemon's loop for about one batch's checks at a time: another
    client's pings keep coming back within milliseconds throughout (median, 90th percentile),
    measured against what one such batch's refusal takes on this machine, alone."""
    async with (
        priod.connect(daemon.socket_path, copy_path="daemon") as bad,
        priod.connect(daemon.socket_path) as honest,
    ):
        dev = await bad.alloc_device(8 << 20)
        segs = scattered(MAX_SEGMENTS, 64, 2 * MAX_SEGMENTS, seed=21)
        segs[:, 1] += 4 << 20  # sources in the region's upper half ...
        segs[-1, 1] = segs[0, 0]  # ... but the last one reads what the first one writes
        frame = {"op": "copy_batch", "dst": dev.id, "src": dev.id, "segments": encode_segments(segs)}
        one = float("inf")  # one batch's refusal, round trip included: the loop's turn it takes
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(InvalidRequest):
                await bad.raw_request(frame)
            one = min(one, time.perf_counter() - t0)
        flood = asyncio.gather(*(bad.raw_request(frame) for _ in range(24)), return_exceptions=True)
        rtts: list[float] = []
        while not flood.done():
            t0 = time.perf_counter()
            await honest.ping()
            rtts.append(time.perf_counter() - t0)
        errors = await flood
        assert all(
            isinstance(e, InvalidRequest) and f"source segment {MAX_SEGMENTS - 1} overlaps" in str(e) for e in errors
        )
        assert len(rtts) >= 5, "the flood ended before the pings could measure anything"
        print(
            f"pings during the flood: {len(rtts)}, worst {max(rtts) * 1e3:.1f} ms, median {statistics.median(rtts) * 1e3:.2f} ms; one batch alone {one * 1e3:.2f} ms"
        )
        # One batch's checks take a few ms, the whole flood ~100 ms of the loop: pings must get
        # through between batches, not after the flood. The bounds are 5 and 30 ms where one
        # batch's refusal takes up to 3.3 ms, and scale with it on a slower machine (a 2-core VM
        # read 5.6 ms once at the median: its batch checks were slower, not fewer pings through).
        # (Percentiles, not the worst: this machine may be shared, and one descheduling is not
        # the daemon's doing.)
        rtts.sort()
        assert statistics.median(rtts) < max(0.005, 1.5 * one) and rtts[int(len(rtts) * 0.9)] < max(0.03, 9 * one), (
            one,
            rtts,
        )


async def test_engine_failure_mid_batch_reports_whole_segments(daemon: DaemonProcess) -> None:
    """A chunk the engine fails ends the batch with EngineError carrying bytes_done (the chunks
    before it) and segments_done (the segments those hold whole); those segments landed."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as probe:
        lane = next(ln for ln in (await probe.status())["lanes"] if ln["lane"].endswith("h2d"))
    chunk, cost = (
        lane["chunk_bytes"],
        int(lane["bandwidth_gbps"] * 1e9 * SEGMENT_COST_S),
    )  # 2 GB/s: exact; blocks this large keep max_block_us
    big = chunk * 7 // 10
    segs = scattered(8, big, 16, seed=30)
    segs[:2, 2] = chunk * 3 // 10  # two small segments first: the first chunk ends inside the third
    table = Segments.decode(encode_segments(segs))
    first = table.cut(0, chunk, cost)
    second = table.cut(first, chunk, cost)
    assert first != second and table.segments_done(first) == 2, (first, second)  # the batch's shape, as designed
    with daemon_process({"PRIOD_LOG__LEVEL": '"error"', "PRIOD_SIM__FAULT_ON_NBYTES": str(second)}) as faulty:
        async with priod.connect(faulty.socket_path, copy_path="daemon") as c:
            h, d = await c.alloc_host(16 * big), await c.alloc_device(16 * big)
            assert h.array is not None and d.array is not None
            h.array[:] = np.random.default_rng(31).integers(0, 256, 16 * big, dtype=np.uint8)
            with pytest.raises(EngineError, match=r"injected engine fault") as info:
                await c.copy_batch(d, h, segs, priority="bulk")
            assert (info.value.bytes_done, info.value.segments_done) == (first, 2)
            assert "(2 of 8 segments whole)" in str(info.value)
            for dd, ss, n in segs[:2]:
                assert np.array_equal(d.array[dd : dd + n], h.array[ss : ss + n])


def test_a_bulk_batch_of_small_blocks_runs_under_batch_block_us_until_an_urgent_copy_is_recent() -> None:
    """While no urgent copy is recent on the lane, a bulk batch of small blocks fills
    ``batch_block_us`` of it, a contiguous bulk copy or a batch of large blocks only
    ``max_block_us``; once an urgent copy has come, the batch keeps to ``urgent_block_us`` like any bulk."""
    lane = LaneKey(0, Direction.H2D)
    info = LaneInfo(lane, bandwidth=1e9, express_min=0, express_max=0)
    policy = Policy(
        min_chunk_bytes=4096, max_block_us=1000.0, batch_block_us=4000.0, urgent_block_us=100.0, urgent_window_ms=10.0
    )
    table = Segments.decode(encode_segments(scattered(400, 64 << 10, 800, seed=3)))  # 26 MB, 26 ms at 1 GB/s
    s = Scheduler(policy, [info])
    p = s.lane_params(lane)
    s.enqueue(Request(1, "a", lane, "bulk", table.total, 0.0, segments=table), 0.0)
    batch_chunks = s.next_chunks(0.0)
    assert p.inflight_bytes < sum(c.nbytes for c in batch_chunks) <= p.batch_inflight_bytes

    plain = Scheduler(policy, [info])
    plain.enqueue(Request(2, "a", lane, "bulk", table.total, 0.0), 0.0)
    assert 0 < sum(c.nbytes for c in plain.next_chunks(0.0)) <= p.inflight_bytes
    # Large blocks: the driver's cost per block is small beside their bytes, max_block_us holds.
    large = Segments.decode(encode_segments(scattered(26, 1 << 20, 52, seed=4)))
    big = Scheduler(policy, [info])
    big.enqueue(Request(4, "a", lane, "bulk", large.total, 0.0, segments=large), 0.0)
    assert 0 < sum(c.nbytes for c in big.next_chunks(0.0)) <= p.inflight_bytes

    s.enqueue(Request(3, "b", lane, "urgent", 4096, 0.001), 0.001)
    urgent = s.next_chunks(0.001)
    assert [c.request.id for c in urgent] == [3]
    for c in [*batch_chunks, *urgent]:
        s.chunk_done(c, 0.002)
    after = s.next_chunks(0.002)  # within urgent_window_ms of the urgent copy
    assert after and all(c.request.id == 1 for c in after)
    assert sum(c.nbytes for c in after) <= p.urgent_inflight_bytes < p.inflight_bytes


def test_an_urgent_batch_goes_by_dma_in_regular_chunks_of_at_most_256_segments() -> None:
    """On the DMA path an urgent batch is handed out in chunks of the lane's regular size of up
    to `URGENT_DMA_SEGMENTS` segments, not of the short bound: each chunk costs the loop its
    batched calls before the engine sees it, and the engine idled between short ones (batch.py).
    A contiguous urgent copy of the same bytes keeps the short bound's chunks; a batch of large
    blocks keeps within the regular chunk."""
    lane = LaneKey(0, Direction.H2D)
    info = LaneInfo(lane, bandwidth=50e9, express_min=0, express_max=0)  # DMA only
    block = 16 << 10
    table = Segments.decode(
        encode_segments(scattered(URGENT_DMA_SEGMENTS + 44, block, 2 * URGENT_DMA_SEGMENTS + 88, seed=5))
    )
    s = Scheduler(Policy(min_chunk_bytes=4096), [info])
    short = s.lane_params(lane).urgent_chunk_bytes
    assert short < URGENT_DMA_SEGMENTS * block  # the batch's chunk is larger than the short bound's
    s.enqueue(Request(1, "a", lane, "urgent", table.total, 0.0, segments=table), 0.0)
    sizes = []
    while not s.idle:
        chunks = s.next_chunks(0.0)
        assert chunks and all(c.request.cls == "urgent" for c in chunks)
        sizes += [c.nbytes for c in chunks]
        for c in chunks:
            s.chunk_done(c, 0.0)
    assert sizes == [URGENT_DMA_SEGMENTS * block, 44 * block]

    plain = Scheduler(Policy(min_chunk_bytes=4096), [info])
    plain.enqueue(Request(2, "a", lane, "urgent", table.total, 0.0), 0.0)
    chunks = plain.next_chunks(0.0)
    assert chunks and all(c.nbytes <= short for c in chunks)

    large = Segments.decode(encode_segments(scattered(8, 4 << 20, 16, seed=6)))  # 32 MiB in 4 MiB blocks
    big = Scheduler(Policy(min_chunk_bytes=4096), [info])
    regular = big.lane_params(lane).chunk_bytes
    assert short < regular < large.total
    big.enqueue(Request(3, "a", lane, "urgent", large.total, 0.0, segments=large), 0.0)
    sizes = []
    while not big.idle:
        chunks = big.next_chunks(0.0)
        assert chunks and all(c.request.cls == "urgent" and c.strict for c in chunks)
        sizes += [c.nbytes for c in chunks]
        for c in chunks:
            big.chunk_done(c, 0.0)
    assert sum(sizes) == large.total and max(sizes) == regular and all(n > short for n in sizes[:-1])


class _PeaksSeen(SimEngine):
    """The sim engine, noting each batch chunk's rows and the peaks that came with them."""

    def __init__(self, cfg: SimSettings) -> None:
        super().__init__(cfg)
        self.chunks: list[tuple[int, tuple[int, int, int] | None]] = []

    def submit(self, job: ChunkJob) -> Completion:
        if job.cells is not None:
            self.chunks.append((len(job.cells), job.peaks))
        return super().submit(job)


async def test_a_batch_in_one_chunk_brings_its_peaks_to_the_engine_and_a_piece_does_not() -> None:
    """A batch handed out whole comes with the largest offsets and size found when its table was
    read, so the engine's own bound needs no numpy reductions (the cuda engine's took 36 us of an
    urgent batch's launch on the H200); a piece of a batch is a new table and comes without."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path}, log={"level": "warning"})
    engine = _PeaksSeen(cfg.sim)
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            size = 128 << 20  # the large batch's 128 slots of 1 MiB
            host, dev = await c.alloc_host(size), await c.alloc_device(size)
            assert host.array is not None and dev.array is not None
            host.array[: 8 << 20] = np.random.default_rng(7).integers(0, 256, 8 << 20, dtype=np.uint8)
            small = scattered(8, BLOCK, 64, seed=8)
            await c.copy_batch(dev, host, small, priority="urgent")
            assert engine.chunks == [(8, (int(small[:, 0].max()), int(small[:, 1].max()), BLOCK))]
            expect(dev.array[: 64 * BLOCK], np.zeros(64 * BLOCK, np.uint8), host.array, small)
            engine.chunks.clear()
            large = scattered(64, 1 << 20, 128, seed=9)  # 64 MiB: many chunks at the sim's 2 GB/s
            await c.copy_batch(dev, host, large, priority="bulk")
            assert len(engine.chunks) > 1 and all(peaks is None for _, peaks in engine.chunks)
    finally:
        await daemon.stop()


def test_every_integer_form_of_a_table_encodes_to_the_same_wire_bytes() -> None:
    """int64 and uint64 tables in C order go on the wire as they are (no converted copy); every
    other form (int32, Fortran order, a strided view, a list of triples) is converted, to the same
    bytes. A negative figure is refused before anything is sent where the table is converted;
    in an int64 table, sent as it is, it reads as 2**63 or more and the daemon's decode refuses it."""
    table = scattered(64, 4096, 200, seed=9)
    want = np.ascontiguousarray(table, dtype="<u8").tobytes()
    forms = [
        table,
        table.astype(np.uint64),
        table.astype(np.int32),
        np.asfortranarray(table),
        np.repeat(table, 2, axis=0)[::2],
        table.tolist(),
    ]
    assert all(encode_segments(form) == want for form in forms)
    assert Segments.decode(want).cells.tolist() == table.tolist()
    negative = table.copy()
    negative[5, 1] = -4096
    with pytest.raises(InvalidRequest, match=r"negative"):
        encode_segments(negative.astype(np.int32))
    with pytest.raises(InvalidRequest, match=r"negative figure"):
        Segments.decode(encode_segments(negative))


def test_urgent_budget_charges_a_batch_its_segments_too() -> None:
    """An urgent batch of many tiny segments costs its tenant's budget what its segments cost
    the engine, not only its bytes: past the burst it is demoted, while a contiguous urgent copy
    of the same bytes is not."""
    lane = LaneKey(0, Direction.H2D)
    info = LaneInfo(lane, bandwidth=1e10, express_min=0, express_max=0)
    assert int(info.bandwidth * SEGMENT_COST_S) == 1000  # bytes a segment costs, at 0.1 us a segment
    policy = Policy(min_chunk_bytes=4096, urgent_burst_bytes=1 << 20, urgent_inflight_bytes=1 << 20)
    table = Segments.decode(encode_segments(scattered(2000, 64, 4000, seed=3)))  # 128,000 bytes, ~2 MB of cost
    for segments, demoted in ((None, None), (table, "urgent")):
        s = Scheduler(policy, [info])
        req = Request(1, "a", lane, "urgent", table.total, 0.0, uid=7, segments=segments)
        s.enqueue(req, 0.0)
        assert s.next_chunks(0.0)
        assert req.demoted_from == demoted and req.cls == ("high" if demoted else "urgent")
