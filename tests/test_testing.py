"""priod.testing's fakes and helpers: `ManualEngine` moves real bytes, only when told, in the
order told, reports a failure the way a real engine does and counts polls; a daemon runs on it;
`framed_pair` carries frames and fds; the stats and /proc helpers give the figures the scripts
report."""

from __future__ import annotations

import asyncio
import mmap
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

import priod
from priod.common.types import Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob, DeviceMemory, HostMemory
from priod.errors import EngineError
from priod.testing import (
    CpuMeter,
    DaemonProcess,
    ManualChunk,
    ManualEngine,
    blocking_framed_pair,
    bulk_load,
    cpu_seconds,
    daemon_process,
    describe,
    framed_pair,
    memfd,
    memory_and_fds,
    percentile,
    summarize,
    throughput_between,
)

H2D = LaneKey(0, Direction.H2D)
D2H = LaneKey(0, Direction.D2H)
N = 1 << 16


@pytest.fixture
def engine() -> Iterator[ManualEngine]:
    eng = ManualEngine()
    yield eng
    eng.close()


def host_region(engine: ManualEngine, nbytes: int = N) -> HostMemory:
    """A host region as the daemon makes one: a client's memfd, mapped by the engine."""
    fd = memfd(nbytes)
    try:
        return engine.map_host(fd, nbytes)
    finally:
        os.close(fd)  # the engine keeps its own mapping


def device_array(mem: DeviceMemory) -> npt.NDArray[np.uint8]:
    """The device region as a client sees it: its exported fd, mapped again."""
    assert mem.export is not None and mem.export.fd is not None
    return np.frombuffer(mmap.mmap(mem.export.fd, mem.nbytes), dtype=np.uint8)


def submit(
    engine: ManualEngine,
    lane: LaneKey,
    dst: HostMemory | DeviceMemory,
    src: HostMemory | DeviceMemory,
    nbytes: int,
    off: int = 0,
    path: Path = Path.DMA,
) -> ManualChunk:
    chunk = engine.submit(ChunkJob(lane, path, dst, src, dst_offset=off, src_offset=off, nbytes=nbytes))
    assert isinstance(chunk, ManualChunk)
    return chunk


# -- ManualEngine ---------------------------------------------------------------------------------
def test_bytes_move_only_on_complete_and_land_where_the_chunk_says(engine: ManualEngine) -> None:
    """A submitted chunk is recorded as submitted and moves nothing until `complete`; then
    exactly its range of the source lands at its range of the destination, visible through the
    device region's exported fd (what a client maps)."""
    host = host_region(engine)
    host.array[:] = np.arange(N, dtype=np.uint32).astype(np.uint8)
    dev = engine.alloc_device(N, 0)
    seen = device_array(dev)
    chunk = engine.submit(ChunkJob(H2D, Path.DMA, dev, host, dst_offset=4096, src_offset=100, nbytes=8192, strict=True))
    assert isinstance(chunk, ManualChunk)
    assert (chunk.seq, chunk.lane, chunk.path, chunk.dst_offset, chunk.src_offset, chunk.nbytes, chunk.strict) == (
        0,
        H2D,
        Path.DMA,
        4096,
        100,
        8192,
        True,
    )
    assert chunk.dst is dev and chunk.src is host
    assert engine.submitted == [chunk] and engine.pending == [chunk]
    assert (chunk.done(), chunk.state) == (False, "pending")
    assert not seen.any()

    assert engine.complete() == [chunk]
    assert chunk.done() and chunk.state == "done" and engine.pending == []
    assert np.array_equal(seen[4096 : 4096 + 8192], host.array[100 : 100 + 8192])
    assert not seen[:4096].any() and not seen[4096 + 8192 :].any()

    back = host_region(engine)
    submit(engine, D2H, back, dev, N)
    engine.complete_all()
    assert np.array_equal(back.array, seen)


