"""The CUDA engine's bulk gates on a real GPU (marker ``gpu``; skipped where there is none).

A gated chunk is preceded on its lane's DMA stream by a wait on the lane's gate word
(`priod.daemon.engines.cuda.device.Gates`): while the gate is closed it does not begin, whatever the
stream has ahead of it, and it runs once the gate opens, bytes intact. Another lane's gate is
its own. Single chunks and a batch's chunk (enqueued by the pusher's thread) alike. An urgent
(strict) chunk on the same lane is not held by the gate.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from priod.common.types import Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob, Completion

pytestmark = pytest.mark.gpu

REGION = 256 << 20
TAIL = 4 << 20
H2D, D2H = LaneKey(0, Direction.H2D), LaneKey(0, Direction.D2H)


def _wait(c: Completion) -> None:
    deadline = time.monotonic() + 20
    while not c.done():
        assert time.monotonic() < deadline, "a chunk did not complete in time"
    c.release()


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from priod.daemon.engines.cuda.engine import CudaEngine

    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    yield eng
    eng.close()


@contextlib.contextmanager
def _buffers(engine: Any, seed: int) -> Iterator[tuple[np.ndarray, Any, Any]]:
    """A host region of 2 x REGION (the first half random) and a device region of REGION."""
    fd = os.memfd_create("priod-test")
    os.ftruncate(fd, 2 * REGION)
    mapping = mmap.mmap(fd, 2 * REGION)
    view = np.frombuffer(mapping, dtype=np.uint8)
    host = engine.map_host(fd, 2 * REGION)
    dev = engine.alloc_device(REGION, 0)
    try:
        view[:REGION] = np.random.default_rng(seed).integers(0, 256, REGION, dtype=np.uint8)
        yield view, host, dev
    finally:
        engine.set_gates(frozenset())
        engine.release_device(dev)
        engine.release_host(host)
        os.close(fd)  # the mapping goes with the test's last view of it


def _strict_passes_then_the_gate_opens(engine: Any, gated: Completion, view: np.ndarray, host: Any, dev: Any) -> None:
    """An urgent chunk goes on the lane's strict stream, which has no wait on the gate: it runs
    while the gated chunk waits (the sim models this: tests/test_sim_cotenant.py). Once the gate
    opens the gated chunk runs, and every byte landed."""
    strict = engine.submit(ChunkJob(H2D, Path.DMA, dev, host, dst_offset=0, src_offset=0, nbytes=TAIL, strict=True))
    _wait(strict)
    assert not gated.done()
    engine.set_gates(frozenset())
    _wait(gated)
    back = engine.submit(ChunkJob(D2H, Path.DMA, host, dev, dst_offset=REGION, src_offset=0, nbytes=REGION))
    _wait(back)
    assert np.array_equal(view[REGION:], view[:REGION])


@pytest.mark.parametrize("form", ["chunk", "batch", "one lane"])
def test_a_closed_gate_holds_a_queued_chunk_until_it_opens(engine: Any, form: str) -> None:
    """``one lane``: the gate closed by `set_gate`, the pump's per-chunk call, not `set_gates`."""
    assert engine.statistics()["bulk_gates"] is True, engine.statistics()["bulk_gates_error"]
    with _buffers(engine, 3) as (view, host, dev):
        head = REGION - TAIL
        if form == "one lane":
            engine.set_gate(H2D, frozenset({H2D}))
        else:
            engine.set_gates(frozenset({H2D}))
        first = engine.submit(
            ChunkJob(H2D, Path.DMA, dev, host, dst_offset=0, src_offset=0, nbytes=head)
        )  # not gated: runs
        if form != "batch":
            gated = engine.submit(
                ChunkJob(H2D, Path.DMA, dev, host, dst_offset=head, src_offset=head, nbytes=TAIL, gated=True)
            )
        else:
            offsets = np.arange(head, REGION, 64 << 10, dtype=np.uint64)[::-1]
            cells = np.stack([offsets, offsets, np.full(len(offsets), 64 << 10, dtype=np.uint64)], axis=1)
            gated = engine.submit(ChunkJob(H2D, Path.DMA, dev, host, cells=cells, gated=True))
        # The other lane's gate is open: its gated chunk goes while h2d's waits.
        other = engine.submit(
            ChunkJob(D2H, Path.DMA, host, dev, dst_offset=REGION, src_offset=0, nbytes=TAIL, gated=True)
        )
        _wait(other)
        _wait(first)
        time.sleep(0.05)  # 4 MiB would take ~80 us: still not done means it has not begun
        assert not gated.done()
        _strict_passes_then_the_gate_opens(engine, gated, view, host, dev)


def test_a_gate_closed_while_the_chunk_ahead_runs_holds_the_chunk_behind_it(engine: Any) -> None:
    """The gate is read when the chunk ahead has ended, not when the gated chunk was queued: a
    gate closed while the chunk ahead runs still holds the gated one, so an urgent chunk waits
    for the running chunk only. The daemon closes a lane's gate for its own urgent DMA chunks on
    this (`Pump`), and a client's hold for its direct copies."""
    assert engine.statistics()["bulk_gates"] is True, engine.statistics()["bulk_gates_error"]
    with _buffers(engine, 5) as (view, host, dev):
        head = REGION - TAIL
        engine.set_gates(frozenset())
        first = engine.submit(ChunkJob(H2D, Path.DMA, dev, host, dst_offset=0, src_offset=0, nbytes=head, gated=True))
        gated = engine.submit(
            ChunkJob(H2D, Path.DMA, dev, host, dst_offset=head, src_offset=head, nbytes=TAIL, gated=True)
        )
        time.sleep(0.0005)  # the first (252 MiB, milliseconds) has begun; the second is queued behind it
        assert not first.done()
        engine.set_gates(frozenset({H2D}))
        _wait(first)
        time.sleep(0.05)
        assert not gated.done(), "a gate closed while the chunk ahead ran did not hold the chunk behind it"
        _strict_passes_then_the_gate_opens(engine, gated, view, host, dev)
