"""GPU-side ordering on the sim engine: ``wait_event`` and ``signal_event`` (docs/protocol.md).

The sim engine's event is a byte of a device region (priod.wire.ipc_event.SimEvent): the daemon polls
a wait event and must not start the copy before it is set; it clears a signal event when it
records it behind the copy's last chunk and sets it on the copy engine's thread right after the
last byte landed. A copy held for its event holds up no one else's, nor its own client's other
copies; it can be cancelled or time out; hostile handles get clear refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.common.types import Direction, LaneKey
from priod.daemon.config import load_config
from priod.daemon.engines.base import Completion, IpcEvent
from priod.daemon.engines.sim import SimEngine, SimSettings
from priod.daemon.gates import GATE_MAX_INTERVAL_S, GATE_POLLS_PER_S, GATE_POLLS_PER_TURN, GATE_SPIN_S, Gates
from priod.daemon.sched.scheduler import Request
from priod.daemon.server import Daemon
from priod.errors import Cancelled, ConnectionClosed, CopyTimeout, EngineError, InvalidRequest, LimitExceeded, NotFound
from priod.testing import DaemonProcess, daemon_process
from priod.wire.ipc_event import SimEvent, event_handle, parse_sim_handle, sim_handle
from priod.wire.messages import Copy, CopyBatch, decode_request

MiB = 1 << 20


def rand(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def regions(c: priod.Client, n: int, seed: int) -> tuple[priod.Region, priod.Region, priod.Region]:
    """A host source of ``n`` random bytes, a zeroed device destination, and a device region
    for sim events."""
    src, dst, evr = await c.alloc_host(n), await c.alloc_device(n), await c.alloc_device(4096)
    assert src.array is not None and dst.array is not None
    src.array[:] = rand(n, seed)
    return src, dst, evr


# -- the pieces on their own ----------------------------------------------------------------------


def test_handles_and_messages_round_trip() -> None:
    """A sim handle names its region and byte; Copy and CopyBatch carry both events through
    encode/decode (the fast decode path steps aside for them); a wrong length is refused."""
    h = sim_handle(7, 4095)
    assert len(h) == 64 and parse_sim_handle(h) == (7, 4095)
    with pytest.raises(InvalidRequest, match=r"^this is not a sim event handle"):
        parse_sim_handle(bytes(64))
    msg = Copy(1, 2, 10, wait_event=h, signal_event=sim_handle(7, 0)).encode(5)
    assert decode_request(msg) == Copy(1, 2, 10, wait_event=h, signal_event=sim_handle(7, 0))
    batch = CopyBatch(1, 2, bytes(24), wait_event=h).encode(6)
    assert decode_request(batch) == CopyBatch(1, 2, bytes(24), wait_event=h)
    with pytest.raises(
        InvalidRequest, match=r"^wait_event holds 10 bytes; send the 64 bytes of a cudaIpcEventHandle_t"
    ):
        decode_request(Copy(1, 2, 10, wait_event=bytes(10)).encode(7))
    with pytest.raises(InvalidRequest, match=r"^field 'signal_event' must be bytes, got str$"):
        decode_request({**Copy(1, 2, 10).encode(8), "signal_event": "x" * 64})
    with pytest.raises(TypeError, match=r"^int does not name an event"):
        event_handle(3)


class _Ev(IpcEvent):
    def __init__(self) -> None:
        self.device = 0
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def close(self) -> None:
        pass


def _req(i: int, owner: object = "a") -> Request:
    return Request(i, owner, LaneKey(0, Direction.H2D), "normal", 100, 0.0)


def test_gates_back_off_and_bound_their_polls() -> None:
    """A held copy is polled every turn for its first millisecond, then after 1/8 of its age up
    to 10 ms; with thousands held, all of them together stay near GATE_POLLS_PER_S; a turn polls
    at most GATE_POLLS_PER_TURN; completed ones come out once; cancels take them out."""
    g = Gates()
    ev = _Ev()
    g.hold(_req(1), ev, 0.0)
    assert g.poll(0.0) == ([], []) and g.next_due() == 0.0  # young: every turn
    g.poll(GATE_SPIN_S * 4)  # age 4 ms: next after 0.5 ms
    assert g.next_due() == pytest.approx(GATE_SPIN_S * 4 + GATE_SPIN_S * 4 / 8)
    g.poll(1.0)
    assert g.next_due() == pytest.approx(1.0 + GATE_MAX_INTERVAL_S)
    ev.done = True
    assert g.poll(0.5) == ([], [])  # not due yet: not even queried
    opened, failed = g.poll(2.0)
    assert [r.id for r in opened] == [1] and not failed and len(g) == 0 and g.next_due() is None

    many = Gates()
    events = [_Ev() for _ in range(10_000)]
    for i, e in enumerate(events):
        many.hold(_req(i), e, 0.0)
    many.poll(0.0)
    assert sum(e.queries for e in events) == GATE_POLLS_PER_TURN
    for e in events:
        e.queries = 0
    # Old and many: a second of polling costs about GATE_POLLS_PER_S queries in all.
    t = 10.0
    while t < 11.0:
        many.poll(t)
        t += 0.001
    total = sum(e.queries for e in events)
    assert total <= GATE_POLLS_PER_S * 1.2 + len(events), total
    assert many.take(3) is not None and many.take(3) is None and 3 not in many
    assert len(many.take_owner("a")) == len(events) - 1 and len(many) == 0


# -- through a sim daemon -------------------------------------------------------------------------


async def test_copy_and_batch_wait_for_their_event(daemon: DaemonProcess) -> None:
    """A copy and a batch naming a pending wait event do not start, however long (their bytes
    stay unchanged); once the event is set, they land, and the reply says how long they waited."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        src, dst, evr = await regions(c, 2 * MiB, 1)
        assert src.array is not None and dst.array is not None
        ev = SimEvent(evr, 100)
        ev.record()
        copy = c.start_copy(dst, src, MiB, wait_event=ev, priority="urgent")
        segs = [(MiB + 4096 * i, MiB + 8192 * i, 4096) for i in range(64)]
        batch = c.start_copy_batch(dst, src, segs, wait_event=ev.handle)
        await asyncio.sleep(0.15)
        assert not copy.done() and not batch.done()
        assert not dst.array.any(), "a copy started before its wait event completed"
        held = [s for s in (await c.status())["clients"] if s["pending"] == 2]
        assert held and held[0]["events"] == 1  # one event, opened once for both
        ev.complete()
        r, b = await copy.wait(timeout=5), await batch.wait(timeout=5)
        assert np.array_equal(dst.array[:MiB], src.array[:MiB])
        for d, s, k in segs:
            assert np.array_equal(dst.array[d : d + k], src.array[s : s + k])
        assert r.event_wait_us is not None and r.event_wait_us >= 100_000 and r.total_us >= r.event_wait_us
        assert r.queued_us < 100_000  # counted from when the event completed
        assert b.event_wait_us is not None and b.event_wait_us >= 100_000
        plain = await c.copy(dst, src, 4096)
        assert plain.event_wait_us is None


