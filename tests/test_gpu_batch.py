"""Batched copies on a real GPU (marker ``gpu``; skipped where there is none): the CUDA engine's
``submit`` of a batch chunk by ``cuMemcpyBatchAsync``, by its per-segment fallback and by the express
kernel's table form, each direction, odd offsets and sizes, bytes checked; and copy_batch
through a cuda daemon."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import priod
from priod.common.types import LOCAL_DIRECTIONS, Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob, Completion, Memory
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess
from priod.wire.batch import Segments, encode_segments

pytestmark = pytest.mark.gpu

REGION = 8 << 20


def _table(seed: int, n: int = 300) -> Segments:
    """``n`` segments of odd sizes (1 B .. 20 KiB) at odd offsets, no two destinations touching:
    more than one express launch's worth (128), every alignment class of the kernel."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 20 << 10, n)
    slot = REGION // n
    dst = np.arange(n) * slot + rng.integers(0, slot - sizes)
    src = rng.permutation(n) * slot + rng.integers(0, slot - sizes)
    return Segments.decode(encode_segments(np.stack([dst, src, sizes], axis=1)))


def _wait(c: Completion) -> None:
    deadline = time.monotonic() + 20
    while not c.done():
        assert time.monotonic() < deadline, "a chunk did not complete in time"
    c.release()


class _Host:
    def __init__(self, engine: Any) -> None:
        self.fd = os.memfd_create("priod-test")
        os.ftruncate(self.fd, REGION)
        self.mapping = mmap.mmap(self.fd, REGION)
        self.view = np.frombuffer(self.mapping, dtype=np.uint8)
        self.mem = engine.map_host(self.fd, REGION)

    def close(self, engine: Any) -> None:
        engine.release_host(self.mem)
        del self.view
        self.mapping.close()
        os.close(self.fd)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from priod.daemon.engines.cuda.engine import CudaEngine

    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    yield eng
    eng.close()


@pytest.mark.parametrize("peaks", ["given", "found"])
@pytest.mark.parametrize("mode", ["batched", "per-segment", "express"])
@pytest.mark.parametrize("direction", LOCAL_DIRECTIONS)
def test_engine_segments_are_exact(engine: Any, direction: Direction, mode: str, peaks: str) -> None:
    """300 scattered odd segments land exactly, nothing else changes, each way and path (the
    device side read back through plain DMA chunks); with the table's peaks handed in, as the
    daemon hands a whole batch's, and found by the engine, as for a piece of one."""
    if mode == "batched" and engine._batched.error:
        pytest.skip(f"no cuMemcpyBatchAsync here: {engine._batched.error}")
    rng = np.random.default_rng(1)
    src_h, dst_h = _Host(engine), _Host(engine)
    dev_a, dev_b = engine.alloc_device(REGION, 0), engine.alloc_device(REGION, 0)
    saved = engine._batched.error
    try:
        if mode == "per-segment":
            engine._batched.error = "forced by the test"
        table = _table(seed=2)
        src_h.view[:] = rng.integers(0, 256, REGION, dtype=np.uint8)
        dst_h.view[:] = rng.integers(0, 256, REGION, dtype=np.uint8)
        h2d, d2h = LaneKey(0, Direction.H2D), LaneKey(0, Direction.D2H)

        def whole(lane: LaneKey, dst: Memory, src: Memory) -> None:
            _wait(engine.submit(ChunkJob(lane, Path.DMA, dst, src, dst_offset=0, src_offset=0, nbytes=REGION)))

        # Put the source and the destination's old bytes where the direction wants them.
        src, dst = {
            Direction.H2D: (src_h.mem, dev_a),
            Direction.D2H: (dev_a, dst_h.mem),
            Direction.D2D: (dev_a, dev_b),
        }[direction]
        want = dst_h.view.copy()
        if direction is not Direction.H2D:
            whole(h2d, dev_a, src_h.mem)
        if direction is not Direction.D2H:
            whole(h2d, dst, dst_h.mem)
        path = Path.EXPRESS if mode == "express" else Path.DMA
        _wait(
            engine.submit(
                ChunkJob(
                    LaneKey(0, direction),
                    path,
                    dst,
                    src,
                    cells=table.cells,
                    peaks=table.peaks if peaks == "given" else None,
                )
            )
        )
        if mode == "batched":
            # A batched call that failed on first use falls back to the loop silently (and says
            # so in status): here that must fail the test, or it would pass without the API.
            assert engine._batched.error is None, engine._batched.error
        if direction is not Direction.D2H:
            dst_h.view[:] = 0
            whole(d2h, dst_h.mem, dst)
        for d, s, n in zip(table.dst.tolist(), table.src.tolist(), table.size.tolist(), strict=True):
            want[d : d + n] = src_h.view[s : s + n]
        assert np.array_equal(dst_h.view, want)
    finally:
        engine._batched.error = saved
        for mem in (dev_a, dev_b):
            engine.release_device(mem)
        for h in (src_h, dst_h):
            h.close(engine)


