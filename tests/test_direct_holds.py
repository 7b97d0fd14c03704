"""Direct urgent copies: a client's own DMA, announced on its hold page, holds bulk back.

The daemon side (holds.py, the scheduler's held lanes, the pump) runs here on the sim engine;
the client's CUDA copies themselves (`priod.client.direct.DirectCopies`) are tested on the GPU
(tests/test_gpu_direct.py). What a hold page must guarantee, whoever writes it:
- while a copy is announced and not over on a lane, no bulk chunk is handed out there, and the
  lane runs its short bound; bulk goes on once the copy ends, and its bytes are all right;
- a hold lasts at most ``direct_hold_max_ms`` per copy and the uid's hold budget, whatever the
  client writes (garbage counters, a copy never ended, a connection that leaves);
- the page cannot be resized under the daemon's mapping.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

import priod
from priod.cli import format_status
from priod.client.direct import DirectCopies, DirectPair, HoldPage, direct_pointers, direct_rows, direct_table
from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.config import load_config
from priod.daemon.engines.sim import SimEngine
from priod.daemon.holds import Holds
from priod.daemon.metrics import _LATENCY_BUCKETS
from priod.daemon.pump import Pump
from priod.daemon.sched.policy import Policy, validate_policy
from priod.daemon.sched.scheduler import Request, Scheduler
from priod.daemon.server import Daemon
from priod.errors import ConfigError, InvalidRequest
from priod.testing import FakeCuda, ManualEngine, daemon_process, wait_until
from priod.wire.hold_page import CLIENT_BYTES as HOLD_CLIENT_BYTES
from priod.wire.hold_page import DAEMON_WORD as HOLD_DAEMON_WORD
from priod.wire.hold_page import PAGE_BYTES

H2D = LaneKey(0, Direction.H2D)
D2H = LaneKey(0, Direction.D2H)
LANES = [{"device": 0, "device_uuid": None, "direction": "h2d"}, {"device": 0, "device_uuid": None, "direction": "d2h"}]
MiB = 1 << 20


def page_pair(holds: Holds, owner: int = 1, uid: int | None = 1000, now: float = 0.0) -> HoldPage:
    """The daemon's page for ``owner`` and the client's mapping of it."""
    page = holds.open(owner, uid, [H2D, D2H], now)
    return HoldPage(os.dup(page.fd), LANES)


# -- holds.py alone ----------------------------------------------------------------------------
def test_an_announced_copy_holds_its_lane_until_it_ends() -> None:
    holds = Holds(hold_max_s=1.0, share=0.25, burst_s=1.0)
    client = page_pair(holds)
    assert holds.scan(0.0).held == frozenset()
    client.begin(client.slot(None, "h2d"))
    scan = holds.scan(0.001)
    assert scan.held == {H2D} and scan.begun == {H2D}
    again = holds.scan(0.002)
    assert again.held == {H2D} and again.begun == frozenset()  # begun is news once
    client.end(client.slot(None, "h2d"))
    assert holds.scan(0.003).held == frozenset()
    assert holds.copies == {H2D: 1} and holds.cut == {}


def test_a_copy_never_ended_holds_for_hold_max_only() -> None:
    holds = Holds(hold_max_s=0.005, share=1.0, burst_s=1.0)
    client = page_pair(holds)
    client.begin(client.slot(None, "d2h"))
    assert holds.scan(0.0).held == {D2H}
    assert holds.scan(0.004).held == {D2H}
    assert holds.scan(0.006).held == frozenset()
    assert holds.scan(0.5).held == frozenset()  # still announced: not held again
    assert holds.cut == {D2H: 1}
    client.end(client.slot(None, "d2h"))
    client.begin(client.slot(None, "d2h"))  # the next copy holds afresh
    assert holds.scan(0.6).held == {D2H}


def test_a_page_left_alone_is_skipped_and_its_budget_still_refills() -> None:
    """A scan skips a page whose counters did not change and that holds nothing (the pump scans
    every loop turn under the short bound, and most pages are idle); the page's budget refills
    as if every scan had looked: after a hold that spent part of it and a long quiet spell of
    scans, the next copy finds the bucket full again, and holds."""
    holds = Holds(hold_max_s=1.0, share=0.25, burst_s=0.004)
    client = page_pair(holds)
    slot = client.slot(None, "h2d")
    client.begin(slot)
    for k in range(10):  # held 9 ms: the 4 ms burst is spent and the hold cut
        holds.scan(0.001 * k)
    client.end(slot)
    holds.scan(0.010)
    bucket = holds._buckets[(1000, H2D)]
    assert bucket.tokens < 0.001 and holds.cut == {H2D: 1}
    for k in range(1, 1000):  # a second of scans with nothing written
        assert holds.scan(0.010 + 0.001 * k).held == frozenset()
    assert bucket.at == 0.010  # none of them looked at the page's slots
    client.begin(slot)
    scan = holds.scan(1.5)
    assert scan.held == {H2D} and scan.begun == {H2D}
    assert bucket.tokens == pytest.approx(0.004 - 50e-6)  # full (the burst) less one copy's charge


def test_holding_is_budgeted_per_uid_over_its_connections() -> None:
    # 10 ms of holding at once, then 10% of the time; two connections of one uid share it.
    holds = Holds(hold_max_s=1.0, share=0.1, burst_s=0.010)
    a, b = page_pair(holds, owner=1), page_pair(holds, owner=2)
    t = 0.0
    held_for = 0.0
    for _ in range(100):  # copies of 1 ms back to back on both connections
        for c in (a, b):
            c.begin(c.slot(None, "h2d"))
        if holds.scan(t).held:
            held_for += 0.001
        t += 0.001
        for c in (a, b):
            c.end(c.slot(None, "h2d"))
        holds.scan(t)
    # Both connections' holds are charged to one bucket: 10 ms of burst, then ~10% of 100 ms.
    assert 0.004 <= held_for <= 0.030
    assert holds.cut.get(H2D, 0) > 100


def test_one_uids_flood_and_torn_counters_leave_another_uids_holds_alone() -> None:
    """Budgets are per uid: a uid that announces a million copies at once and writes counters
    that step back holds nothing and starts no short bound, while another uid's copy on the same
    lane still holds it."""
    holds = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05)
    hostile, honest = page_pair(holds, owner=1, uid=1000), page_pair(holds, owner=2, uid=2000)
    raw = np.frombuffer(hostile._map, dtype="<u8", count=2)
    raw[:] = [2**62, 0]  # a million copies announced, none ended: 50 s of charges
    scan = holds.scan(0.0)
    assert scan.held == frozenset() and scan.begun == frozenset()
    for t in range(1, 50):  # then its counters step back and forth: no copies, no holds
        raw[0] = 2**62 - (t % 2)
        assert holds.scan(t * 1e-4).held == frozenset()
    assert holds.stepped_back == {H2D: 25} and holds.copies == {H2D: 1_000_000}  # counted from the last good value
    honest.begin(honest.slot(None, "h2d"))
    scan = holds.scan(0.01)
    assert scan.held == {H2D} and scan.begun == {H2D}  # the other uid's copy holds the lane
    honest.end(honest.slot(None, "h2d"))
    assert holds.scan(0.011).held == frozenset()
    del raw


def test_garbage_counters_count_boundedly_and_spend_the_budget() -> None:
    """Counters that jump by billions count at most a million copies a scan, and each copy costs
    the uid's hold budget: such a page holds nothing, and its uid holds again once the budget
    refills (a debt of one burst at most), for hold_max at most."""
    holds = Holds(hold_max_s=0.005, share=1.0, burst_s=1.0)
    client = page_pair(holds)
    raw = np.frombuffer(client._map, dtype="<u8", count=4)
    raw[:] = [2**62, 7, 123, 2**63]
    scan = holds.scan(0.0)
    # h2d jumped by 2**62: a million copies, 50 s of charges: nothing held, no short bound.
    # d2h jumped by 123 (ended says 2**63): 25 ms of charges, held (for hold_max at most).
    assert scan.held == {D2H} and scan.begun == {D2H}
    assert holds.copies == {H2D: 1_000_000, D2H: 123}
    assert holds.scan(0.01).held == frozenset()  # d2h cut at hold_max
    raw[0] = 2**62 + 6  # six more h2d copies, once its bucket has refilled (1 s of debt at 1 s/s)
    assert holds.scan(2.5).held == {H2D}
    assert holds.scan(2.51).held == frozenset()  # then cut at hold_max
    del raw


def test_a_begun_counter_that_steps_back_is_no_copy() -> None:
    """``begun`` only counts up; a value below the last one seen (a half-written counter, a
    buggy writer) announces nothing and costs nothing, and counting resumes from the last good
    value. Past 2**64 it wraps: that is a step forward."""
    holds = Holds(hold_max_s=1.0, share=0.1, burst_s=1.0)
    client = page_pair(holds)
    raw = np.frombuffer(client._map, dtype="<u8", count=2)
    raw[:] = [10, 10]
    holds.scan(0.0)
    tokens = holds._buckets[(1000, H2D)].tokens
    raw[0] = 0  # read back at 0: no copy, no charge, counted as a step back
    scan = holds.scan(0.001)
    assert scan.begun == frozenset() and holds.copies == {H2D: 10} and holds.stepped_back == {H2D: 1}
    assert holds._buckets[(1000, H2D)].tokens == pytest.approx(tokens + 0.0001)  # refilled, nothing charged
    raw[:] = [11, 11]  # the next copy counts one
    holds.scan(0.002)
    assert holds.copies == {H2D: 11}
    for t, value in enumerate((2**63, 2**64 - 1)):  # forward (by < 2**63 each: a million copies)
        raw[:] = [value, value]
        holds.scan(0.003 + t * 0.001)
    raw[:] = [1, 1]  # wrapped: two copies on
    holds.scan(0.006)
    assert holds.copies == {H2D: 11 + 2_000_000 + 2}
    del raw


def test_counters_written_while_the_daemon_scans_never_read_as_copies_not_announced() -> None:
    """A client process announces copies as fast as it can while the daemon side scans: every
    copy counts once, none more. (`struct.pack_into` zeroes a field before it
    packs: a scan that caught ``begun`` at 0 took it for a wrap past 2**64, a million copies and
    50 s of charges, and the daemon held nothing for the next ~200 ms: the H200's direct rows had
    runs of ~900-us copies.)"""
    holds = Holds(hold_max_s=1.0, share=1.0, burst_s=1.0)
    page = holds.open(1, 1000, [H2D, D2H], 0.0)
    copies = 200_000
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(page.fd), str(copies)],
        pass_fds=[page.fd],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    scans = 0
    while writer.poll() is None:
        holds.scan(time.perf_counter())
        scans += 1
    out, _ = writer.communicate()
    assert writer.returncode == 0 and out.split() == [b"done"]
    holds.scan(time.perf_counter())
    assert scans > 100  # the two really ran side by side
    assert holds.copies == {H2D: copies, D2H: copies}


WRITER = """
import sys
from priod.client.direct import HoldPage
lanes = [{"device": 0, "device_uuid": None, "direction": d} for d in ("h2d", "d2h")]
page = HoldPage(int(sys.argv[1]), lanes)
for _ in range(int(sys.argv[2])):
    for slot in (0, 1):
        page.begin(slot)
        page.end(slot)