async def test_signal_event_is_set_exactly_when_the_bytes_are_in_place() -> None:
    """The daemon records the signal event behind a 64 MiB bulk copy (a client-set event reads
    pending from then) and reports it; the first time it reads set again every byte is in place,
    and that is before the reply comes (the daemon polls after the bytes land). Chunks of 40 ms
    make the copy one chunk, so the event is pending for all of its ~32 ms, not only for the
    last chunk's: the watcher thread cannot miss it."""
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SCHEDULER__MAX_BLOCK_US": "40000"}
    with daemon_process(env) as d:
        await _signal_exactly(d)


async def _signal_exactly(daemon: DaemonProcess) -> None:
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        n = 64 * MiB
        src, dst, evr = await regions(c, n, 2)
        dst_bytes, src_bytes = dst.array, src.array
        assert src_bytes is not None and dst_bytes is not None
        ev = SimEvent(evr, 0)
        ev.complete()  # a daemon that never recorded it would leave it set: the watcher would see bytes missing
        seen: dict[str, Any] = {"pending": 0}
        stop = threading.Event()

        def watch() -> None:
            # From before the copy: set (ours), then pending (the daemon's record), then set.
            while not stop.is_set() and ev.query():
                time.sleep(0)  # lets the loop's thread have the GIL
            while not stop.is_set():
                if ev.query():
                    seen["in_place"] = bool(np.array_equal(dst_bytes, src_bytes))
                    return
                seen["pending"] += 1
                time.sleep(0)

        watcher = threading.Thread(target=watch)
        watcher.start()
        h = c.start_copy(dst, src, signal_event=ev, priority="bulk")
        await h.recorded()
        r = await h.wait(timeout=20)
        set_by_reply = ev.query()
        watcher.join(timeout=20)
        stop.set()
        assert r.nbytes == n
        assert seen["pending"] > 0, "the event never read pending after the record"
        assert seen.get("in_place") is True, seen
        assert set_by_reply


