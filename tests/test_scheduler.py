"""The scheduler's promise, tested on its own: no engine, no clock, a FIFO-per-lane fake."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.sched.policy import ClassSpec, LaneParams, Policy, lane_params
from priod.daemon.sched.scheduler import (
    Chunk,
    Finished,
    LaneStats,
    Request,
    RequestState,
    Scheduler,
)
from priod.errors import ConfigError, EngineError, InvalidRequest, NotFound

L0 = LaneKey(0, Direction.H2D)
L1 = LaneKey(0, Direction.D2H)
# 16.384 MB/s with max_block_us=1000: 16 KiB in flight, as 2 chunks of 8 KiB. Small figures keep
# the tests fast; the logic does not care about scale (see test_urgent_waits_at_most_inflight).
INFO0 = LaneInfo(L0, bandwidth=16_384_000, express_min=512, express_max=4096)
INFO1 = LaneInfo(L1, bandwidth=16_384_000, express_min=0, express_max=0)
CHUNK = 8192
BOUND = 16384
POLICY = Policy(min_chunk_bytes=4096, urgent_block_us=0, beat_block_us=0)
"""The long bound throughout (the short one after urgent copies, and the beat's, are tested on
their own below and in test_path_choice.py)."""


def req(
    rid: int,
    cls: str = "bulk",
    nbytes: int = CHUNK,
    lane: LaneKey = L0,
    owner: Hashable = "a",
    arrival: float = 0.0,
    deadline: float | None = None,
) -> Request:
    return Request(rid, owner, lane, cls, nbytes, arrival, deadline)


class Sim:
    """A fake engine: DMA chunks complete in submission order per lane, express ones at will."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.dma: dict[LaneKey, deque[Chunk]] = {L0: deque(), L1: deque()}
        self.express: deque[Chunk] = deque()
        self.log: list[Chunk] = []
        self.finished: list[Finished] = []

    def pump(self, now: float) -> list[Chunk]:
        chunks = self.s.next_chunks(now)
        for c in chunks:
            (self.express if c.path is Path.EXPRESS else self.dma[c.request.lane]).append(c)
        self.log.extend(chunks)
        return chunks

    def complete(self, lane: LaneKey, now: float, error: Exception | None = None) -> Chunk:
        c = self.dma[lane].popleft()
        self.finished += self.s.chunk_done(c, now, error)
        return c

    def complete_express(self, now: float) -> Chunk:
        c = self.express.popleft()
        self.finished += self.s.chunk_done(c, now)
        return c

    def drain(self, now: float, dt: float = 0.001) -> float:
        """Pump and complete until the scheduler is idle; returns the final time."""
        for _ in range(100_000):
            self.pump(now)
            if self.s.idle:
                return now
            while self.express:
                self.complete_express(now)
            for lane in (L0, L1):
                if self.dma[lane]:
                    self.complete(lane, now)
            now += dt
        raise AssertionError("the scheduler never went idle")

    def bytes_in_flight(self, lane: LaneKey, strict: bool) -> int:
        return sum(c.nbytes for c in self.dma[lane] if c.strict == strict)


def lane_stats(s: Scheduler, lane: LaneKey) -> LaneStats:
    (found,) = [ls for ls in s.statistics().lanes if ls.lane == str(lane)]
    return found


def make(policy: Policy = POLICY) -> tuple[Scheduler, Sim]:
    s = Scheduler(policy, [INFO1, INFO0])
    return s, Sim(s)


# --- lane parameters -------------------------------------------------------------------------