page.close()
print("done")
"""


def test_the_page_cannot_be_resized_and_one_connection_gets_one() -> None:
    holds = Holds()
    page = holds.open(1, 0, [H2D], 0.0)
    fd = os.dup(page.fd)
    try:
        for size in (0, PAGE_BYTES * 2):
            with pytest.raises(OSError) as exc:
                os.ftruncate(fd, size)
            assert exc.value.errno == errno.EPERM
        with pytest.raises(OSError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed for good: F_SEAL_SEAL
    finally:
        os.close(fd)
    with pytest.raises(InvalidRequest, match="already has its hold page"):
        holds.open(1, 0, [H2D], 0.0)
    holds.close(1)
    assert not holds.pages and holds.scan(1.0).held == frozenset()


def test_a_direct_batch_table_is_checked_before_anything_moves_and_its_hold_ends() -> None:
    """A direct batch announces itself before its table is checked (the daemon closes the gate
    meanwhile); a table of the wrong shape or type reaches no copy at all, one with bad figures
    is refused by the copy's own check (on the GPU, the copy kernel's: tests/test_gpu_direct.py;
    here `direct_table`, the host's), and either way that hold ends."""
    holds = Holds(hold_max_s=1.0, share=1.0, burst_s=1.0)
    client = page_pair(holds)
    slot = client.slot(None, "h2d")
    reached: list[Any] = []

    def run_batch(pair: DirectPair, table: Any) -> int:
        reached.append(table)
        return direct_table(table, pair.dst_bytes, pair.src_bytes)[1]

    owner = types.SimpleNamespace(page=client, one_gpu=True, _run_batch=run_batch)
    pair = DirectPair(cast(DirectCopies, owner), 1 << 40, 4096, 1 << 41, 8192, 0, slot)
    now = 0.0
    shape = r"\(N, 3\) integer array"
    bad_shape = [
        ([[0, 0]], shape),
        ([], shape),
        (np.zeros((2, 3), dtype=np.float32), shape),
        (np.zeros((2, 3, 1), dtype=np.int64), shape),
    ]
    bad_figures = [
        ([[0, 0, 8192]], "does not fit"),
        ([[0, 4096, 4097]], "does not fit"),
        ([[0, 0, 0]], "nbytes >= 1"),
        ([[-1, 0, 16]], "offsets >= 0"),
    ]
    for bad, why in bad_shape + bad_figures:
        with pytest.raises(InvalidRequest, match=why):
            pair.copy_batch(bad)
        now += 0.001
        assert holds.scan(now).held == frozenset()  # begun and ended: nothing left held
    assert len(reached) == len(bad_figures)  # only well-formed tables reached the copy
    assert holds.copies == {H2D: 8} and holds.cut == {}  # each bad table was one announced copy
    assert pair.copy_batch([[0, 0, 16], [16, 32, 8]]) == 24
    with pytest.raises(InvalidRequest, match="do not fit"):
        pair.copy(4097)


def test_direct_rows_takes_a_c_ordered_8_byte_table_as_it_is() -> None:
    """The table the copy kernel reads byte for byte as uint64: an int64 or uint64 array in C
    order goes in as it is, a view of its bytes (no numpy call on the launch's path), where a
    negative figure reads as 2**63 or more, past any buffer; anything else becomes a uint64
    table in C order; a wrong shape or type is refused."""
    rows = np.array([[0, 64, 4096], [8192, 16, 4096]], dtype=np.int64)
    for table in (rows, rows.astype(np.uint64)):
        seen: object = direct_rows(table).obj
        assert seen is table
    for other in (
        rows.astype(np.int32),
        rows.astype(">i8"),
        np.asfortranarray(rows),
        rows[:, [0, 1, 2]],
        rows.tolist(),
    ):
        view = direct_rows(other)
        assert view.c_contiguous and view.itemsize == 8 and view.shape == (2, 3)
        assert np.asarray(view).tolist() == rows.tolist() and view[1, 0] == 8192
    assert np.asarray(direct_rows([[0, -16, 8]])).view(np.uint64).tolist() == [[0, 2**64 - 16, 8]]
    assert np.asarray(direct_rows(np.array([[0, -16, 8]], dtype=np.int32))).tolist() == [[0, 2**64 - 16, 8]]
    odd_types = (
        np.zeros((2, 3), dtype=np.float32),
        np.zeros((2, 3), dtype="M8[s]"),
        np.zeros((2, 3), dtype=object),
        np.zeros((2, 3), dtype=[("a", "i8")]),
    )
    for bad in (
        [[0, 0]],
        [],
        [[0, 0, 8], [0, 8]],
        np.zeros((2, 3, 1), dtype=np.int64),
        np.zeros((0, 3), dtype=np.int64),
        *odd_types,
    ):
        with pytest.raises(InvalidRequest, match=r"\(N, 3\) integer array"):
            direct_rows(bad)


