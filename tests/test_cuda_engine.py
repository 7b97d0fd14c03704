"""The CUDA engine, driven directly (no daemon).

Tests in `TestOnGpu` need an NVIDIA GPU with cuda-bindings and CuPy (marker ``gpu``; skipped
elsewhere). The tests outside it run on any machine.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, ClassVar

import numpy as np
import pytest

from priod.client.cuda_ipc import export_cuda_array, open_device_fd
from priod.common.cuda.driver import gpu_available, use_bindings
from priod.common.cuda.express import EXPRESS_MAX, EXPRESS_MIN_H2D
from priod.common.types import LOCAL_DIRECTIONS, Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob, Completion, DeviceMemory, HostMemory
from priod.daemon.engines.cuda.engine import CudaEngine
from priod.errors import CudaError, EngineError, InvalidRequest

HAVE_GPU = gpu_available()

REGION = 4 << 20
SIZES = [1, 3, 4095, 4097, (1 << 20) + 7]
# (src_offset, dst_offset): aligned; same residue mod 16 (head, int4 body, tail); a pair that
# differs mod 16 but not mod 8; and one that differs mod 2 (the byte path).
OFFSETS = [(0, 0), (19, 35), (8, 24), (5, 2)]
GUARD = 64


class HostRegion:
    """A memfd as a client makes it, with the client's own mapping to read and write through."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("priod-test")
        os.ftruncate(self.fd, nbytes)
        self.mapping = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = np.frombuffer(self.mapping, dtype=np.uint8)

    def close(self) -> None:
        del self.view
        self.mapping.close()
        os.close(self.fd)


def wait(completion: Completion, timeout: float = 20.0) -> None:
    """Poll a completion to the end, as the daemon's poller does, then release it."""
    deadline = time.monotonic() + timeout
    while not completion.done():
        if time.monotonic() > deadline:
            raise TimeoutError("a chunk did not complete in time")
    completion.release()


def device_view(mem: DeviceMemory) -> Any:
    """A CuPy uint8 array over device memory the engine allocated (same process, no IPC)."""
    import cupy as cp

    ptr = mem.pointer  # type: ignore[attr-defined]
    memory = cp.cuda.UnownedMemory(ptr, mem.nbytes, mem, device_id=mem.device)
    return cp.ndarray((mem.nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))


# ---------------------------------------------------------------------------------------------
# Any machine


def test_missing_bindings_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cuda-bindings, constructing the engine says which extra to install for which
    driver, and names --backend sim."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with use_bindings(None, None):  # none loaded yet: the first call imports them
        with pytest.raises(
            EngineError,
            match=r"pip install 'priod\[cuda13\]' \(NVIDIA driver >= 580\) or 'priod\[cuda12\]' \(driver >= 525\); --backend sim runs without a GPU$",
        ):
            CudaEngine()
        assert gpu_available() is False


def test_client_helpers_do_not_import_the_engine() -> None:
    """priod.client.cuda_ipc, the client library's CUDA side, loads the driver module only: neither the
    engine nor cuda-bindings (until a helper is called)."""
    code = "import sys, priod.client.cuda_ipc; print(' '.join(sorted(m for m in sys.modules if m.startswith(('priod', 'cuda')))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "priod.common.cuda.driver" in loaded
    assert not [
        m for m in loaded if m.startswith(("cuda", "priod.daemon.engines.cuda.")) and m != "priod.common.cuda.driver"
    ], loaded


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: this tests the machine without one")
def test_no_gpu_raises_engine_error() -> None:
    """On a machine without a GPU (or driver), CudaEngine() raises EngineError naming --backend sim."""
    assert gpu_available() is False
    with pytest.raises(EngineError, match="--backend sim"):
        CudaEngine()