@pytest.mark.parametrize("path", [Path.DMA, Path.EXPRESS])
def test_engine_refuses_a_row_outside_its_region_with_or_without_peaks(engine: Any, path: Path) -> None:
    """The engine's own bound holds whether the caller hands in the table's peaks or not: the
    peaks say where to look, not that the rows fit."""
    src_h = _Host(engine)
    dev = engine.alloc_device(REGION, 0)
    try:
        table = Segments.decode(np.array([[0, 0, 4096], [REGION - 4096, 8192, 8192]], "<u8").tobytes())
        for peaks in (table.peaks, None):
            with pytest.raises(InvalidRequest, match="falls outside its region"):
                engine.submit(
                    ChunkJob(
                        LaneKey(0, Direction.H2D), path, dev, src_h.mem, cells=table.cells, strict=True, peaks=peaks
                    )
                )
    finally:
        engine.release_device(dev)
        src_h.close(engine)


@pytest.mark.parametrize("priority", ["normal", "urgent"])
def test_copy_batch_through_the_daemon(gpu_daemon: DaemonProcess, priority: str) -> None:
    """256 scattered 64 KiB blocks host -> device -> device -> host as three batches (DMA for
    normal; urgent ones take whichever path the daemon finds faster): the blocks come back where
    the segments say, and the daemon's DMA path is cuMemcpyBatchAsync (CUDA >= 12.8)."""
    block, n = 64 << 10, 256
    rng = np.random.default_rng(3)
    with priod.SyncClient(gpu_daemon.socket_path, copy_path="daemon") as c:
        h, back = c.alloc_host(2 * n * block), c.alloc_host(2 * n * block)
        d1, d2 = c.alloc_device(2 * n * block), c.alloc_device(2 * n * block)
        assert h.array is not None and back.array is not None
        h.array[:] = rng.integers(0, 256, 2 * n * block, dtype=np.uint8)
        back.array[:] = 0

        def blocks(seed: int) -> npt.NDArray[np.int64]:
            r = np.random.default_rng(seed)
            return np.stack(
                [
                    r.choice(2 * n, n, replace=False) * block,
                    r.choice(2 * n, n, replace=False) * block,
                    np.full(n, block),
                ],
                axis=1,
            )

        a, b, z = blocks(4), blocks(5), blocks(6)
        results = [
            c.copy_batch(d1, h, a, priority=priority),
            c.copy_batch(d2, d1, b, priority=priority),
            c.copy_batch(back, d2, z, priority=priority),
        ]
        assert all(r.segments == n and r.nbytes == n * block for r in results)
        engine = c.status()["engine"]
        assert engine["batch_dma"] == "cuMemcpyBatchAsync", engine.get("batch_dma_error")
        stage1 = np.zeros_like(h.array)
        for d, s, k in a:
            stage1[d : d + k] = h.array[s : s + k]
        stage2 = np.zeros_like(h.array)
        for d, s, k in b:
            stage2[d : d + k] = stage1[s : s + k]
        want = np.zeros_like(h.array)
        for d, s, k in z:
            want[d : d + k] = stage2[s : s + k]
        # Device bytes never written are undefined (cudaMalloc): compare only blocks that carry
        # host bytes all the way.
        carried = np.zeros(2 * n * block, bool)
        c1 = np.zeros(2 * n * block, bool)
        for d, _, k in a:
            c1[d : d + k] = True
        c2 = np.zeros_like(c1)
        for d, s, k in b:
            c2[d : d + k] = c1[s : s + k]
        for d, s, k in z:
            carried[d : d + k] = c2[s : s + k]
        assert carried.sum() > 0
        assert np.array_equal(back.array[carried], want[carried])