async def test_a_held_copy_holds_up_no_one(daemon: DaemonProcess) -> None:
    """While one client's urgent copy waits on an event that never completes, another client's
    copies on the same lane, and the first client's own other copies, run as if it were not
    there; cancelling it copies nothing, and setting the event afterwards changes nothing."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as a, priod.connect(daemon.socket_path) as b:
        n = 4 * MiB
        src_a, dst_a, evr = await a.alloc_host(n), await a.alloc_device(n), await a.alloc_device(4096)
        src_b, dst_b = await b.alloc_host(n), await b.alloc_device(n)
        assert (
            src_a.array is not None and dst_a.array is not None and src_b.array is not None and dst_b.array is not None
        )
        src_a.array[:] = rand(n, 3)
        ev = SimEvent(evr, 0)
        ev.record()
        held = a.start_copy(dst_a, src_a, MiB, wait_event=ev, priority="urgent")
        start = time.perf_counter()
        for i in range(10):
            src_b.array[:] = i
            await b.copy(dst_b, src_b, priority="urgent", timeout=5)
            assert int(dst_b.array.min()) == int(dst_b.array.max()) == i
        own = await a.copy(dst_a, src_a, MiB, dst_offset=2 * MiB, src_offset=2 * MiB, priority="urgent", timeout=5)
        elapsed = time.perf_counter() - start
        assert own.nbytes == MiB and np.array_equal(dst_a.array[2 * MiB : 3 * MiB], src_a.array[2 * MiB : 3 * MiB])
        assert elapsed < 5, elapsed  # 44 MiB at 2 GB/s: ~25 ms of transfer
        assert not held.done() and not dst_a.array[:MiB].any()
        assert await held.cancel() == 0
        with pytest.raises(Cancelled, match=r"^copy cancelled after 0 of 1048576 bytes$"):
            await held
        ev.complete()
        await asyncio.sleep(0.05)
        assert not dst_a.array[:MiB].any()
        status = await a.status()
        assert status["held_copies"] == 0


async def test_a_timeout_cancels_a_held_copy(daemon: DaemonProcess) -> None:
    """``copy(..., timeout=)`` of a copy still held for its event cancels it in the daemon."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        src, dst, evr = await c.alloc_host(MiB), await c.alloc_device(MiB), await c.alloc_device(64)
        ev = SimEvent(evr, 63)
        ev.record()
        with pytest.raises(CopyTimeout) as info:
            await c.copy(dst, src, wait_event=ev, timeout=0.2)
        assert info.value.bytes_done == 0
        assert (await c.status())["held_copies"] == 0