def test_check_turns_results_into_values_or_cuda_errors() -> None:
    """check() unwraps (err, value...) tuples and raises CudaError named after the CUDA error."""
    from priod.common.cuda.driver import bindings, check

    try:
        runtime, _ = bindings()
    except EngineError as exc:
        pytest.skip(str(exc))

    ok = runtime.cudaError_t.cudaSuccess
    assert check((ok,)) is None
    assert check((ok, 5)) == 5
    assert check((ok, 1, 2)) == (1, 2)
    with pytest.raises(CudaError) as info:
        check((runtime.cudaError_t.cudaErrorInvalidValue, None))
    assert info.value.name == "cudaErrorInvalidValue"
    assert "invalid argument" in str(info.value)


def test_lane_busy_time_is_time_with_a_chunk_outstanding() -> None:
    """A lane's busy time (the busy-seconds metric on the cuda engine) runs from a chunk's
    submission to the poll that finds it done, overlapping chunks counting once, and stops
    while nothing is outstanding. Runs on a stand-in event pool: no GPU needed."""
    from priod.daemon.engines.cuda.events import Busy, EventCompletion, EventPool

    ok, not_ready = object(), object()
    state: dict[str, object] = {}
    pool = EventPool.__new__(EventPool)  # its __init__ needs cuda-bindings
    pool.free, pool.created, pool.closed, pool.ok, pool.not_ready = [], [], False, ok, not_ready
    pool.query = lambda event: (state[event],)

    busy = Busy()
    state["a"] = state["b"] = not_ready
    a = EventCompletion("a", pool, busy)
    time.sleep(0.02)
    b = EventCompletion("b", pool, busy)  # overlaps a: the lane is busy once, not twice
    time.sleep(0.02)
    assert not a.done() and busy.outstanding == 2
    state["a"] = ok
    assert a.done() and a.done() and busy.outstanding == 1  # a second done() counts nothing
    time.sleep(0.02)
    state["b"] = ok
    assert b.done() and busy.outstanding == 0
    first = busy.total()
    assert 0.06 <= first < 0.5
    time.sleep(0.05)  # idle: no time counted
    assert busy.total() == first
    c = EventCompletion("c", pool, busy)
    state["c"] = not_ready
    time.sleep(0.02)
    assert busy.total() - first >= 0.02  # the stretch under way counts before it ends
    state["c"] = ok
    assert c.done() and busy.total() == busy.seconds


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def engine() -> Iterator[CudaEngine]:
    """One engine for the GPU tests (calibrated on 64 MiB to keep start-up short)."""
    pytest.importorskip("cupy")
    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def regions(engine: CudaEngine) -> Iterator[dict[str, Any]]:
    """A mapped memfd and two device allocations of REGION bytes, shared by the GPU tests."""
    client = HostRegion(REGION)
    host = engine.map_host(client.fd, REGION)
    dev_a = engine.alloc_device(REGION, 0)
    dev_b = engine.alloc_device(REGION, 0)
    yield {"client": client, "host": host, "a": dev_a, "b": dev_b}
    for mem in (dev_a, dev_b):
        engine.release_device(mem)
    engine.release_host(host)
    client.close()


def _ipc_child(conn: Connection) -> None:
    """The other process: a client that shares CuPy arrays and opens the daemon's allocation."""
    import cupy as cp

    try:
        pool = cp.zeros((1 << 20) + 4096, dtype=cp.uint8)
        first = pool[13 : 13 + 300_001]  # two arrays in one allocation: one handle, two offsets
        second = pool[400_003 : 400_003 + 5000]
        conn.send([export_cuda_array(first), export_cuda_array(second)])
        expected_first, expected_second = conn.recv()
        cp.cuda.runtime.deviceSynchronize()
        conn.send([bool((first.get() == expected_first).all()), bool((second.get() == expected_second).all())])

        size, offset, nbytes, device = conn.recv()
        fd = recv_handle(conn)  # the daemon allocation's POSIX fd, as the client gets it
        expected = conn.recv()
        with open_device_fd(fd, size, offset, nbytes, device) as buf:
            view = cp.asarray(buf)
            seen = bool((view.get() == expected).all()) and view.shape == (nbytes,)
            view[:] = cp.arange(nbytes, dtype=cp.uint32).astype(cp.uint8)[::-1]
            cp.cuda.runtime.deviceSynchronize()
            del view
        conn.send(seen)
        conn.recv()  # hold the CuPy pool until the parent is done
        conn.send("bye")
    except BaseException as exc:  # report, rather than leave the parent waiting
        conn.send(f"child failed: {exc!r}")
        raise