def test_chunks_complete_in_submission_order_only_on_command(engine: ManualEngine) -> None:
    """`complete(n)` finishes the n oldest pending chunks, optionally of one lane or path;
    `complete_chunk` finishes one out of turn; asking for more than is pending is refused."""
    host, dev = host_region(engine), engine.alloc_device(N, 0)
    a, b, c = (submit(engine, H2D, dev, host, 1024, off=i * 1024) for i in range(3))
    d = submit(engine, D2H, host, dev, 1024, off=8192)
    e = submit(engine, H2D, dev, host, 4096, off=16384, path=Path.EXPRESS)
    assert [x.seq for x in engine.submitted] == [0, 1, 2, 3, 4]
    assert engine.complete(lane=D2H) == [d]
    assert engine.complete_chunk(e) is e  # an express chunk passing the DMA queue
    assert [x.state for x in (a, b, c)] == ["pending"] * 3
    assert engine.complete(2) == [a, b]
    assert c.state == "pending" and engine.pending == [c]
    with pytest.raises(ValueError, match="asked to complete 2 chunks but 1 are pending"):
        engine.complete(2)
    with pytest.raises(ValueError, match="already done"):
        engine.complete_chunk(a)
    assert engine.complete_all() == [c] and engine.complete_all() == []


def test_a_failed_chunk_raises_engine_error_from_done_and_moves_nothing(engine: ManualEngine) -> None:
    """`fail` makes the chunk's `done()` raise `EngineError` (every time it is asked), with a
    default message or the test's own; no byte of a failed chunk lands."""
    host, dev = host_region(engine), engine.alloc_device(N, 0)
    host.array[:] = 7
    first = submit(engine, H2D, dev, host, 4096)
    second = submit(engine, H2D, dev, host, 4096, off=4096)
    assert engine.fail() is first  # the oldest pending one
    for _ in range(2):
        with pytest.raises(EngineError, match="injected failure of chunk 0"):
            first.done()
    engine.fail(second, "cudaErrorLaunchFailure: as if the GPU had faulted")
    with pytest.raises(EngineError, match=r"^cudaErrorLaunchFailure"):
        second.done()
    assert [x.state for x in engine.submitted] == ["failed", "failed"]
    assert not device_array(dev).any()
    with pytest.raises(ValueError, match="no chunk is pending"):
        engine.fail()


@pytest.mark.parametrize("wakes", [False, True], ids=["polled", "wakes"])
def test_polls_and_wakeups_are_counted(wakes: bool) -> None:
    """Every `done()` call counts, per chunk and for the engine; the wakeup hook runs on each
    completion or failure only for an engine that wakes on completion (a polled one, like
    CUDA, never calls it), also when the test completes chunks from another thread."""
    engine = ManualEngine(wakes_on_completion=wakes)
    calls: list[str] = []
    engine.set_wakeup(lambda: calls.append(threading.current_thread().name))
    try:
        host, dev = host_region(engine), engine.alloc_device(N, 0)
        a, b = submit(engine, H2D, dev, host, 512), submit(engine, H2D, dev, host, 512, off=512)
        for _ in range(3):
            a.done()
        b.done()
        assert (engine.polls, a.polls, b.polls) == (4, 3, 1)
        t = threading.Thread(target=engine.complete, name="completer")
        t.start()
        t.join()
        engine.fail()
        assert engine.wakeups == len(calls) == (2 if wakes else 0)
        assert calls == (["completer", "MainThread"] if wakes else [])
        assert a.done() and engine.polls == 5
        a.release()
        assert (a.releases, b.releases) == (1, 0)
    finally:
        engine.close()


def test_lanes_follow_the_configuration() -> None:
    """Devices x directions, bandwidth per direction, the express range; an express chunk on a
    lane without express, an unknown lane, a chunk beyond its memory or a missing device are refused."""
    bw = {Direction.H2D: 25e9, Direction.D2H: 20e9}
    engine = ManualEngine(2, bandwidth=bw, express_range=(0, 0), directions=(Direction.H2D, Direction.D2H))
    try:
        lanes = engine.lanes()
        assert [str(i.key) for i in lanes] == [
            "gpu0/d2h",
            "gpu0/h2d",
            "gpu1/d2h",
            "gpu1/h2d",
        ]  # in LaneKey order, as the sim engine lists them
        assert [i.bandwidth for i in lanes] == [20e9, 25e9, 20e9, 25e9]
        assert all((i.express_min, i.express_max) == (0, 0) for i in lanes)
        assert not engine.wakes_on_completion
        host, dev = host_region(engine), engine.alloc_device(N, 1)
        with pytest.raises(ValueError, match="no express path"):
            engine.submit(
                ChunkJob(LaneKey(1, Direction.H2D), Path.EXPRESS, dev, host, dst_offset=0, src_offset=0, nbytes=64)
            )
        with pytest.raises(ValueError, match="gpu0/d2d does not exist"):
            engine.submit(
                ChunkJob(LaneKey(0, Direction.D2D), Path.DMA, dev, dev, dst_offset=0, src_offset=0, nbytes=64)
            )
        with pytest.raises(ValueError, match="outside its memory"):
            engine.submit(
                ChunkJob(LaneKey(1, Direction.H2D), Path.DMA, dev, host, dst_offset=N - 10, src_offset=0, nbytes=64)
            )
        with pytest.raises(priod.InvalidRequest, match="device 2 does not exist"):
            engine.alloc_device(64, 2)
        with pytest.raises(RuntimeError, match="in flight"):
            submit(engine, LaneKey(1, Direction.H2D), dev, host, 64)
            engine.release_host(host)
    finally:
        engine.close()
        engine.close()  # idempotent