def test_a_direct_batch_for_batched_dma_is_checked_as_the_host_checks_it() -> None:
    """`direct_pointers` (batched DMA's table: addresses, checked by their extremes) accepts what
    `direct_table` accepts and refuses what it refuses, with its message, over random tables of
    one or several sizes with rows pushed past either end, to zero bytes, below zero, or past
    2**64 - the base (an address that wraps below its buffer)."""
    rng = np.random.default_rng(29)
    dst, src, dst_bytes, src_bytes = 0x7F00_0000_0000, 0x20_0000_0000, 1 << 20, 3 << 19
    bases = np.array([[dst], [src], [0]], dtype=np.uint64)
    refused = 0
    for trial in range(400):
        n = int(rng.integers(1, 40))
        sizes = np.full(n, 4096) if trial % 2 else rng.integers(1, 9000, n)
        table = np.stack(
            [rng.integers(0, dst_bytes - 9000, n), rng.integers(0, src_bytes - 9000, n), sizes], axis=1
        ).astype(np.int64)
        if trial % 4 >= 2:  # one bad row
            row, column = int(rng.integers(0, n)), int(rng.integers(0, 3))
            end, base = (dst_bytes, dst) if column == 0 else (src_bytes, src)
            table[row, column] = rng.choice([end, end - int(table[row, 2]) + 1, 0, -1, -base - 4096, -base + 5])
        rows = direct_rows(table)
        try:
            cells, _, _ = direct_table(rows, dst_bytes, src_bytes)
        except InvalidRequest as exc:
            refused += 1
            with pytest.raises(InvalidRequest, match=re.escape(str(exc))):
                direct_pointers(rows, dst, dst_bytes, src, src_bytes, bases)
            continue
        pointers = direct_pointers(rows, dst, dst_bytes, src, src_bytes, bases)
        assert pointers.flags.c_contiguous and pointers.dtype == np.uint64
        assert pointers.tolist() == [(cells[:, 0] + dst).tolist(), (cells[:, 1] + src).tolist(), cells[:, 2].tolist()]
    assert 150 < refused <= 200  # the bad rows, all but a few that land inside by chance


@pytest.fixture
def fake_cuda() -> Iterator[FakeCuda]:
    """The fake CUDA in place of cuda.bindings, one GPU visible: what `DirectCopies` asks."""
    with FakeCuda(device_count=1) as cuda:
        yield cuda