def _gpu_count() -> int:
    from priod.common.cuda.driver import device_count

    return device_count()


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAVE_GPU or _gpu_count() < 2, reason="needs two NVIDIA GPUs (never run yet: no machine with two was lent)"
)
def test_peer_lane_copies_between_two_gpus_exactly() -> None:
    """Two GPUs: a peer lane each way, calibrated; bytes put on GPU 0 (h2d), copied to GPU 1 on
    the peer lane at odd offsets (plain and strict stream), and read back (d2h) are exact."""
    eng = CudaEngine(devices=[0, 1], calibrate_bytes=16 << 20)
    client = HostRegion(REGION)
    try:
        peers = {info.key: info for info in eng.lanes() if info.key.direction is Direction.PEER}
        assert set(peers) == {LaneKey(0, Direction.PEER, 1), LaneKey(1, Direction.PEER, 0)}
        assert all(info.bandwidth > 1e9 and info.express_max == 0 for info in peers.values())
        host = eng.map_host(client.fd, REGION)
        a, b = eng.alloc_device(REGION, 0), eng.alloc_device(REGION, 1)
        client.view[:] = np.random.default_rng(3).integers(0, 256, REGION, dtype=np.uint8)
        expected = client.view.copy()
        wait(
            eng.submit(
                ChunkJob(LaneKey(0, Direction.H2D), Path.DMA, a, host, dst_offset=0, src_offset=0, nbytes=REGION)
            )
        )
        half = REGION // 2
        wait(
            eng.submit(
                ChunkJob(LaneKey(0, Direction.PEER, 1), Path.DMA, b, a, dst_offset=5, src_offset=11, nbytes=half - 16)
            )
        )
        wait(
            eng.submit(
                ChunkJob(
                    LaneKey(0, Direction.PEER, 1),
                    Path.DMA,
                    b,
                    a,
                    dst_offset=half + 5,
                    src_offset=half + 11,
                    nbytes=half - 16,
                    strict=True,
                )
            )
        )
        client.view[:] = 0
        wait(
            eng.submit(
                ChunkJob(LaneKey(1, Direction.D2H), Path.DMA, host, b, dst_offset=0, src_offset=0, nbytes=REGION)
            )
        )
        assert np.array_equal(client.view[5 : half - 11], expected[11 : half - 5])
        assert np.array_equal(client.view[half + 5 : REGION - 11], expected[half + 11 : REGION - 5])
        print(eng.statistics()["lanes"])
        for mem in (a, b):
            eng.release_device(mem)
        eng.release_host(host)
    finally:
        eng.close()
        client.close()