def test_lane_params_from_bandwidth() -> None:
    """55 GB/s, 1000 us, depth 2 gives 27.5 MB chunks rounded down to 4 KiB, two in flight;
    150 us (urgent recent) 4.1 MB chunks; 4000 us (bulk batches) 110 MB chunks; 600 us (between
    the bursts of an urgent beat, the default) 16.5 MB chunks, 600 us in flight."""
    info = LaneInfo(L0, bandwidth=55e9, express_min=4096, express_max=1 << 20)
    p = lane_params(info, Policy(max_block_us=1000.0, depth=2, urgent_block_us=150.0, batch_block_us=4000.0))
    beat = 16_498_688
    assert p == LaneParams(
        27_496_448,
        2 * 27_496_448,
        4096,
        1 << 20,
        4_124_672,
        2 * 4_124_672,
        109_998_080,
        2 * 109_998_080,
        beat,
        2 * beat,
    )
    assert p.chunk_bytes % 4096 == 0


def test_lane_params_floor_and_express_off() -> None:
    """A slow lane gets min_chunk_bytes chunks; express=False removes the express range."""
    info = LaneInfo(L0, bandwidth=1e6, express_min=4096, express_max=1 << 20)
    p = lane_params(info, Policy(express=False))
    assert (p.chunk_bytes, p.inflight_bytes, p.express_max) == (256 * 1024, 512 * 1024, 0)


def test_scheduler_lane_params_and_unknown_lane() -> None:
    """Scheduler.lane_params answers per lane and names the known lanes for an unknown one."""
    s, _ = make()
    assert s.lane_params(L0) == LaneParams(
        CHUNK, BOUND, 512, 4096, CHUNK, BOUND, 4 * CHUNK, 4 * BOUND
    )  # batches: 4 ms, not 1
    assert s.lane_params(L1).express_max == 0
    with pytest.raises(InvalidRequest, match=r"^no lane gpu5/h2d; the lanes are gpu0/d2h, gpu0/h2d$"):
        s.lane_params(LaneKey(5, Direction.H2D))


def test_bad_policy_is_refused() -> None:
    """A policy with duplicate class names is a ConfigError that says what to fix."""
    bad = Policy(classes=(ClassSpec("bulk"), ClassSpec("bulk")))
    with pytest.raises(ConfigError, match=r"^class names must be unique, got bulk, bulk; "):
        Scheduler(bad, [INFO0])


def test_set_policy_refuses_what_config_refuses() -> None:
    """set_policy runs the same validator as config loading, with the same messages."""
    s, _ = make()
    with pytest.raises(ConfigError, match=r"^\[tuning\] depth = 0 is invalid; set 1 <= depth <= 64$"):
        s.set_policy(Policy(depth=0))
    with pytest.raises(ConfigError, match=r"^\[classes\] needs at least one class without strict = true"):
        s.set_policy(Policy(classes=(ClassSpec("urgent", strict=True),)))
    assert s.policy == POLICY


# --- validation ------------------------------------------------------------------------------


def test_enqueue_validates_class_lane_size_and_id() -> None:
    """Unknown class or lane, an empty copy and a duplicate id are InvalidRequest."""
    s, _ = make()
    with pytest.raises(InvalidRequest, match=r"^unknown class 'vip'; the classes are urgent, high, normal, bulk$"):
        s.enqueue(req(1, cls="vip"), 0.0)
    with pytest.raises(InvalidRequest, match=r"^no lane gpu1/d2d; the lanes are "):
        s.enqueue(req(1, lane=LaneKey(1, Direction.D2D)), 0.0)
    with pytest.raises(InvalidRequest, match=r"^a copy of 0 bytes is invalid; nbytes must be > 0$"):
        s.enqueue(req(1, nbytes=0), 0.0)
    s.enqueue(req(1), 0.0)
    with pytest.raises(InvalidRequest, match=r"^copy id 1 is already queued or in flight; use a fresh id$"):
        s.enqueue(req(1), 0.0)


# --- strict first ----------------------------------------------------------------------------