@pytest.mark.usefixtures("fake_cuda")
def test_a_direct_batch_by_dma_hands_the_driver_absolute_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched DMA gets each block's absolute destination and source address and its size (the
    pair's buffers plus the table's offsets), and the batch returns its bytes; a bad table
    reaches no driver call. The driver here is a stand-in that records what it was given."""
    given: list[list[list[int]]] = []
    c = DirectCopies(cast(HoldPage, None), batch_path="dma")
    c._streams[0] = "stream"
    c._batched = types.SimpleNamespace(copy_pointers=lambda pointers, kind, stream: given.append(pointers.tolist()))
    monkeypatch.setattr(c, "_wait", lambda stream: None)
    dst, src = 0x7F00_0000_0000, 0x20_0000_0000
    pair = DirectPair(c, dst, 1 << 20, src, 1 << 20, 0, 0, on_device=(1 << 40, 1 << 42))
    assert c._run_batch(pair, direct_rows([[4096, 0, 100], [0, 8192, 4096]])) == 4196
    assert given == [[[dst + 4096, dst], [src, src + 8192], [100, 4096]]]
    with pytest.raises(InvalidRequest, match="does not fit"):
        c._run_batch(pair, direct_rows([[(1 << 20) - 10, 0, 100]]))
    assert len(given) == 1


@pytest.mark.usefixtures("fake_cuda")
def test_a_direct_batch_takes_the_path_that_was_faster_of_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks that either the copy kernel or batched DMA can carry go by the one whose recent
    batches of that size were faster: the kernel first, DMA once to compare, then the faster,
    the other looked at again once ``explore_s`` has passed and ``explore_every`` batches have
    gone the faster way since the last look (another process's GEMMs make the kernel wait for
    their time slice on the SMs, and stop again). ``batch_path`` "kernel" or "dma": that one only.
    The paths here are stand-ins that take a set time on a clock of the test's own (a loaded
    host's sleeps overshoot by more than the paths' difference); the real ones run in
    tests/test_gpu_direct.py."""
    clock = [1000.0]
    monkeypatch.setattr("priod.client.direct.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    taken: list[str] = []
    took_s = {"kernel": 0.004, "dma": 0.0005}  # the kernel behind another process's GEMMs

    def path(name: str) -> Any:
        def run(*args: Any) -> int:
            taken.append(name)
            clock[0] += took_s[name]
            return 64 << 10

        return run

    def copies(**options: Any) -> DirectCopies:
        c = DirectCopies(cast(HoldPage, None), explore_s=0.2, **options)
        c._kernels[0], c._streams[0] = cast(Any, object()), "stream"  # the kernel loaded, the stream made
        monkeypatch.setattr(c, "_kernel_batch", path("kernel"))
        monkeypatch.setattr(c, "_dma_batch", path("dma"))
        return c

    c = copies(explore_every=3)
    pair = DirectPair(c, 1 << 40, 1 << 20, 1 << 41, 1 << 20, 0, 0, on_device=(1 << 40, 1 << 42), direction="h2d")
    rows = direct_rows(np.array([[0, 0, 16 << 10]] * 4))
    for _ in range(6):
        c._run_batch(pair, rows)
    assert taken == ["kernel", "dma", "dma", "dma", "dma", "dma"]
    (est,) = c.path_estimates()
    assert (
        est.lane == str(H2D)
        and est.express_us is not None
        and est.dma_us is not None
        and est.express_us > 2 * est.dma_us
    )
    clock[0] += 0.25
    took_s["kernel"] = 0.0001  # the GEMMs stopped
    taken.clear()
    for _ in range(5):
        c._run_batch(pair, rows)
    # The kernel looked at again (its figure old), kept as the faster; DMA looked at again only
    # once three batches have gone by the kernel since the last look.
    assert taken == ["kernel", "kernel", "kernel", "dma", "kernel"]
    other = DirectPair(c, 1 << 40, 1 << 20, 1 << 41, 1 << 20, 0, 1, on_device=(1 << 40, 1 << 42), direction="d2h")
    taken.clear()
    c._run_batch(other, rows)
    assert taken == ["kernel"]  # another direction has figures of its own
    big = direct_rows(np.array([[0, 0, 512 << 10]]))
    taken.clear()
    c._run_batch(pair, big)
    assert taken == ["dma"]  # blocks past KERNEL_BLOCK_MAX keep to the copy engines, unmeasured
    for only in ("kernel", "dma"):
        fixed = copies(batch_path=only)
        taken.clear()
        for _ in range(3):
            fixed._run_batch(
                DirectPair(fixed, 1 << 40, 1 << 20, 1 << 41, 1 << 20, 0, 0, on_device=(1 << 40, 1 << 42)), rows
            )
        assert taken == [only] * 3 and fixed.path_estimates() == []
    with pytest.raises(ValueError, match="'fastest', 'kernel' or 'dma'"):
        copies(batch_path="sm")


def test_a_direct_batch_table_is_checked_row_by_row() -> None:
    """`direct_table` accepts exactly the rows that fit: the largest offset plus the largest
    size may overrun when no single row does; a negative figure, a zero size, an offset that
    would wrap past 2**64 and a row past either buffer are refused with what is wrong."""
    rows = np.array([[0, 0, 4096], [4095, 8000, 1]], dtype=np.uint64)  # 4095 + 4096 > 4096, yet each row fits
    cells, total, largest = direct_table(rows, 4096, 8192)
    assert cells is rows and (total, largest) == (4097, 4096)  # a C-ordered uint64 table is not copied
    cells, total, largest = direct_table([[8, 16, 24], [100, 200, 10]], 4096, 8192)
    assert cells.dtype == np.uint64 and cells.tolist() == [[8, 16, 24], [100, 200, 10]] and (total, largest) == (34, 24)
    for bad, why in (
        ([[4095, 0, 2]], "does not fit"),
        ([[0, 8000, 200], [300, 0, 1]], "does not fit"),
        (np.array([[2**64 - 64, 0, 128]], dtype=np.uint64), "below 2\\*\\*62"),
        ([[0, -64, 64]], "offsets >= 0"),
        ([[0, 0, 64], [64, 64, 0]], "nbytes >= 1"),
        ([[0, 0]], "shape"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            direct_table(bad, 4096, 8192)


# -- the scheduler ----------------------------------------------------------------------------
def test_a_held_lane_hands_out_no_bulk_and_a_begun_copy_starts_the_short_bound() -> None:
    sched = Scheduler(Policy(urgent_block_us=100.0), [LaneInfo(H2D, 2e9, 0, 0), LaneInfo(D2H, 2e9, 0, 0)])
    for i, lane in enumerate((H2D, D2H)):
        sched.enqueue(Request(i + 1, "c", lane, "bulk", 64 * MiB, 0.0), 0.0)
    sched.set_holds(frozenset({H2D}), frozenset({H2D}), 0.0)
    chunks = sched.next_chunks(0.0)
    assert chunks and {c.request.lane for c in chunks} == {D2H}  # the other lane runs on
    short = sched.lane_params(H2D).urgent_chunk_bytes
    sched.set_holds(frozenset(), frozenset(), 0.001)
    h2d = [c for c in sched.next_chunks(0.001) if c.request.lane == H2D]
    assert h2d and all(c.nbytes <= short for c in h2d) and all(c.path is Path.DMA for c in h2d)


def test_bulk_dma_chunks_are_gated_where_the_lane_has_a_gate() -> None:
    """A gated chunk is one a direct copy's hold or the daemon's own urgent DMA chunk can still
    stop on the device once queued (`Engine.set_gates`): every bulk DMA chunk on a lane with a
    gate, inside the short bound and outside it; never a strict chunk; none with ``gate_bulk``
    off or on a lane without a gate. Where chunks are gated each takes ``max_block_us`` (an
    urgent copy waits for the running one only); elsewhere ``depth`` of them share it."""
    bw = 2e9
    for gate_bulk, has_gate in ((True, True), (False, True), (True, False)):
        gated = gate_bulk and has_gate
        policy = Policy(urgent_block_us=100.0, urgent_window_ms=10.0, gate_bulk=gate_bulk)
        sched = Scheduler(policy, [LaneInfo(H2D, bw, 0, 0, gate=has_gate)])
        p = sched.lane_params(H2D)
        long_chunk = int(bw * policy.max_block_us / 1e6) // 4096 * 4096
        assert p.chunk_bytes == (long_chunk if gated else long_chunk // policy.depth)
        assert p.inflight_bytes == policy.depth * p.chunk_bytes
        sched.enqueue(Request(1, "c", H2D, "bulk", 64 * MiB, 0.0), 0.0)
        before = sched.next_chunks(0.0)  # no urgent copy seen yet: the long bound
        assert [c.nbytes for c in before] == [p.chunk_bytes] * policy.depth
        assert all(c.gated is gated for c in before)
        sched.set_holds(frozenset(), frozenset({H2D}), 0.001)  # a direct copy began and ended
        for c in before:
            sched.chunk_done(c, 0.002)
        under = sched.next_chunks(0.002)
        assert under and all(c.nbytes <= p.urgent_chunk_bytes and c.gated is gated for c in under)
        sched.enqueue(Request(2, "c", H2D, "urgent", MiB, 0.003), 0.003)
        for c in under:
            sched.chunk_done(c, 0.003)
        strict = [c for c in sched.next_chunks(0.003) if c.strict]
        assert strict and not any(c.gated for c in strict)
        for c in strict:
            sched.chunk_done(c, 0.004)
        after = [c for c in sched.next_chunks(0.5) if not c.strict]  # the window is long past
        assert after and all(c.nbytes == p.chunk_bytes and c.gated is gated for c in after)


def test_a_gated_lane_queues_urgent_queue_us_of_short_chunks_and_an_ungated_one_depth() -> None:
    """Under the short bound a gated lane keeps ``urgent_queue_us`` of short chunks handed out,
    one tenant's included, and no more; a lane without a gate keeps ``depth`` of them, whatever
    ``urgent_queue_us`` says."""
    bw = 55e9
    policy = Policy(urgent_block_us=150.0, beat_block_us=0.0, urgent_queue_us=600.0)
    for has_gate in (True, False):
        sched = Scheduler(policy, [LaneInfo(H2D, bw, 0, 0, gate=has_gate)])
        p = sched.lane_params(H2D)
        sched.set_holds(frozenset(), frozenset({H2D}), 0.0)  # a direct copy began and ended: short bound
        sched.enqueue(Request(1, "c", H2D, "bulk", 1 << 30, 0.001), 0.001)
        chunks = sched.next_chunks(0.001)
        assert chunks and all(c.nbytes == p.urgent_chunk_bytes and c.gated is has_gate for c in chunks)
        queued_us = len(chunks) * p.urgent_chunk_bytes / bw * 1e6
        if has_gate:
            assert 600.0 <= queued_us < 600.0 + p.urgent_chunk_bytes / bw * 1e6
        else:
            assert len(chunks) == policy.depth
        assert sched.next_chunks(0.001) == []  # full: nothing more until one ends
        sched.chunk_done(chunks[0], 0.0011)
        assert [c.nbytes for c in sched.next_chunks(0.0011)] == [p.urgent_chunk_bytes]
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"^\[tuning\] urgent_queue_us = .* is invalid; set a finite number >= 0"):
            validate_policy(Policy(urgent_queue_us=bad))


def test_direct_copies_on_a_beat_give_bulk_gated_long_chunks_between_them() -> None:
    """Clients' direct copies begun every 5 ms (as the daemon's scans see them) make a beat as
    urgent requests do (``beat_block_us``): between the bursts bulk runs beat-bound chunks, gated,
    so that a copy that comes before its beat still stops the queued one on the GPU."""
    sched = Scheduler(Policy(urgent_block_us=150.0, beat_block_us=600.0), [LaneInfo(H2D, 55e9, 0, 0, gate=True)])
    p = sched.lane_params(H2D)
    for k in range(5):
        t = k * 5e-3
        sched.set_holds(frozenset({H2D}), frozenset({H2D}), t)  # begun, and holding
        sched.set_holds(frozenset(), frozenset(), t + 100e-6)  # over
    sched.enqueue(Request(1, "c", H2D, "bulk", 1 << 30, 0.0215), 0.0215)
    chunks = sched.next_chunks(0.0215)
    assert [c.nbytes for c in chunks] == [p.beat_chunk_bytes] * 2 and all(c.gated for c in chunks)
    for c in chunks:
        sched.chunk_done(c, 0.0243)
    near = sched.next_chunks(0.0243)  # 0.75 ms before the next copy is due: the short bound
    short_queue = p.urgent_inflight_bytes // p.urgent_chunk_bytes
    assert [c.nbytes for c in near] == [p.urgent_chunk_bytes] * short_queue and all(c.gated for c in near)


def test_the_pump_closes_a_held_lanes_gate_and_opens_it_when_the_copy_ends() -> None:
    engine = ManualEngine(bandwidth=2e9)
    sched = Scheduler(Policy(), engine.lanes())
    pump = Pump(sched, engine, lambda f: None)
    page = pump.holds.open(1, 1000, [H2D, D2H], time.perf_counter())
    client = HoldPage(os.dup(page.fd), LANES)
    try:
        pump.scan_holds()
        assert engine.gates == []  # nothing held, nothing to tell
        client.begin(client.slot(None, "d2h"))
        pump.scan_holds()
        assert engine.gates == [frozenset({D2H})]
        pump.scan_holds()
        assert engine.gates == [frozenset({D2H})]  # told on a change only
        client.end(client.slot(None, "d2h"))
        pump.scan_holds()
        assert engine.gates == [frozenset({D2H}), frozenset()]
        client.begin(client.slot(None, "h2d"))
        pump.scan_holds()
        pump.stop()  # whatever is queued must be free to drain
        assert engine.gates[-2:] == [frozenset({H2D}), frozenset()]
    finally:
        client.close()
        pump.holds.close(1)
        engine.close()


def test_the_pump_closes_a_lanes_gate_while_its_own_urgent_dma_chunk_is_in_flight() -> None:
    """An urgent DMA chunk of the daemon's own waits for the bulk chunk running only: its lane's
    gate closes before it is submitted and opens when the last such chunk is done, unless a
    client's direct copy still holds the lane."""
    engine = ManualEngine(bandwidth=2e9, express_range=(0, 0))  # every urgent copy by DMA
    sched = Scheduler(Policy(), engine.lanes())
    pump = Pump(sched, engine, lambda f: None)
    mem = types.SimpleNamespace(
        dst_mem=engine.alloc_device(64 * MiB, 0), src_mem=engine.alloc_device(64 * MiB, 0), dst_offset=0, src_offset=0
    )
    page = pump.holds.open(1, 1000, [H2D, D2H], time.perf_counter())
    client = HoldPage(os.dup(page.fd), LANES)
    try:
        sched.enqueue(Request(1, "c", H2D, "bulk", 64 * MiB, 0.0, payload=mem), 0.0)
        pump.kick()
        assert engine.gates == []  # bulk alone: nothing to close
        sched.enqueue(Request(2, "c", H2D, "urgent", 64 << 10, 0.0, payload=mem), 0.0)
        pump.kick()
        urgent = [c for c in engine.pending if c.strict]
        assert len(urgent) == 1 and engine.gates == [frozenset({H2D})]
        # The gate was closed before the urgent chunk went: it is the last chunk submitted.
        assert engine.submitted[-1] is urgent[0]
        client.begin(client.slot(None, "h2d"))  # a client's direct copy holds the lane meanwhile
        pump.scan_holds()
        assert engine.gates == [frozenset({H2D})]  # still closed: told on a change only
        engine.complete_chunk(urgent[0])
        pump._poll()
        assert engine.gates == [frozenset({H2D})]  # the hold keeps it closed
        client.end(client.slot(None, "h2d"))
        pump.scan_holds()
        assert engine.gates == [frozenset({H2D}), frozenset()]
    finally:
        pump.stop()
        client.close()
        pump.holds.close(1)
        engine.close()


def test_an_urgent_chunk_done_after_the_pump_stopped_leaves_its_gate_open() -> None:
    """`Pump.stop` opens every gate so that what is queued drains; an urgent DMA chunk that
    completes after it neither closes a gate again nor breaks the poll."""
    engine = ManualEngine(bandwidth=2e9, express_range=(0, 0))
    sched = Scheduler(Policy(), engine.lanes())
    pump = Pump(sched, engine, lambda f: None)
    mem = types.SimpleNamespace(
        dst_mem=engine.alloc_device(MiB, 0), src_mem=engine.alloc_device(MiB, 0), dst_offset=0, src_offset=0
    )
    try:
        sched.enqueue(Request(1, "c", H2D, "urgent", 64 << 10, 0.0, payload=mem), 0.0)
        pump.kick()
        assert engine.gates == [frozenset({H2D})]
        pump.stop()
        assert engine.gates == [frozenset({H2D}), frozenset()]
        engine.complete_all()
        assert pump._poll()
        assert engine.gates == [frozenset({H2D}), frozenset()]
    finally:
        engine.close()


def test_a_copy_never_ended_keeps_its_lanes_gate_closed_for_hold_max_only() -> None:
    """A hostile page cannot keep a gate closed: the hold is cut after ``direct_hold_max_ms``,
    and the gate opens with it, though the page still says the copy is under way."""
    engine = ManualEngine(bandwidth=2e9)
    sched = Scheduler(Policy(direct_hold_max_ms=20.0), engine.lanes())
    pump = Pump(sched, engine, lambda f: None)
    page = pump.holds.open(1, 1000, [H2D, D2H], time.perf_counter())
    client = HoldPage(os.dup(page.fd), LANES)
    try:
        client.begin(client.slot(None, "h2d"))  # and never ends it
        pump.scan_holds()
        assert engine.gates == [frozenset({H2D})]
        time.sleep(0.03)
        pump.scan_holds()
        assert engine.gates == [frozenset({H2D}), frozenset()]
        assert pump.holds.cut == {H2D: 1}
    finally:
        client.close()
        pump.holds.close(1)
        engine.close()


def test_a_pair_held_ahead_holds_its_lane_from_the_announcement_through_its_copies() -> None:
    """`DirectPair.held`: the lane is held from the block's start, stays held through a copy's
    own announcement inside it, and is free when the block ends (the counters nest)."""
    holds = Holds(hold_max_s=1.0, share=0.25, burst_s=1.0)
    client = page_pair(holds)
    owner = cast(DirectCopies, types.SimpleNamespace(page=client))
    pair = DirectPair(owner, 0, 4096, 0, 4096, 0, client.slot(None, "d2h"))
    with pair.held():
        assert holds.scan(0.001).held == {D2H}
        slot = client.slot(None, "d2h")
        client.begin(slot)  # a copy inside the block, as DirectCopies._run announces it
        assert holds.scan(0.002).held == {D2H}
        client.end(slot)
        assert holds.scan(0.003).held == {D2H}  # the block's hold goes on
    assert holds.scan(0.004).held == frozenset()
    assert holds.copies == {D2H: 2}


# -- end to end, sim daemon -------------------------------------------------------------------
LONG_HOLDS = {
    "PRIOD_LOG__LEVEL": '"warning"',
    "PRIOD_TUNING__DIRECT_HOLD_MAX_MS": "3000",
    "PRIOD_TUNING__DIRECT_HOLD_BURST_MS": "10000",
    "PRIOD_SCHEDULER__URGENT_BUDGET_SHARE": "1.0",
    "PRIOD_SCHEDULER__AGING_MS": "60000",
}


def h2d_bytes(c: priod.SyncClient) -> int:
    return int(c.status()["lane_bytes"].get("gpu0/h2d", 0))


async def test_bulk_waits_while_a_direct_copy_is_announced_and_lands_whole_after() -> None:
    with daemon_process(LONG_HOLDS) as d, priod.SyncClient(d.socket_path, copy_path="daemon") as urgent:
        page = urgent.hold_page()
        slot = page.slot(page.lanes[0]["device_uuid"], "h2d")
        async with await priod.connect(d.socket_path, copy_path="daemon") as bulk:
            host, dev = await bulk.alloc_host(16 * MiB), await bulk.alloc_device(16 * MiB)
            back = await bulk.alloc_host(16 * MiB)
            assert host.array is not None and back.array is not None
            host.array[:] = np.random.default_rng(7).integers(0, 256, 16 * MiB, dtype=np.uint8)
            page.begin(slot)
            copy = asyncio.ensure_future(bulk.copy(dev, host, priority="bulk"))
            await asyncio.sleep(0.3)  # 16 MiB at the sim's 2 GB/s would take 8 ms
            assert not copy.done() and h2d_bytes(urgent) == 0
            assert urgent.status()["direct"]["held"] == ["gpu0/h2d"]
            page.end(slot)
            await asyncio.wait_for(copy, 10)
            await bulk.copy(back, dev, priority="bulk")
            assert np.array_equal(back.array, host.array)
        full = urgent.status()
        st = full["direct"]
        assert st["copies"] == {"gpu0/h2d": 1} and st["held"] == [] and st["pages"] == 1
        assert "direct copies: hold pages 1  held now -  copies gpu0/h2d=1  holds cut -" in format_status(full)
        assert st["stepped_back"] == {} and "stepping back" not in format_status(full)
        # A writer that tears its counters (here: both written back to 0) is named in status,
        # once the daemon looks again (any submission makes it).
        raw = np.frombuffer(page._map, dtype="<u8", count=2 * len(page.lanes))
        raw[2 * slot : 2 * slot + 2] = 0
        small_host, small_dev = urgent.alloc_host(4096), urgent.alloc_device(4096)
        urgent.copy(small_dev, small_host, priority="urgent")
        full = wait_until(
            lambda: (s := urgent.status())["direct"]["stepped_back"] and s, 10, "the step back to be seen"
        )
        assert full["direct"]["stepped_back"] == {"gpu0/h2d": 1} and full["direct"]["copies"] == {"gpu0/h2d": 1}
        assert "counters read stepping back (no copy counted): gpu0/h2d=1" in format_status(full)
        del raw
        page.close()


async def test_a_client_announcing_copies_fast_under_bulk_is_counted_exactly() -> None:
    """A client process announces copies as fast as it can while bulk runs and the daemon scans
    its page on every kick: each copy counts once, none is lost, no counter reads as stepping
    back. (The sim's daemon scans too seldom to catch a torn write reliably; the test that does
    is `test_counters_written_while_the_daemon_scans_never_read_as_copies_not_announced`.)"""
    announced = 50_000
    with daemon_process(LONG_HOLDS) as d, priod.SyncClient(d.socket_path, copy_path="daemon") as watcher:
        async with await priod.connect(d.socket_path, copy_path="daemon") as bulk:
            host, dev = await bulk.alloc_host(4 * MiB), await bulk.alloc_device(4 * MiB)
            streaming = [asyncio.ensure_future(bulk.copy(dev, host, priority="bulk")) for _ in range(4)]
            writer = await asyncio.create_subprocess_exec(
                sys.executable, "-c", ANNOUNCER, d.socket_path, str(announced), stdout=subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(writer.communicate(), 60)
            await asyncio.wait_for(asyncio.gather(*streaming), 30)
        assert writer.returncode == 0 and out.split() == [b"done"]
        st = watcher.status()["direct"]
        assert st["copies"] == {"gpu0/h2d": announced} and st["stepped_back"] == {}


ANNOUNCER = """
import sys, time
import priod
with priod.SyncClient(sys.argv[1], copy_path="daemon") as c:
    page = c.hold_page()
    slot = page.slot(page.lanes[0]["device_uuid"], "h2d")
    n = int(sys.argv[2])
    for _ in range(n):
        page.begin(slot)
        page.end(slot)
    deadline = time.monotonic() + 30  # the daemon has seen them all before the page goes
    while c.status()["direct"]["copies"].get("gpu0/h2d", 0) < n and time.monotonic() < deadline:
        time.sleep(0.01)
print("done")
"""


async def test_a_copy_announced_and_never_ended_delays_bulk_by_hold_max_only() -> None:
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_TUNING__DIRECT_HOLD_MAX_MS": "50"}
    with daemon_process(env) as d, priod.SyncClient(d.socket_path, copy_path="daemon") as urgent:
        page = urgent.hold_page()
        page.begin(page.slot(page.lanes[0]["device_uuid"], "h2d"))  # and never ended
        async with await priod.connect(d.socket_path, copy_path="daemon") as bulk:
            host, dev = await bulk.alloc_host(16 * MiB), await bulk.alloc_device(16 * MiB)
            t0 = time.perf_counter()
            await asyncio.wait_for(bulk.copy(dev, host, priority="bulk"), 10)
            assert time.perf_counter() - t0 >= 0.04  # it was held, for about hold_max
        st = urgent.status()["direct"]
        assert st["cut"] == {"gpu0/h2d": 1} and st["held"] == []


async def test_a_client_that_leaves_mid_copy_releases_its_hold_at_once() -> None:
    with daemon_process(LONG_HOLDS) as d:
        holder = priod.SyncClient(d.socket_path, copy_path="daemon")
        page = holder.hold_page()
        page.begin(page.slot(page.lanes[0]["device_uuid"], "h2d"))
        async with await priod.connect(d.socket_path, copy_path="daemon") as bulk:
            host, dev = await bulk.alloc_host(16 * MiB), await bulk.alloc_device(16 * MiB)
            copy = asyncio.ensure_future(bulk.copy(dev, host, priority="bulk"))
            await asyncio.sleep(0.2)
            assert not copy.done()
            holder.close()  # the page goes with the connection: bulk goes on
            await asyncio.wait_for(copy, 5)
        page.close()
        with priod.SyncClient(d.socket_path, copy_path="daemon") as c:
            wait_until(lambda: c.status()["direct"]["pages"] == 0 or None, 10, "the page to be forgotten")


def test_a_second_hold_page_on_one_connection_is_refused(daemon: priod.testing.DaemonProcess) -> None:
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        page = c.hold_page()
        assert sorted(ln["direction"] for ln in page.lanes) == ["d2h", "h2d"]
        with pytest.raises(InvalidRequest, match="already has its hold page"):
            c.hold_page()
        page.close()


# -- what the daemon times and tells -----------------------------------------------------------
def timed_figures(holds: Holds) -> dict[LaneKey, tuple[list[int], float, list[float]]]:
    return {lane: (t.buckets, t.total_s, list(t.recent)) for lane, t in holds.timed.items()}


def test_direct_copies_one_at_a_time_are_timed_from_the_looks_around_them() -> None:
    """A copy announced alone, with the daemon looking shortly before and after each end, is
    counted and timed: as the longest it can have run (from the look before the scan that saw it
    begin to the scan that saw it over), into the latency buckets and status's p50 / p99."""
    holds = Holds(hold_max_s=1.0, share=1.0, burst_s=1.0)
    client = page_pair(holds)
    slot = client.slot(None, "h2d")
    t = 0.0
    holds.scan(t)
    expected: list[float] = []
    durations = [100e-6 * (k + 1) for k in range(20)] + [0.02]  # 0.1-2 ms, then one of 20 ms
    for d in durations:
        look_before = t
        client.begin(slot)
        t += 10e-6
        holds.scan(t)  # sees it begin
        end_at = t + d
        while t + 100e-6 < end_at:  # under way: the pump looks every loop turn while it holds bulk
            t += 100e-6
            holds.scan(t)
        client.end(slot)
        t = end_at + 10e-6
        holds.scan(t)  # sees it over
        expected.append(t - look_before)
        t += 1e-3
        holds.scan(t)
    times = holds.timed[H2D]
    assert holds.copies == {H2D: len(durations)} and times.count == len(durations) and D2H not in holds.timed
    assert list(times.recent) == pytest.approx(expected, abs=1e-12)
    for got, d in zip(times.recent, durations, strict=True):
        assert d <= got <= d + 2 * 110e-6  # never shorter than the copy, within the looks' spacing
    assert times.total_s == pytest.approx(sum(expected))
    bounds = list(_LATENCY_BUCKETS)
    assert times.buckets == [
        sum(1 for v in expected if i == bisect.bisect_left(bounds, v)) for i in range(len(bounds) + 1)
    ]
    ordered = sorted(expected)
    assert holds.figures()["timed"] == {
        "gpu0/h2d": {"copies": 21, "p50_us": round(ordered[10] * 1e6, 1), "p99_us": round(ordered[20] * 1e6, 1)}
    }


def test_copies_the_looks_do_not_bound_are_counted_and_not_timed() -> None:
    """Counted always, timed only where the looks bound a single copy: several copies between two
    looks (``begun`` jumps by k: k copies), copies that overlap, and copies of a daemon that
    looked seldom (no bulk about) are counted and not timed; a copy between two looks 10 us apart
    is timed at 10 us, the most it can have taken."""
    holds = Holds(hold_max_s=1.0, share=1.0, burst_s=1.0)
    client = page_pair(holds)
    slot = client.slot(None, "d2h")
    holds.scan(0.0)
    for _ in range(3):  # three copies between two looks
        client.begin(slot)
        client.end(slot)
    holds.scan(10e-6)
    assert holds.copies == {D2H: 3} and holds.timed == {}
    client.begin(slot)  # overlapping: a held block with a copy inside it
    holds.scan(20e-6)
    client.begin(slot)
    client.end(slot)
    holds.scan(30e-6)
    client.end(slot)
    holds.scan(40e-6)
    assert holds.copies == {D2H: 5} and holds.timed == {}
    client.begin(slot)  # a copy between looks a second apart: under 1 s is all that is known
    client.end(slot)
    holds.scan(1.0)
    client.begin(slot)  # seen begin, then not looked at for 2 s
    holds.scan(1.00001)
    client.end(slot)
    holds.scan(3.0)
    assert holds.copies == {D2H: 7} and holds.timed == {}
    client.begin(slot)  # begun and over between two looks 10 us apart
    client.end(slot)
    holds.scan(3.00001)
    assert holds.copies == {D2H: 8} and list(holds.timed[D2H].recent) == pytest.approx([10e-6])
    assert holds.figures()["timed"] == {"gpu0/d2h": {"copies": 1, "p50_us": 10.0, "p99_us": 10.0}}


def test_a_uid_that_spends_its_hold_budget_is_told_on_its_pages_until_it_refills() -> None:
    """The daemon's word for a lane reads refused on every page of the uid from the scan at which
    its bucket runs empty (and the daemon stops holding for it) until the bucket has refilled to
    ``regrant_s``, found by the scans though the pages stay idle meanwhile; other lanes and other
    uids read granted throughout, and a page the uid opens meanwhile reads refused from the start."""
    holds = Holds(hold_max_s=0.005, share=0.25, burst_s=0.010)
    assert holds.regrant_s == 0.005
    a, b = page_pair(holds, owner=1), page_pair(holds, owner=2)
    other = page_pair(holds, owner=3, uid=2000)
    h2d, d2h = a.slot(None, "h2d"), a.slot(None, "d2h")
    bucket = holds._buckets[(1000, H2D)]
    t = 0.0
    while not a.refused(h2d):  # 1 ms copies, 0.1 ms apart: 4x faster than the budget refills
        assert bucket.tokens > 0
        a.begin(h2d)
        t += 0.0001
        assert holds.scan(t).held == {H2D}
        a.end(h2d)
        t += 0.001
        holds.scan(t)
        assert t < 0.1
    assert bucket.tokens <= 0 and b.refused(h2d)  # the uid's other connection is told too
    assert not a.refused(d2h) and not other.refused(h2d)
    a.begin(h2d)  # a copy announced now is not held, as the word said
    t += 0.0001
    assert holds.scan(t).held == frozenset()
    a.end(h2d)
    t += 0.0001
    holds.scan(t)
    late = page_pair(holds, owner=4)
    assert late.refused(h2d)  # told at open
    refilled = bucket.at + (holds.regrant_s - bucket.tokens) / holds.share
    while t < refilled - 0.001:  # the pages stay idle: the scans skip them
        t += 0.001
        holds.scan(t)
        assert a.refused(h2d) and b.refused(h2d) and late.refused(h2d)
    holds.scan(refilled + 1e-6)
    assert not a.refused(h2d) and not b.refused(h2d) and not late.refused(h2d)
    b.begin(h2d)  # and it holds again
    assert holds.scan(refilled + 0.001).held == {H2D}
    assert holds.figures()["refused"] == {}


def test_a_uid_on_the_edge_of_its_hold_budget_holds_but_starts_no_short_bound() -> None:
    """A uid told refused holds only within what its bucket refills, and its copies no longer put
    the lane on its short bound until it reads granted again: a client announcing copies on the
    edge of its budget would otherwise keep bulk on short chunks between its holds. Another uid's
    copy still starts the short bound meanwhile."""
    holds = Holds(hold_max_s=0.005, share=0.25, burst_s=0.010)
    a, other = page_pair(holds, owner=1), page_pair(holds, owner=2, uid=2000)
    slot = a.slot(None, "h2d")
    bucket = holds._buckets[(1000, H2D)]
    t = 0.0
    while not a.refused(slot):  # 1 ms copies back to back: 4x faster than the budget refills
        a.begin(slot)
        holds.scan(t)
        t += 0.001
        a.end(slot)
        holds.scan(t)
        assert t < 0.1
    t += (holds.regrant_s / 2 - bucket.tokens) / holds.share  # refilled halfway to regrant_s
    a.begin(slot)
    scan = holds.scan(t)
    assert 0 < bucket.tokens < holds.regrant_s and a.refused(slot)
    assert scan.held == {H2D} and scan.begun == frozenset()  # held within its tokens, no short bound
    a.end(slot)
    other.begin(other.slot(None, "h2d"))
    t += 0.0001
    assert holds.scan(t).begun == {H2D}
    other.end(other.slot(None, "h2d"))
    t += 0.0001
    holds.scan(t)
    t += holds.regrant_s / holds.share  # refilled past regrant_s: granted, and a copy starts it again
    holds.scan(t)
    assert not a.refused(slot)
    a.begin(slot)
    assert holds.scan(t + 0.0001).begun == {H2D}


# -- the lane's total over all uids -------------------------------------------------------------
STEP_S = 0.00025
"""The scans of `take_turns`: every 250 us."""


def take_turn(pages: list[HoldPage], step: int, open_: list[bool]) -> None:
    """Step ``step`` of uids taking turns on h2d, one page each: every 60 ms each takes a turn of
    15 ms (7.5 ms with more than four, so that the lane is wanted throughout), 0.25 of the time or
    less, its own budget; through its turn it announces 1-ms copies back to back."""
    period = 240  # steps: 60 ms
    turn = min(60, period // len(pages))
    phase = step % period
    whose = phase // turn if phase < turn * len(pages) else -1
    if step % 4:
        return
    for k, page in enumerate(pages):
        slot = page.slot(None, "h2d")
        if open_[k]:
            page.end(slot)
            open_[k] = False
        if k == whose:
            page.begin(slot)
            open_[k] = True


def take_turns(holds: Holds, uids: int, seconds: float = 2.0) -> list[bool]:
    """``uids`` uids take turns (`take_turn`) for ``seconds``: whether the lane was held at each
    scan (held from one scan to the next)."""
    pages = [page_pair(holds, owner=k + 1, uid=1000 + k) for k in range(uids)]
    open_ = [False] * uids
    held = []
    for step in range(round(seconds / STEP_S)):
        take_turn(pages, step, open_)
        held.append(H2D in holds.scan(step * STEP_S).held)
    return held


@pytest.mark.parametrize("uids", [1, 3, 8])
def test_uids_taking_turns_hold_a_lane_for_the_total_share_at_most(uids: int) -> None:
    """Holds add up over uids: each uid here holds within its own budget (0.25 of the time), and
    without a bound on the total three of them held the lane 0.75 of the time, eight of them all
    of it. All uids together hold it for ``total_share`` at most (its burst past that over 2 s),
    and use what it allows; no uid's own budget runs out."""
    holds = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=0.5)
    held = take_turns(holds, uids)
    fraction = sum(held) / len(held)
    assert fraction <= 0.5 + 0.05 / 2 + 0.005
    if uids > 1:
        assert fraction >= 0.45  # the total is used, not undercut
    else:
        assert fraction == pytest.approx(0.25, abs=0.01)
    assert holds.figures()["refused"] == {}  # every uid within its own budget


def test_one_uid_alone_holds_as_without_a_total() -> None:
    """One uid's holds are bounded by its own budget (0.25 of the time) before the lane's total
    (0.5): with the total, its holds, its budget and its pages' words are as without one."""
    bounded = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=0.5)
    unbounded = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=1.0)
    flooding = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=0.5)
    assert take_turns(bounded, 1) == take_turns(unbounded, 1)
    assert bounded._buckets[(1000, H2D)].tokens == unbounded._buckets[(1000, H2D)].tokens
    # A uid that holds all it can (a copy never ended, announced again each 5 ms) runs out of its
    # own budget first: refused and held exactly as without a total.
    seen: list[list[tuple[bool, bool]]] = []
    for holds in (flooding, Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=1.0)):
        client = page_pair(holds)
        slot = client.slot(None, "h2d")
        trace: list[tuple[bool, bool]] = []
        for step in range(8000):
            if step % 20 == 0:
                if step:
                    client.end(slot)
                client.begin(slot)
            trace.append((H2D in holds.scan(step * STEP_S).held, client.refused(slot)))
        assert holds.figures()["refused_lanes"] == []
        seen.append(trace)
    assert seen[0] == seen[1] and any(refused for _, refused in seen[0])