async def test_a_copy_held_past_max_event_wait_s_is_cancelled_by_the_daemon() -> None:
    """With ``[limits] max_event_wait_s``, a copy (or batch) whose wait_event never completes is
    cancelled by the daemon about then, with an error that names the limit and how to raise it; a
    copy whose event completes in time lands; the connection goes on."""
    env = {"PRIOD_LOG__LEVEL": '"error"', "PRIOD_LIMITS__MAX_EVENT_WAIT_S": "0.3"}
    with daemon_process(env) as d:
        async with priod.connect(d.socket_path, copy_path="daemon") as c:
            src, dst, evr = await regions(c, MiB, 8)
            assert src.array is not None and dst.array is not None
            never, late = SimEvent(evr, 0), SimEvent(evr, 1)
            never.record()
            late.record()
            t0 = time.perf_counter()
            stuck = c.start_copy(dst, src, 4096, wait_event=never)
            stuck_batch = c.start_copy_batch(dst, src, [(0, 0, 64)], wait_event=never)
            ok = c.start_copy(dst, src, wait_event=late)
            await asyncio.sleep(0.1)
            late.complete()
            assert (await ok.wait(timeout=5)).nbytes == MiB
            assert np.array_equal(dst.array, src.array)
            for h in (stuck, stuck_batch):
                with pytest.raises(Cancelled) as info:
                    await h.wait(timeout=5)
                assert not isinstance(info.value, CopyTimeout) and info.value.bytes_done == 0
                assert "its wait_event did not complete within [limits] max_event_wait_s = 0.3 s" in str(info.value)
                assert "raise max_event_wait_s" in str(info.value)
            waited = time.perf_counter() - t0
            assert 0.25 <= waited < 1.0, waited
            assert (await c.status())["held_copies"] == 0
            await c.ping()
            assert (await c.copy(dst, src, 4096)).nbytes == 4096


def test_gates_expire_at_max_wait_and_not_before() -> None:
    """`Gates.poll` hands a copy held past ``max_wait_s`` back with a `Cancelled` error, polls it
    once more at the limit rather than later, lets one whose event completed by then through, and
    with 0 holds copies for ever."""
    g = Gates()
    g.configure(0.05)
    stuck, fine = _Ev(), _Ev()
    g.hold(_req(1), stuck, 0.0)
    g.hold(_req(2), fine, 0.0)
    assert g.poll(0.049) == ([], [])
    assert g.next_due() == pytest.approx(0.05)  # capped at the limit, not 0.049 + back-off
    fine.done = True
    opened, failed = g.poll(0.05)
    assert [r.id for r in opened] == [2]
    assert [r.id for r, _ in failed] == [1] and isinstance(failed[0][1], Cancelled)
    assert "max_event_wait_s = 0.05 s" in str(failed[0][1]) and len(g) == 0
    forever = Gates()
    forever.hold(_req(3), _Ev(), 0.0)
    assert forever.poll(1e6) == ([], []) and len(forever) == 1