def test_urgent_goes_ahead_of_queued_bulk() -> None:
    """An urgent copy enqueued behind a bulk backlog is the first chunk of the very next call."""
    s, sim = make()
    s.enqueue(req(1, nbytes=100 * CHUNK), 0.0)
    assert [c.nbytes for c in sim.pump(0.0)] == [CHUNK, CHUNK]
    sim.complete(L0, 0.001)  # frees one bulk slot
    s.enqueue(req(2, cls="urgent", nbytes=CHUNK), 0.001)
    chunks = sim.pump(0.001)
    # Bulk is held until the urgent chunk lands (it would otherwise be drained first).
    assert [(c.request.id, c.strict) for c in chunks] == [(2, True)]
    assert s.strict_in_flight


def test_urgent_waits_at_most_inflight_bytes() -> None:
    """At 55 GB/s and defaults, a 1 MiB urgent copy completes after at most inflight bytes of bulk."""
    info = LaneInfo(L0, bandwidth=55e9, express_min=0, express_max=0)
    s = Scheduler(Policy(), [info, INFO1])
    sim = Sim(s)
    bound = s.lane_params(L0).inflight_bytes
    s.enqueue(req(1, nbytes=2 << 30), 0.0)
    sim.pump(0.0)
    s.enqueue(req(2, cls="urgent", nbytes=1 << 20), 0.0)
    assert [c.request.id for c in sim.pump(0.0)] == [2]
    bulk_before = 0
    while True:
        c = sim.complete(L0, 0.0)
        if c.request.id == 2:
            break
        bulk_before += c.nbytes
        sim.pump(0.0)
    assert 0 < bulk_before <= bound
    assert [f.request.id for f in sim.finished] == [2]


def test_multi_chunk_urgent_holds_bulk_back() -> None:
    """While urgent has unsent bytes, no bulk chunk is handed out; strict DMA keeps its own bound."""
    s, sim = make()
    s.enqueue(req(1, nbytes=10 * CHUNK), 0.0)
    s.enqueue(req(2, cls="urgent", nbytes=5 * CHUNK), 0.0)
    first = sim.pump(0.0)
    assert [(c.request.id, c.offset) for c in first] == [(2, 0), (2, CHUNK)]
    for step in range(2):
        sim.complete(L0, 0.001 * step)
        assert [c.request.id for c in sim.pump(0.001 * step)] == [2]
    # The urgent copy's last chunk goes out; bulk waits until no urgent chunk is in flight.
    sim.complete(L0, 0.01)
    assert [(c.request.id, c.offset) for c in sim.pump(0.01)] == [(2, 4 * CHUNK)]
    assert sim.bytes_in_flight(L0, strict=True) <= BOUND


def test_express_path_within_range() -> None:
    """Urgent copies within the lane's express range go whole on the express path, unbounded."""
    s, sim = make()
    s.enqueue(req(1, nbytes=100 * CHUNK), 0.0)
    sim.pump(0.0)
    s.enqueue(req(2, cls="urgent", nbytes=4096), 0.0)
    s.enqueue(req(3, cls="urgent", nbytes=512), 0.0)
    chunks = sim.pump(0.0)
    assert [(c.request.id, c.path, c.nbytes, c.strict) for c in chunks] == [
        (2, Path.EXPRESS, 4096, True),
        (3, Path.EXPRESS, 512, True),
    ]
    lane = lane_stats(s, L0)
    assert (lane.express_inflight_bytes, lane.inflight_bytes, lane.strict_inflight_bytes) == (4608, BOUND, 0)
    fin = s.chunk_done(chunks[0], 0.0001)
    assert fin[0].outcome == "done" and fin[0].request.path is Path.EXPRESS


@pytest.mark.parametrize(
    ("nbytes", "lane", "policy"),
    [
        (511, L0, POLICY),  # below express_min: DMA is faster
        (4097, L0, POLICY),  # above express_max
        (4096, L1, POLICY),  # the lane has no express path
        (4096, L0, Policy(min_chunk_bytes=4096, express=False, urgent_block_us=0)),
    ],
)
def test_urgent_outside_express_range_uses_dma(nbytes: int, lane: LaneKey, policy: Policy) -> None:
    """Urgent copies outside the express range (or with express off) go by DMA."""
    s, sim = make(policy)
    s.enqueue(req(1, cls="urgent", nbytes=nbytes, lane=lane), 0.0)
    (c,) = sim.pump(0.0)
    assert (c.path, c.strict, c.nbytes) == (Path.DMA, True, nbytes)
    assert c.request.path is Path.DMA