def test_a_spent_lane_total_is_told_on_every_page_of_the_lane_until_it_refills() -> None:
    """When the uids together have spent the lane's total, every page's word for that lane reads
    refused, whatever its uid (one that never held, a page opened meanwhile too), and no copy
    holds the lane; the other lane reads granted. Once the total has refilled to ``regrant_s``
    (found by the scans though the pages stay idle) they all read granted, and copies hold again."""
    holds = Holds(hold_max_s=0.005, share=0.25, burst_s=0.05, total_share=0.5)
    pages = [page_pair(holds, owner=k + 1, uid=1000 + k) for k in range(3)]
    second = page_pair(holds, owner=10, uid=1000)  # the first uid's other connection
    idle = page_pair(holds, owner=11, uid=5000)  # a uid that never announces
    everyone = [*pages, second, idle]
    open_ = [False] * 3
    whole = holds._lanes[H2D]
    step = 0
    flips = 0
    was = False
    for step in range(8000):  # 2 s of turns: the total runs out, refills, and runs out again
        take_turn(pages, step, open_)
        holds.scan(step * STEP_S)
        words = {page.refused(page.slot(None, "h2d")) for page in everyone}
        assert words == {whole.refused}  # every page of the lane reads the same
        assert not any(page.refused(page.slot(None, "d2h")) for page in everyone)
        flips += whole.refused != was
        was = whole.refused
        if was:
            assert holds.held == frozenset()
    assert flips >= 4  # refused and granted again, more than once
    while not whole.refused:
        step += 1
        take_turn(pages, step, open_)
        holds.scan(step * STEP_S)
    assert holds.figures()["refused_lanes"] == ["gpu0/h2d"] and holds.figures()["refused"] == {}
    late = page_pair(holds, owner=12, uid=6000)
    assert late.refused(late.slot(None, "h2d")) and not late.refused(late.slot(None, "d2h"))  # told at open
    for k, page in enumerate(pages):
        if open_[k]:
            page.end(page.slot(None, "h2d"))
    t = step * STEP_S
    refilled = whole.at + (holds.regrant_s - whole.tokens) / holds.total_share
    while t < refilled - 0.001:  # the pages stay idle: the scans skip them
        t += 0.001
        holds.scan(t)
        assert all(page.refused(page.slot(None, "h2d")) for page in [*everyone, late])
    holds.scan(refilled + 1e-6)
    assert not any(page.refused(page.slot(None, "h2d")) for page in [*everyone, late])
    assert holds.figures()["refused_lanes"] == []
    idle.begin(idle.slot(None, "h2d"))  # and copies hold again
    assert holds.scan(refilled + 0.001).held == {H2D}