async def test_hostile_handles_are_refused_and_the_connection_goes_on(daemon: DaemonProcess) -> None:
    """Malformed, foreign and out-of-range handles are refused with a message naming the fix;
    a region of someone else's cannot serve as an event; the connection keeps working."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c, priod.connect(daemon.socket_path) as other:
        src, dst, host_ev = await c.alloc_host(MiB), await c.alloc_device(MiB), await c.alloc_host(4096)
        theirs = await other.alloc_device(4096)
        cases: list[tuple[Any, type[Exception], str]] = [
            (bytes(10), InvalidRequest, r"^the event handle holds 10 bytes"),
            (rand(64, 4).tobytes(), InvalidRequest, r"^wait_event: this is not a sim event handle"),
            (
                sim_handle(host_ev.id, 0),
                InvalidRequest,
                rf"^wait_event: sim event region {host_ev.id} is host memory, but the copy runs on gpu0",
            ),
            (
                sim_handle(dst.id, MiB),
                InvalidRequest,
                rf"^wait_event: sim event offset {MiB} is outside region {dst.id}",
            ),
            (sim_handle(999_999, 0), NotFound, r"^no region 999999"),
            (sim_handle(theirs.id, 0), priod.PermissionDenied, rf"^region {theirs.id} belongs to another client"),
        ]
        for handle, exc, match in cases:
            with pytest.raises(exc, match=match):
                await c.copy(dst, src, 4096, wait_event=handle)
        with pytest.raises(InvalidRequest, match=r"^signal_event: this is not a sim event handle"):
            await c.copy_batch(dst, src, [(0, 0, 64)], signal_event=bytes(range(64)))
        await c.ping()
        assert (await c.copy(dst, src, 4096)).nbytes == 4096


async def test_event_and_request_limits_bound_a_flood_of_held_copies() -> None:
    """A connection may open at most MAX_EVENTS_PER_CONNECTION distinct events (reusing one is
    free), and held copies count against [limits] max_queued_requests like any pending copy;
    when the client leaves, its held copies go and nothing is left held."""
    from priod.daemon.gates import MAX_EVENTS_PER_CONNECTION

    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_QUEUED_REQUESTS": "32"}
    with daemon_process(env) as d:
        async with priod.connect(d.socket_path, copy_path="daemon") as c:
            src, dst, evr = await c.alloc_host(MiB), await c.alloc_device(MiB), await c.alloc_device(4096)
            for i in range(MAX_EVENTS_PER_CONNECTION):
                ev = SimEvent(evr, i)
                ev.complete()
                await c.copy(dst, src, 64, wait_event=ev)
            with pytest.raises(
                LimitExceeded, match=rf"^this connection has {MAX_EVENTS_PER_CONNECTION} IPC events open"
            ):
                await c.copy(dst, src, 64, wait_event=SimEvent(evr, MAX_EVENTS_PER_CONNECTION))
            pending = SimEvent(evr, 0)
            pending.record()
            handles = [c.start_copy(dst, src, 64, dst_offset=64 * i, wait_event=pending) for i in range(32)]
            with pytest.raises(LimitExceeded, match=r"^this connection has 32 copies pending"):
                await c.copy(dst, src, 64, wait_event=pending)
            assert (await c.status())["held_copies"] == 32
        async with priod.connect(d.socket_path, copy_path="daemon") as watcher:
            for _ in range(100):
                if (await watcher.status())["held_copies"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await watcher.status())["held_copies"] == 0
        assert all(h.done() for h in handles)
        for h in handles:  # each ended with its connection, and says so (an error left unread
            with pytest.raises(ConnectionClosed):  # would be reported whenever it is collected)
                await h


def test_sync_client_records_and_waits(daemon: DaemonProcess) -> None:
    """SyncClient: a started copy's ``wait_recorded`` returns once the signal event is recorded,
    then the copy lands; a blocking ``copy`` with both events skips the progress frame; a batch
    held for its event lands once it is set."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        n = 16 * MiB
        src, dst, evr = c.alloc_host(n), c.alloc_device(n), c.alloc_device(4096)
        assert src.array is not None and dst.array is not None
        src.array[:] = rand(n, 5)
        sig, wait = SimEvent(evr, 1), SimEvent(evr, 2)
        h = c.start_copy(dst, src, signal_event=sig, priority="bulk")
        h.wait_recorded(timeout=5)
        assert h.wait(timeout=10).nbytes == n and sig.query()
        assert np.array_equal(dst.array, src.array)
        wait.complete()
        assert c.copy(dst, src, 4096, wait_event=wait, signal_event=sig).event_wait_us is not None
        wait.record()
        b = c.start_copy_batch(dst, src, [(0, 4096, 4096)], wait_event=wait)
        assert b.poll() is None
        time.sleep(0.05)
        assert b.poll() is None
        wait.complete()
        assert b.wait(timeout=5).segments == 1
        with pytest.raises(InvalidRequest, match=r"^this copy was sent without signal_event"):
            c.start_copy(dst, src, 64).wait_recorded()