# --- the in-flight bound, tiling and exactly-once finish, under random traffic ---------------

CLASSES = ("urgent", "high", "normal", "bulk")
op = st.one_of(
    st.tuples(
        st.just("enq"),
        st.sampled_from(CLASSES),
        st.sampled_from((L0, L1)),
        st.integers(1, 5 * CHUNK),
        st.booleans(),
        st.sampled_from(("a", "b")),
    ),
    st.tuples(st.just("done"), st.sampled_from((L0, L1))),
    st.tuples(st.just("fail"), st.sampled_from((L0, L1))),
    st.tuples(st.just("express")),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("drop"), st.sampled_from(("a", "b"))),
    st.tuples(st.just("tick"), st.floats(0.0, 0.3)),
    st.tuples(st.just("reload"), st.integers(1, 9)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=60))
def test_random_traffic_keeps_the_promise(ops: list[tuple[object, ...]]) -> None:
    """Under random traffic the bound holds, chunks tile each copy once, each copy finishes once."""
    s, sim = make()
    now = 0.0
    ids: list[int] = []
    cancelled: set[int] = set()
    for o in ops:
        kind = o[0]
        if kind == "enq":
            _, cls, lane, nbytes, has_deadline, owner = o
            rid = len(ids) + 1
            assert isinstance(cls, str) and isinstance(lane, LaneKey) and isinstance(nbytes, int)
            s.enqueue(req(rid, cls, nbytes, lane, owner, now, now + 0.01 if has_deadline else None), now)
            ids.append(rid)
        elif kind in ("done", "fail"):
            lane = o[1]
            assert isinstance(lane, LaneKey)
            if sim.dma[lane]:
                sim.complete(lane, now, EngineError("injected") if kind == "fail" else None)
        elif kind == "express":
            if sim.express:
                sim.complete_express(now)
        elif kind == "cancel":
            k = o[1]
            assert isinstance(k, int)
            if k < len(ids):
                r = s.get(ids[k])
                if r is None or r.state in (RequestState.CANCELLED, RequestState.FAILED):
                    with pytest.raises(NotFound):
                        s.cancel(ids[k], now)
                else:
                    fin = s.cancel(ids[k], now)
                    cancelled.add(ids[k])
                    if fin is not None:
                        sim.finished.append(fin)
        elif kind == "drop":
            owner = o[1]
            assert isinstance(owner, str)
            for rid in ids:
                r = s.get(rid)
                if r is not None and r.owner == owner and r.state not in (RequestState.CANCELLED, RequestState.FAILED):
                    cancelled.add(rid)
            sim.finished += s.drop_owner(owner, now)
        elif kind == "tick":
            dt = o[1]
            assert isinstance(dt, float)
            now += dt
        elif kind == "reload":
            w = o[1]
            assert isinstance(w, int)
            classes = (
                ClassSpec("urgent", strict=True),
                ClassSpec("high", w),
                ClassSpec("normal", 4),
                ClassSpec("bulk"),
            )
            s.set_policy(Policy(min_chunk_bytes=4096, urgent_block_us=0, classes=classes))
        sim.pump(now)
        for lane in (L0, L1):
            assert sim.bytes_in_flight(lane, strict=False) <= BOUND
            assert sim.bytes_in_flight(lane, strict=True) <= BOUND
            assert lane_stats(s, lane).inflight_bytes == sim.bytes_in_flight(lane, strict=False)
    sim.drain(now)

    assert s.idle and not s.has_queued and not s.strict_in_flight
    by_id = Counter(f.request.id for f in sim.finished)
    assert sorted(by_id) == ids and set(by_id.values()) <= {1}
    spans: dict[int, list[tuple[int, int]]] = {}
    for c in sim.log:
        spans.setdefault(c.request.id, []).append((c.offset, c.nbytes))
    for f in sim.finished:
        r = f.request
        got = spans.get(r.id, [])
        # Chunks come in offset order and tile a prefix of the copy, each byte once.
        end = 0
        for offset, nbytes in got:
            assert offset == end and nbytes > 0
            end += nbytes
        assert end == r.submitted_bytes <= r.nbytes
        assert s.get(r.id) is None
        if f.outcome == "done":
            assert end == r.nbytes == f.bytes_done and r.id not in cancelled
        elif f.outcome == "cancelled":
            assert r.id in cancelled and f.bytes_done <= end
        else:
            assert isinstance(f.error, EngineError) and f.bytes_done < r.nbytes
    assert sum(s.statistics().finished.values()) == len(ids)