def test_what_a_client_writes_in_the_daemons_half_changes_nothing_the_daemon_decides() -> None:
    """Two daemons see the same copies announced; on one of them the client also writes random
    words over the daemon's half of its page before every scan. Both decide the same (held lanes,
    begun lanes, copies, cuts, budgets, timings, refusals) and write the same words at the same
    scans; the daemon writes a word only when its refusal changes, and never reads it back (the
    client's garbage stays where nothing changed)."""
    rng = np.random.default_rng(11)
    honest, spoiled = (Holds(hold_max_s=0.005, share=0.25, burst_s=0.004) for _ in range(2))
    ours, theirs = page_pair(honest), page_pair(spoiled)
    garbage = np.frombuffer(theirs._map, dtype="<u8")[HOLD_DAEMON_WORD:]
    told = np.frombuffer(ours._map, dtype="<u8")[HOLD_DAEMON_WORD : HOLD_DAEMON_WORD + 2]
    values = np.array([0, 1, 2, 2**63, 2**64 - 1], dtype=np.uint64)
    open_ = [False, False]
    changes = 0
    for step in range(3000):
        slot = int(rng.integers(0, 2))
        busy = step // 500 % 2 == 0  # 100 ms of copies, then 100 ms for the budgets to refill
        if (rng.random() < 0.3) if busy else open_[slot]:
            for page in (ours, theirs):
                (page.end if open_[slot] else page.begin)(slot)
            open_[slot] = not open_[slot]
        garbage[:] = rng.choice(values, size=garbage.shape)
        written = garbage[:2].copy()
        before = told.copy()
        now = step * 0.0002
        assert honest.scan(now) == spoiled.scan(now)
        changed = told != before
        changes += int(changed.sum())
        assert np.array_equal(garbage[:2], np.where(changed, told, written))  # written on a change only
        assert (honest.copies, honest.cut, honest.stepped_back) == (spoiled.copies, spoiled.cut, spoiled.stepped_back)
        assert timed_figures(honest) == timed_figures(spoiled)
    assert changes >= 4 and honest.timed and honest.cut  # refused and granted again, more than once
    for key, bucket in honest._buckets.items():
        twin = spoiled._buckets[key]
        assert (bucket.tokens, bucket.at, bucket.refused) == (twin.tokens, twin.at, twin.refused)
    del garbage, told