@pytest.mark.parametrize("wakes", [False, True], ids=["polled", "wakes"])
async def test_a_daemon_runs_on_the_manual_engine(wakes: bool) -> None:
    """A real daemon on a ManualEngine: a client's copy waits, in flight, until the test
    completes its chunks, then lands byte for byte; a failed chunk reaches the client as
    EngineError. Polled or woken, the daemon finds the completions."""
    from priod.daemon.config import load_config
    from priod.daemon.server import Daemon

    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path, "bulk_poll": "spin"}, log={"level": "warning"})
    engine = ManualEngine(wakes_on_completion=wakes)
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        async with priod.connect(path, copy_path="daemon") as c:
            h, d = await c.alloc_host(N), await c.alloc_device(N)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(N, dtype=np.uint32).astype(np.uint8)
            handle = c.start_copy(d, h, N, priority="normal")
            while not engine.pending:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.02)
            assert not handle.done() and not d.array.any()
            while engine.pending:  # the daemon may hold chunks back until earlier ones complete
                engine.complete_all()
                await asyncio.sleep(0.005)
            r = await handle
            assert r.nbytes == N and np.array_equal(d.array, h.array)
            polls = engine.polls
            assert polls > 0

            failing = c.start_copy(h, d, 4096, priority="urgent")
            while not engine.pending:
                await asyncio.sleep(0.001)
            engine.fail(error="injected by the test")
            with pytest.raises(EngineError, match="injected by the test"):
                await failing
            assert all(x.releases == 1 for x in engine.submitted)
    finally:
        await daemon.stop()


# -- framed_pair ----------------------------------------------------------------------------------
async def test_framed_pair_carries_messages_and_fds() -> None:
    """A frame sent on one end arrives whole on the other, both ways; an fd sent with it
    arrives as a new descriptor of the same file."""
    a, b = framed_pair()
    try:
        fd = memfd(4096)
        with mmap.mmap(fd, 4096) as m:
            m[:5] = b"hello"
        a.send({"op": "ping", "id": 1, "blob": b"\x00\x01"}, [fd])  # the sender closes fd once sent
        msg, fds = await asyncio.wait_for(b.receive(), 5)
        assert msg == {"op": "ping", "id": 1, "blob": b"\x00\x01"} and len(fds) == 1
        with mmap.mmap(fds[0], 4096) as m:
            assert m[:5] == b"hello"
        os.close(fds[0])
        b.send({"id": 1, "ok": True})
        assert await asyncio.wait_for(a.receive(), 5) == ({"id": 1, "ok": True}, [])
    finally:
        a.close()
        b.close()


def test_blocking_framed_pair_carries_messages_and_fds() -> None:
    a, b = blocking_framed_pair()
    try:
        r, w = os.pipe()
        a.send({"op": "hello"}, [r])
        os.close(r)
        msg, fds = b.receive()
        assert msg == {"op": "hello"} and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        os.close(fds[0])
        os.close(w)
    finally:
        a.close()
        b.close()