def test_bench_script_dry_run_on_sim(tmp_path: Any) -> None:
    """scripts/bench_gpu_events.py runs end to end on the sim engine (its GPU rows need a GPU):
    every form has samples, and it prints the table last and writes results.json."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu_events.py"
    out = tmp_path / "bench"
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--backend",
            "sim",
            "--sizes",
            "4096",
            "--count",
            "3",
            "--warm",
            "1",
            "--opens",
            "2",
            "--interval-ms",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["sizes"]["4096"]
    assert {k: v["n"] for k, v in rows.items()} == {
        "plain": 3,
        "wait": 3,
        "signal": 3,
        "wait+signal": 3,
        "signal recorded": 3,
        "wait+signal recorded": 3,
        "wait (open)": 2,
    }
    assert "wait (open)" in r.stdout.strip().splitlines()[-1]  # the table comes last


# -- in-process daemons: a polled engine, a record that fails --------------------------------------


class _PolledSim(SimEngine):
    """The sim engine found by polling alone, as the cuda engine is (the timer-thread path)."""

    wakes_on_completion = False
    fail_records = False

    def record_event(self, event: IpcEvent, after: list[Completion]) -> None:
        if self.fail_records:
            raise EngineError("injected: cudaEventRecord failed")
        super().record_event(event, after)


@contextlib.asynccontextmanager
async def _inprocess(engine: SimEngine) -> AsyncIterator[tuple[Daemon, str]]:
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path, "bulk_poll": "timer"}, log={"level": "warning"})
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        yield daemon, path
    finally:
        await daemon.stop()


async def test_a_long_held_copy_costs_few_polls_on_a_polled_engine() -> None:
    """On an engine found by polling (cuda's path: the timer thread wakes the loop), a copy held
    for half a second is polled every turn for its first millisecond, then backs off to one poll
    per 10 ms (not one per loop turn); it lands as soon as its event is set."""
    engine = _PolledSim(SimSettings())
    async with _inprocess(engine) as (daemon, path), priod.connect(path, copy_path="daemon") as c:
        src, dst, evr = await regions(c, MiB, 6)
        assert src.array is not None and dst.array is not None
        ev = SimEvent(evr, 0)
        ev.record()
        h = c.start_copy(dst, src, wait_event=ev, priority="urgent")
        await asyncio.sleep(0.1)
        early = daemon.pump.gates.polls  # mostly the first millisecond's, one a loop turn
        await asyncio.sleep(0.4)
        late = daemon.pump.gates.polls - early  # backed off to one per 10 ms: about 40
        assert early >= 2 and late < 100, (early, late)
        assert not h.done() and not dst.array.any()
        ev.complete()
        set_at = time.perf_counter()
        r = await h.wait(timeout=5)
        assert time.perf_counter() - set_at < 0.2  # seen within the back-off's 10 ms, then ~0.5 ms of copy
        assert np.array_equal(dst.array, src.array)
        assert r.event_wait_us is not None and r.event_wait_us >= 500_000, r


async def test_a_signal_that_cannot_be_recorded_fails_the_reply_not_the_bytes() -> None:
    """If the engine cannot record the signal_event, no progress frame comes; ``recorded()``
    raises, and the copy's reply is an ``engine`` error saying the bytes landed anyway."""
    engine = _PolledSim(SimSettings())
    engine.fail_records = True
    async with _inprocess(engine) as (_, path), priod.connect(path, copy_path="daemon") as c:
        src, dst, evr = await regions(c, MiB, 7)
        assert src.array is not None and dst.array is not None
        h = c.start_copy(dst, src, signal_event=SimEvent(evr, 0))
        with pytest.raises(
            EngineError,
            match=r"^the copy landed \(after 1048576 of 1048576 bytes\) but its signal_event could not be recorded: injected",
        ):
            await h.recorded()
        assert np.array_equal(dst.array, src.array)