def test_a_page_without_the_daemons_half_reads_granted() -> None:
    """A daemon older than the daemon's half made the client's 4096 bytes alone: the client maps
    what there is, announces as before, and reads every slot as granted."""
    fd = os.memfd_create("old-page", os.MFD_CLOEXEC)
    os.ftruncate(fd, HOLD_CLIENT_BYTES)
    check = os.dup(fd)
    try:
        page = HoldPage(fd, LANES)
        page.begin(1)
        assert not page.refused(0) and not page.refused(1)
        assert np.frombuffer(os.pread(check, 32, 0), dtype="<u8").tolist() == [0, 0, 1, 0]
        page.close()
    finally:
        os.close(check)


def test_a_uid_past_its_hold_budget_reads_refused_through_the_daemon_and_granted_after() -> None:
    """End to end: a client that announces more copies than its hold budget covers reads refused
    on that lane once the daemon has looked (a status looks), and granted again once the budget has
    refilled; its other lane reads granted throughout."""
    env = {
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_TUNING__DIRECT_HOLD_BURST_MS": "2",
        "PRIOD_SCHEDULER__URGENT_BUDGET_SHARE": "0.1",
    }
    with daemon_process(env) as d, priod.SyncClient(d.socket_path, copy_path="daemon") as c:
        page = c.hold_page()
        uuid = page.lanes[0]["device_uuid"]
        h2d, d2h = page.slot(uuid, "h2d"), page.slot(uuid, "d2h")
        assert not page.refused(h2d)
        for _ in range(50):  # 2.5 ms of charges against a 2 ms budget
            page.begin(h2d)
            page.end(h2d)
        st = c.status()["direct"]
        assert page.refused(h2d) and not page.refused(d2h)
        assert st["refused"] == {"gpu0/h2d": 1} and st["copies"] == {"gpu0/h2d": 50}
        wait_until(lambda: c.status() and not page.refused(h2d), 10, "the budget to refill")
        assert c.status()["direct"]["refused"] == {} and not page.refused(d2h)
        page.close()