class TestOnGpu:
    """The engine on a real GPU."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [
        pytest.mark.gpu,
        pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU with cuda-bindings"),
    ]

    @pytest.mark.parametrize("path", [Path.DMA, Path.EXPRESS])
    @pytest.mark.parametrize("direction", LOCAL_DIRECTIONS)
    def test_copy_is_exact(self, engine: CudaEngine, regions: dict[str, Any], direction: Direction, path: Path) -> None:
        """Every direction and path copies exactly the asked bytes, for odd sizes and offsets, and
        touches nothing around them."""
        rng = np.random.default_rng(7)
        client: HostRegion = regions["client"]
        host, dev_a, dev_b = regions["host"], regions["a"], regions["b"]
        src, dst = {Direction.H2D: (host, dev_a), Direction.D2H: (dev_a, host), Direction.D2D: (dev_a, dev_b)}[
            direction
        ]
        lane = LaneKey(0, direction)
        for size in SIZES:
            for src_off, dst_off in OFFSETS:
                pattern = rng.integers(0, 256, size + 2 * GUARD, dtype=np.uint8)
                canary = np.full(size + 2 * GUARD, 0xA5, dtype=np.uint8)
                self._fill(client, src, src_off, pattern)
                self._fill(client, dst, dst_off, canary)
                wait(
                    engine.submit(
                        ChunkJob(
                            lane, path, dst, src, dst_offset=dst_off + GUARD, src_offset=src_off + GUARD, nbytes=size
                        )
                    )
                )
                got = self._read(client, dst, dst_off, size + 2 * GUARD)
                where = f"{direction.value} {path.value} size {size} src+{src_off} dst+{dst_off}"
                assert np.array_equal(got[GUARD:-GUARD], pattern[GUARD:-GUARD]), where
                assert (got[:GUARD] == 0xA5).all() and (got[-GUARD:] == 0xA5).all(), f"{where}: wrote outside"

    @staticmethod
    def _fill(client: HostRegion, mem: HostMemory | DeviceMemory, offset: int, data: np.ndarray[Any, Any]) -> None:
        import cupy as cp

        if mem.is_host:
            client.view[offset : offset + data.size] = data
        else:
            assert isinstance(mem, DeviceMemory)
            device_view(mem)[offset : offset + data.size] = cp.asarray(data)
            cp.cuda.runtime.deviceSynchronize()

    @staticmethod
    def _read(client: HostRegion, mem: HostMemory | DeviceMemory, offset: int, n: int) -> np.ndarray[Any, Any]:
        if mem.is_host:
            return client.view[offset : offset + n].copy()
        assert isinstance(mem, DeviceMemory)
        out: np.ndarray[Any, Any] = device_view(mem)[offset : offset + n].get()
        return out

    def test_many_chunks_and_strict_stream(self, engine: CudaEngine, regions: dict[str, Any]) -> None:
        """A region copied as 256 DMA chunks arrives whole; strict chunks (high-priority DMA
        stream) and events reused from the pool work too."""
        client: HostRegion = regions["client"]
        host, dev = regions["host"], regions["a"]
        client.view[:] = np.random.default_rng(1).integers(0, 256, REGION, dtype=np.uint8)
        chunk = REGION // 256
        lane = LaneKey(0, Direction.H2D)
        done = [
            engine.submit(
                ChunkJob(
                    lane,
                    Path.DMA,
                    dev,
                    host,
                    dst_offset=i * chunk,
                    src_offset=i * chunk,
                    nbytes=chunk,
                    strict=i % 7 == 0,
                )
            )
            for i in range(256)
        ]
        for completion in done:
            wait(completion)
        assert np.array_equal(device_view(dev).get(), client.view)
        again = [
            engine.submit(ChunkJob(lane, Path.DMA, dev, host, dst_offset=0, src_offset=0, nbytes=4096))
            for _ in range(8)
        ]
        for completion in again:
            wait(completion)

    def test_lanes_and_statistics(self, engine: CudaEngine, regions: dict[str, Any]) -> None:
        """lanes() gives one calibrated lane per direction with the express range; statistics()
        shows calibration, the device and registration times."""
        lanes = {info.key: info for info in engine.lanes()}
        assert set(lanes) == {LaneKey(0, d) for d in LOCAL_DIRECTIONS}
        for key, info in lanes.items():
            assert info.bandwidth > 1e9, key
            assert info.express_max == EXPRESS_MAX
        assert lanes[LaneKey(0, Direction.H2D)].express_min == EXPRESS_MIN_H2D
        stats = engine.statistics()
        assert stats["express"] is True and stats["express_error"] is None
        devices = stats["devices"]
        assert isinstance(devices, list) and devices[0]["name"] and devices[0]["sm_count"] > 0
        lane_stats = stats["lanes"]
        assert isinstance(lane_stats, dict)
        assert lane_stats["gpu0/h2d"]["dma_gbps"] > 1 and lane_stats["gpu0/d2h"]["express_gbps"] > 1
        register = stats["host_register"]
        assert isinstance(register, dict) and register["count"] >= 1 and register["ms_total"] > 0
        print(stats)

    def test_one_gpu_has_no_peer_lanes(self, engine: CudaEngine, regions: dict[str, Any]) -> None:
        """Serving one GPU (as on every machine lent so far), the engine is what it was before
        peer lanes: its three local lanes and nothing else, no peer figures in its statistics,
        and a chunk for a peer lane is refused rather than run somewhere."""
        keys = sorted(info.key for info in engine.lanes())
        assert keys == sorted(LaneKey(0, d) for d in LOCAL_DIRECTIONS)
        lane_stats = engine.statistics()["lanes"]
        assert isinstance(lane_stats, dict) and set(lane_stats) == {"gpu0/h2d", "gpu0/d2h", "gpu0/d2d"}
        assert not any("peer_access" in figures for figures in lane_stats.values())
        with pytest.raises(InvalidRequest, match=r"^this engine has no lane gpu0/peer/gpu1$"):
            engine.submit(
                ChunkJob(
                    LaneKey(0, Direction.PEER, 1),
                    Path.DMA,
                    regions["b"],
                    regions["a"],
                    dst_offset=0,
                    src_offset=0,
                    nbytes=4096,
                )
            )

    def test_each_gpu_is_known_by_its_uuid(self, engine: CudaEngine) -> None:
        """The engine reports each GPU's UUID as nvidia-smi prints it (``GPU-`` and 8-4-4-4-12
        hex, the same as the client-side `gpu_uuid` of that ordinal in this process), maps it
        back to the ordinal in any spelling, and lists it in statistics()."""
        from priod.common.cuda.driver import gpu_uuid, local_ordinal

        uuids = engine.device_uuids()
        assert 0 in uuids
        for ordinal, text in uuids.items():
            assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text), text
            assert text == gpu_uuid(ordinal) == engine.device_uuid(ordinal)
            assert engine.device_ordinal(text.upper()) == ordinal == local_ordinal(text)
        devices = engine.statistics()["devices"]
        assert isinstance(devices, list) and [d["uuid"] for d in devices] == [uuids[d["index"]] for d in devices]
        with pytest.raises(
            InvalidRequest,
            match=r"^this daemon serves no GPU GPU-00000000-0000-0000-0000-000000000000; it serves gpu0=GPU-",
        ):
            engine.device_ordinal("GPU-00000000-0000-0000-0000-000000000000")

    def test_bad_submissions_are_refused(self, engine: CudaEngine, regions: dict[str, Any]) -> None:
        """Mismatched directions, ranges past the end and foreign memory raise InvalidRequest."""
        host, dev = regions["host"], regions["a"]
        with pytest.raises(InvalidRequest):
            engine.submit(
                ChunkJob(LaneKey(0, Direction.H2D), Path.DMA, host, dev, dst_offset=0, src_offset=0, nbytes=16)
            )
        with pytest.raises(InvalidRequest):
            engine.submit(
                ChunkJob(LaneKey(0, Direction.H2D), Path.DMA, dev, host, dst_offset=REGION - 8, src_offset=0, nbytes=16)
            )
        with pytest.raises(InvalidRequest):
            engine.submit(
                ChunkJob(
                    LaneKey(0, Direction.D2D), Path.DMA, dev, DeviceMemory(), dst_offset=0, src_offset=0, nbytes=16
                )
            )
        assert engine.submit(
            ChunkJob(LaneKey(0, Direction.H2D), Path.EXPRESS, dev, host, dst_offset=0, src_offset=0, nbytes=0)
        ).done()

    def test_express_off_and_close(self) -> None:
        """express=False gives lanes without express and refuses express chunks; close() is
        idempotent and later calls raise EngineError."""
        eng = CudaEngine(devices=[0], express=False, calibrate_bytes=0)
        try:
            assert all(info.express_max == 0 for info in eng.lanes())
            client = HostRegion(4096)
            host = eng.map_host(client.fd, 4096)
            dev = eng.alloc_device(4096, 0)
            with pytest.raises(EngineError, match="no express path"):
                eng.submit(
                    ChunkJob(
                        LaneKey(0, Direction.H2D), Path.EXPRESS, dev, host, dst_offset=0, src_offset=0, nbytes=4096
                    )
                )
            wait(
                eng.submit(
                    ChunkJob(LaneKey(0, Direction.H2D), Path.DMA, dev, host, dst_offset=0, src_offset=0, nbytes=4096)
                )
            )
        finally:
            eng.close()
            eng.close()
        client.close()
        with pytest.raises(EngineError, match="closed"):
            eng.alloc_device(16, 0)

    def test_ipc_round_trip_across_processes(self, engine: CudaEngine, regions: dict[str, Any]) -> None:
        """A client's CuPy arrays reach the engine through export_cuda_array/import_device, and
        the engine's allocation reaches the client through its fd (open_device_fd); bytes match both
        ways."""
        client: HostRegion = regions["client"]
        host = regions["host"]
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_ipc_child, args=(child_conn,))
        child.start()
        try:
            assert conn.poll(120), "child did not answer"
            exports = conn.recv()
            assert not isinstance(exports, str), exports
            (h1, off1, n1, d1), (h2, off2, n2, d2) = exports
            assert (n1, n2, d1, d2) == (300_001, 5000, 0, 0) and off2 - off1 == 400_003 - 13
            imported = [engine.import_device(h1, off1, n1, d1), engine.import_device(h2, off2, n2, d2)]
            rng = np.random.default_rng(3)
            client.view[: n1 + n2] = rng.integers(0, 256, n1 + n2, dtype=np.uint8)
            lane = LaneKey(0, Direction.H2D)
            half = n1 // 2
            wait(engine.submit(ChunkJob(lane, Path.DMA, imported[0], host, dst_offset=0, src_offset=0, nbytes=half)))
            wait(
                engine.submit(
                    ChunkJob(lane, Path.EXPRESS, imported[0], host, dst_offset=half, src_offset=half, nbytes=n1 - half)
                )
            )
            wait(engine.submit(ChunkJob(lane, Path.EXPRESS, imported[1], host, dst_offset=0, src_offset=n1, nbytes=n2)))
            conn.send([client.view[:n1].copy(), client.view[n1 : n1 + n2].copy()])
            assert conn.poll(60)
            assert conn.recv() == [True, True]
            for mem in imported:
                engine.release_device(mem)

            mine = engine.alloc_device(1 << 20, 0)
            assert mine.export is not None and mine.export.kind == "vmm_fd" and mine.export.size >= 1 << 20
            client.view[: 1 << 20] = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
            wait(engine.submit(ChunkJob(lane, Path.DMA, mine, host, dst_offset=0, src_offset=0, nbytes=1 << 20)))
            offset = 4099
            conn.send((mine.export.size, offset, (1 << 20) - offset, 0))
            send_handle(conn, mine.export.fd, child.pid)
            conn.send(client.view[offset : 1 << 20].copy())
            assert conn.poll(60)
            assert conn.recv() is True
            client.view[: 1 << 20] = 0
            wait(
                engine.submit(
                    ChunkJob(
                        LaneKey(0, Direction.D2H),
                        Path.EXPRESS,
                        host,
                        mine,
                        dst_offset=0,
                        src_offset=offset,
                        nbytes=(1 << 20) - offset,
                    )
                )
            )
            expected = np.arange((1 << 20) - offset, dtype=np.uint32).astype(np.uint8)[::-1]
            assert np.array_equal(client.view[: (1 << 20) - offset], expected)
            conn.send("done")
            assert conn.poll(60) and conn.recv() == "bye"
            engine.release_device(mine)
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