# --- weights, aging, deadlines ---------------------------------------------------------------


def test_weights_shape_long_run_byte_shares() -> None:
    """With high, normal and bulk all backlogged, byte shares follow weights 8:4:1 within 5%."""
    s, sim = make()
    rid = 0
    for cls in ("high", "normal", "bulk"):
        for _ in range(40):
            rid += 1
            s.enqueue(req(rid, cls, nbytes=32 * CHUNK + 100), 0.0)
    sim.pump(0.0)
    for step in range(13 * 80):
        sim.complete(L0, step * 1e-4)
        sim.pump(step * 1e-4)
    got: Counter[str] = Counter()
    for c in sim.log:
        got[c.request.cls] += c.nbytes
    total = sum(got.values())
    for cls, weight in (("high", 8), ("normal", 4), ("bulk", 1)):
        assert got[cls] / total == pytest.approx(weight / 13, rel=0.05)


def test_deficit_resets_when_a_class_runs_dry() -> None:
    """A class that empties keeps no credit: a lone bulk copy later does not get a burst."""
    s, sim = make()
    s.enqueue(req(1, "bulk", nbytes=CHUNK // 2), 0.0)
    sim.drain(0.0)
    lane_cq = s._lanes[L0].classes["bulk"]
    assert lane_cq.deficit == 0


def test_aging_prevents_starvation_under_urgent_flood() -> None:
    """Under a continuous urgent flood, bulk gets one chunk per aging_ms and eventually finishes."""
    policy = Policy(min_chunk_bytes=4096, aging_ms=200.0, urgent_block_us=0)
    s = Scheduler(policy, [LaneInfo(L0, 16_384_000, 0, 0)])
    sim = Sim(s)
    s.enqueue(req(1, "bulk", nbytes=4 * CHUNK), 0.0)
    rid = 1
    bulk_times: list[float] = []
    now = 0.0
    while not any(f.request.id == 1 for f in sim.finished):
        assert now < 2.0, "bulk starved"
        for _ in range(3):  # more urgent work arrives than the lane drains: always a backlog
            rid += 1
            s.enqueue(req(rid, "urgent", nbytes=CHUNK, arrival=now), now)
        bulk_times += [now for c in sim.pump(now) if c.request.id == 1]
        sim.complete(L0, now)
        now = round(now + 0.001, 6)
    assert len(bulk_times) == 4
    assert bulk_times[0] > 0.2  # held back while urgent work waits, until it has aged
    gaps = [b - a for a, b in itertools.pairwise(bulk_times)]
    assert all(0.2 < g < 0.21 for g in gaps)


def test_deadlines_edf_within_class_and_misses_counted() -> None:
    """Within a class, deadlines go first, earliest first, then FIFO; late finishes are counted."""
    s, sim = make()
    s.enqueue(req(1), 0.0)
    s.enqueue(req(2, deadline=0.5), 0.0)
    s.enqueue(req(3, deadline=0.2), 0.0)
    s.enqueue(req(4), 0.0)
    now = sim.drain(0.0, dt=0.1)
    assert [c.request.id for c in sim.log] == [3, 2, 1, 4]
    # Two chunks in flight at 0.0 complete at 0.0 and 0.1 (3, 2); nothing missed.
    assert not any(f.missed_deadline for f in sim.finished)
    s.enqueue(req(5, deadline=now + 0.05), now)
    now = sim.drain(now, dt=0.1)
    sim.pump(now)
    s.enqueue(req(6, nbytes=2 * CHUNK, deadline=now + 0.05), now)
    sim.pump(now)
    sim.complete(L0, now)
    sim.complete(L0, now + 0.1)
    assert [(f.request.id, f.missed_deadline) for f in sim.finished[-2:]] == [(5, False), (6, True)]
    assert s.statistics().deadline_misses == 1


# --- cancel, failure, owners -----------------------------------------------------------------


def test_cancel_queued_request() -> None:
    """Cancelling a copy with nothing in flight returns its Finished at once and forgets it."""
    s, sim = make()
    s.enqueue(req(1, nbytes=4 * CHUNK), 0.0)
    s.enqueue(req(2, nbytes=4 * CHUNK), 0.0)
    sim.pump(0.0)
    fin = s.cancel(2, 0.0)
    assert fin is not None and (fin.outcome, fin.bytes_done) == ("cancelled", 0)
    assert s.get(2) is None
    assert lane_stats(s, L0).queued_bytes["bulk"] == 2 * CHUNK
    assert s.statistics().finished == {"done": 0, "cancelled": 1, "failed": 0}


def test_cancel_mid_flight_stops_at_chunk_boundary() -> None:
    """Cancel with chunks in flight: no more chunks, Finished with bytes_done after the last lands."""
    s, sim = make()
    s.enqueue(req(1, nbytes=5 * CHUNK), 0.0)
    sim.pump(0.0)
    assert s.cancel(1, 0.0) is None
    assert s.get(1) is not None and s.get(1).state is RequestState.CANCELLED  # type: ignore[union-attr]
    sim.complete(L0, 0.001)
    assert sim.finished == [] and sim.pump(0.001) == []
    sim.complete(L0, 0.002)
    (fin,) = sim.finished
    assert (fin.outcome, fin.bytes_done, fin.error) == ("cancelled", 2 * CHUNK, None)
    assert s.idle


def test_cancel_between_chunks_reports_bytes_done() -> None:
    """Cancelling after some chunks landed, none in flight, reports those bytes at once."""
    s, sim = make()
    s.enqueue(req(1, nbytes=5 * CHUNK), 0.0)
    sim.pump(0.0)
    sim.complete(L0, 0.001)
    sim.complete(L0, 0.002)
    fin = s.cancel(1, 0.002)
    assert fin is not None and fin.bytes_done == 2 * CHUNK
    assert sim.pump(0.002) == [] and s.idle


def test_cancel_unknown_or_twice_is_not_found() -> None:
    """Cancelling an unknown, finished or already-cancelled copy raises NotFound."""
    s, sim = make()
    with pytest.raises(NotFound, match=r"^no copy with id 99 is queued or in flight; "):
        s.cancel(99, 0.0)
    s.enqueue(req(1, nbytes=3 * CHUNK), 0.0)
    sim.pump(0.0)
    s.cancel(1, 0.0)
    with pytest.raises(NotFound, match=r"^copy 1 is already cancelled; "):
        s.cancel(1, 0.0)
    s.enqueue(req(2), 0.0)
    sim.drain(0.0)
    with pytest.raises(NotFound, match=r"^no copy with id 2 is queued or in flight; "):
        s.cancel(2, 0.0)


def test_failure_fails_only_that_request() -> None:
    """A chunk error fails its copy (after its last chunk in flight); others carry on."""
    s, sim = make()
    s.enqueue(req(1, nbytes=3 * CHUNK), 0.0)
    sim.pump(0.0)
    s.enqueue(req(2, "normal", nbytes=2 * CHUNK), 0.0)
    err = EngineError("cudaErrorIllegalAddress")
    sim.complete(L0, 0.001, err)
    assert sim.finished == []
    assert s.get(1).state is RequestState.FAILED  # type: ignore[union-attr]
    sim.drain(0.001)
    outcomes = {f.request.id: (f.outcome, f.bytes_done, f.error) for f in sim.finished}
    assert outcomes == {1: ("failed", 0, err), 2: ("done", 2 * CHUNK, None)}
    assert [c.request.id for c in sim.log].count(1) == 2  # nothing after the failure
    assert s.statistics().finished == {"done": 1, "cancelled": 0, "failed": 1}


def test_drop_owner_touches_only_that_owner() -> None:
    """drop_owner cancels one client's copies (queued at once, in flight later), no one else's."""
    s, sim = make()
    s.enqueue(req(1, owner="x", nbytes=3 * CHUNK), 0.0)
    s.enqueue(req(2, owner="y", nbytes=CHUNK), 0.0)
    s.enqueue(req(3, owner="x", nbytes=CHUNK, lane=L1), 0.0)
    s.enqueue(req(4, owner="x", nbytes=CHUNK), 0.0)
    sim.pump(0.0)  # L0: 1,1 in flight; L1: 3 in flight; 2 and 4 queued
    now_fin = s.drop_owner("x", 0.0)
    assert [f.request.id for f in now_fin] == [4]
    assert s.drop_owner("nobody", 0.0) == []
    sim.drain(0.0)
    outcomes = {f.request.id: f.outcome for f in now_fin + sim.finished}
    assert outcomes == {1: "cancelled", 2: "done", 3: "cancelled", 4: "cancelled"}
    # No bookkeeping outlives a dropped owner, whose chunks were in flight when it went; an owner
    # still about keeps its (empty) set of requests for its next copy.
    assert "x" not in s._by_owner
    assert s._by_owner.get("y") == set()
    s.drop_owner("y", 0.0)
    assert "y" not in s._by_owner


# --- fifo mode, reload, stats ----------------------------------------------------------------


def test_fifo_mode_whole_copies_in_arrival_order() -> None:
    """mode=fifo hands out each copy whole by DMA, in arrival order, classes ignored but checked."""
    s, sim = make(Policy(mode="fifo", min_chunk_bytes=4096))
    s.enqueue(req(1, "bulk", nbytes=100 * CHUNK), 0.0)
    s.enqueue(req(2, "urgent", nbytes=4096), 0.0)
    s.enqueue(req(3, "high", nbytes=3 * CHUNK), 0.0)
    chunks = sim.pump(0.0)
    assert [(c.request.id, c.offset, c.nbytes, c.path) for c in chunks] == [
        (1, 0, 100 * CHUNK, Path.DMA),
        (2, 0, 4096, Path.DMA),
        (3, 0, 3 * CHUNK, Path.DMA),
    ]
    with pytest.raises(InvalidRequest, match=r"^unknown class 'vip'; "):
        s.enqueue(req(4, cls="vip"), 0.0)
    sim.drain(0.0)
    assert [f.request.id for f in sim.finished] == [1, 2, 3]


def test_set_policy_keeps_queued_requests() -> None:
    """A reload re-derives chunking, keeps queued copies, and moves a dropped class's to bulk."""
    s, sim = make()
    s.enqueue(req(1, "bulk", nbytes=10 * CHUNK), 0.0)
    s.enqueue(req(2, "normal", nbytes=4 * CHUNK), 0.0)
    sim.pump(0.0)
    classes = (ClassSpec("urgent", strict=True), ClassSpec("high", 8), ClassSpec("bulk", 2), ClassSpec("scavenger", 1))
    s.set_policy(Policy(min_chunk_bytes=4096, max_block_us=2000.0, urgent_block_us=0, beat_block_us=0, classes=classes))
    assert s.lane_params(L0) == LaneParams(2 * CHUNK, 2 * BOUND, 512, 4096, 2 * CHUNK, 2 * BOUND, 4 * CHUNK, 4 * BOUND)
    r2 = s.get(2)
    assert r2 is not None and r2.cls == "scavenger"
    stats = lane_stats(s, L0)
    assert stats.queued_requests == {"urgent": 0, "high": 0, "bulk": 1, "scavenger": 1}
    sim.drain(0.0)
    assert sorted((f.request.id, f.outcome, f.bytes_done) for f in sim.finished) == [
        (1, "done", 10 * CHUNK),
        (2, "done", 4 * CHUNK),
    ]
    assert max(c.nbytes for c in sim.log) == 2 * CHUNK


def test_statistics_and_state_flags() -> None:
    """statistics lists lanes sorted with every class; idle, has_queued, strict_in_flight track state."""
    s, sim = make()
    assert s.idle and not s.has_queued and not s.strict_in_flight
    s.enqueue(req(1, "high", nbytes=3 * CHUNK + 5, lane=L1), 0.0)
    assert s.has_queued and not s.idle
    st0 = s.statistics()
    # Sorted by LaneKey: direction values compare as strings, so d2h comes first.
    assert [ls.lane for ls in st0.lanes] == ["gpu0/d2h", "gpu0/h2d"]
    assert st0.lanes[0].queued_requests == {"urgent": 0, "high": 1, "normal": 0, "bulk": 0}
    assert st0.lanes[0].queued_bytes["high"] == 3 * CHUNK + 5
    sim.pump(0.0)
    st1 = lane_stats(s, L1)
    assert (st1.queued_bytes["high"], st1.inflight_bytes, st1.inflight_bound) == (CHUNK + 5, BOUND, BOUND)
    r = s.get(1)
    assert r is not None and r.state is RequestState.ACTIVE and r.first_submit == 0.0
    sim.drain(0.0)
    assert s.idle and s.get(1) is None
    assert s.statistics().mode == "priod"


def test_bulk_held_while_strict_dma_in_flight() -> None:
    """No non-strict chunk is handed out while a strict DMA chunk of the lane is in flight."""
    info = LaneInfo(LaneKey(0, Direction.H2D), 1e9, 0, 0)  # no express: urgent goes by DMA
    s = Scheduler(Policy(), [info])
    s.enqueue(Request(1, "a", info.key, "bulk", 64 << 20, 0.0), 0.0)
    first = s.next_chunks(0.0)
    s.enqueue(Request(2, "b", info.key, "urgent", 4096, 0.0), 0.0)
    urgent = s.next_chunks(0.0)
    assert [c.request.id for c in urgent] == [2] and urgent[0].path is Path.DMA
    for c in first:
        s.chunk_done(c, 0.001)
    assert s.next_chunks(0.001) == []  # bulk room, but the urgent chunk is still in flight
    s.chunk_done(urgent[0], 0.002)
    assert [c.request.id for c in s.next_chunks(0.002)] == [1, 1]


def test_a_reload_rederives_the_batch_bound() -> None:
    """``batch_block_us`` is re-read on reload like ``max_block_us``: half the time, half the bytes."""
    s, _ = make()
    before = s.lane_params(L0)
    s.set_policy(Policy(min_chunk_bytes=4096, urgent_block_us=0, batch_block_us=2000.0))
    after = s.lane_params(L0)
    assert (after.batch_chunk_bytes, after.batch_inflight_bytes) == (
        before.batch_chunk_bytes // 2,
        before.batch_inflight_bytes // 2,
    )
    assert (after.chunk_bytes, after.inflight_bytes) == (before.chunk_bytes, before.inflight_bytes)