# -- stats and /proc ---------------------------------------------------------------------------------
def test_summaries_pick_their_keys_in_order_and_handle_no_values() -> None:
    vals = [float(v) for v in range(1, 101)]
    assert percentile(vals, 50) == 50.5 and np.isnan(percentile([], 50))
    assert summarize(vals) == {
        "n": 100,
        "p50": 50.5,
        "p99": pytest.approx(99.01),
        "mean": 50.5,
        "min": 1.0,
        "max": 100.0,
    }
    assert list(summarize(vals, ("p50", "p99", "p99.9", "max", "mean"), ndigits=1)) == [
        "p50",
        "p99",
        "p99.9",
        "max",
        "mean",
    ]
    assert summarize(vals, ("p99.9",), ndigits=1) == {"p99.9": 99.9}
    assert summarize([], ("n", "p50", "max"), empty=None) == {"n": 0, "p50": None, "max": None}
    nan = pytest.approx(float("nan"), nan_ok=True)
    assert describe([]) == {"n": 0, "p50": nan, "p99": nan, "max": nan}
    with pytest.raises(ValueError, match="unknown summary key 'median'"):
        summarize(vals, ("median",))


def test_proc_readers_see_this_process() -> None:
    """Memory, fds and CPU time of this process, as the load test and the benchmark read the daemon's."""
    m = memory_and_fds(os.getpid())
    assert m["VmRSS"] > 1 and m["fds"] >= 3 and m["Threads"] >= 1
    r, w = os.pipe()
    try:
        assert memory_and_fds(os.getpid())["fds"] >= m["fds"] + 2
    finally:
        os.close(r)
        os.close(w)
    meter = CpuMeter(os.getpid())
    before, c0 = meter.sample(), cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    used = CpuMeter.delta(before, meter.sample())
    assert used["seconds"] > 0 and used["cpu"] >= 0 and cpu_seconds(os.getpid()) >= c0
    if "cpu_ns" in used:
        assert used["cpu_ns"] > 0 and used["loop_ns"] > 0
    assert memory_and_fds(2**22 + 12345) == {}  # no such process


# -- bulk_load --------------------------------------------------------------------------------------
async def test_verified_bulk_load_checks_every_copy() -> None:
    """``verify``: one region pair per outstanding copy, every copy's destination compared with
    its stamped source; `throughput_between` reads the completions. A bad pairing is refused."""
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        async with priod.connect(d.socket_path, copy_path="daemon") as c:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.5, stop.set)
            load = await bulk_load(c, 1 << 20, stop, pipeline=3, verify=True, deadline_ms=5.0)
            assert load.errors == [] and load.copies >= 3
            assert load.verified_bytes == load.copies * (1 << 20) and load.corrupted_bytes == load.corrupted_copies == 0
            t = throughput_between(load.done, load.done[0][0], load.done[-1][0])
            assert t["copies"] == load.copies and t["gbps"] > 0
            assert np.isnan(throughput_between(load.done[:1], 0.0, 1e12)["gbps"])
            pair = (await c.alloc_host(4096), await c.alloc_device(4096))
            with pytest.raises(ValueError, match="one \\(host, device\\) pair per outstanding copy: 2, not 1"):
                await bulk_load(c, 4096, stop, pipeline=2, verify=True, regions=[pair])


def test_a_daemon_that_stopped_cleanly_leaves_no_directory_behind() -> None:
    """daemon_process removes its private directory (socket, log) after a clean stop, and keeps
    it, log and all, after a daemon that did not stop cleanly."""
    with daemon_process() as d:
        where = os.path.dirname(d.log_path)
        assert os.path.exists(d.socket_path)
    assert d.proc.returncode == 0 and not os.path.exists(where)
    assert "daemon_stopped" in d.log()  # the log outlives its file
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        where = os.path.dirname(d.log_path)
        d.proc.kill()
        d.proc.wait()
    assert d.proc.returncode != 0 and os.path.exists(d.log_path)
    shutil.rmtree(where)


def test_log_records_leave_a_line_the_daemon_is_still_writing(tmp_path: pathlib.Path) -> None:
    """A test reading the log of a running daemon gets whole lines only: the one being written
    comes on a later read, not as a JSON error."""
    log = tmp_path / "daemon.log"
    log.write_text('{"event":"a"}\nnot json\n{"event":"b","le')
    proc = subprocess.Popen(["true"])
    proc.wait()
    d = DaemonProcess(proc, str(tmp_path / "priod.sock"), str(log))
    assert d.log_records() == [{"event": "a"}]
    with open(log, "a") as fp:
        fp.write('vel":"info"}\n')
    assert d.log_records() == [{"event": "a"}, {"event": "b", "level": "info"}]