async def test_a_hold_doorbell_wakes_a_sleeping_daemon_to_read_the_page() -> None:
    """With ``urgent_poll = "timer"`` the daemon does not scan hold pages every loop turn; the
    client's `HoldPage.begin` writes the page's doorbell, and the daemon closes the lane's gate
    at once (here: within 10 ms, on a lane whose next poll is a 50-ms bulk chunk's end)."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    # A slow link (0.02 GB/s) and 50-ms bulk chunks: the daemon has no poll due for tens of ms.
    cfg = load_config(None, environ={}).replace(
        server={"socket": path, "urgent_poll": "timer"},
        scheduler={"max_block_us": 50_000},
        sim={"h2d_gbps": 0.02},
        log={"level": "warning"},
    )
    engine = SimEngine(cfg.sim)
    engine.wakes_on_completion = False
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            nbytes = 8 << 20
            h, d = await c.alloc_host(nbytes), await c.alloc_device(nbytes)
            page = await c.hold_page()
            assert page._doorbell is not None  # the client asked for one, and this daemon has it
            bulk = c.start_copy(d, h, priority="bulk")
            await asyncio.sleep(0.05)
            lane = next(i.key for i in engine.lanes() if i.key.direction is Direction.H2D)
            slot = next(
                i for i, ln in enumerate(page.lanes) if ln["direction"] == "h2d" and ln["device"] == lane.device
            )
            assert lane not in daemon.pump._gates_closed
            page.begin(slot)
            t0 = time.perf_counter()
            while lane not in daemon.pump._gates_closed and time.perf_counter() - t0 < 1.0:
                await asyncio.sleep(0.0005)
            seen_after = time.perf_counter() - t0
            page.end(slot)
            page.close()
            assert (await bulk).nbytes == nbytes
        assert seen_after < 0.01, seen_after
    finally:
        await daemon.stop()
