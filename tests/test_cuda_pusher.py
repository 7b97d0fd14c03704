"""Bulk batch chunks enqueued off the event loop (priod/daemon/engines/cuda/pusher.py), on any machine:
the pusher runs jobs in order on its own thread and keeps their errors; the CUDA engine sends a
bulk batch's chunk there (an urgent one it enqueues at once), does not call the chunk done before
it is on its stream, and queues a signal_event behind a chunk still waiting. Whether the bytes
land is tests/test_gpu_batch.py's (marker gpu)."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_cuda_peer_calls import Runtime, _dev, _engine

from priod.common.cuda.batched import GATED_CALL_SEGMENTS
from priod.common.types import Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob
from priod.daemon.engines.cuda.events import CudaIpcEvent, EventCompletion
from priod.daemon.engines.cuda.pusher import Pusher
from priod.errors import CudaError, EngineError


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_jobs_run_in_order_on_another_thread_and_keep_their_errors() -> None:
    pusher = Pusher("test-pusher")
    seen: list[tuple[int, str]] = []
    gate = threading.Event()

    def job(i: int) -> Any:
        def run() -> None:
            gate.wait(10)
            seen.append((i, threading.current_thread().name))
            if i == 2:
                raise CudaError("CUDA_ERROR_ILLEGAL_ADDRESS", "job 2 failed")

        return run

    tickets = [pusher.push(job(i)) for i in range(5)]
    assert not any(t.done for t in tickets) and pusher.pending == 5  # queued, or running (the first, held)
    gate.set()
    _wait(lambda: tickets[-1].done)
    assert seen == [(i, "test-pusher") for i in range(5)]
    assert [t.error is not None for t in tickets] == [False, False, True, False, False] and pusher.pending == 0
    pusher.close()
    with pytest.raises(EngineError, match="closing"):
        pusher.push(lambda: None)


def test_close_runs_what_is_queued_first() -> None:
    pusher = Pusher("test-pusher")
    gate = threading.Event()
    ran: list[int] = []

    def first() -> None:
        gate.wait(10)
        ran.append(0)

    pusher.push(first)
    last = pusher.push(lambda: ran.append(1))
    threading.Timer(0.05, gate.set).start()
    pusher.close()
    assert ran == [0, 1] and last.done


class _Blocked:
    """The bulk batches' BatchedDma, recording each call and its thread, held until released."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.release = threading.Event()
        self.threads: list[str] = []
        self.call_segments: list[int] = []

    def copy(self, *args: Any, each_call: Callable[[], None] | None = None, call_segments: int = 0) -> None:
        self.release.wait(10)
        self.threads.append(threading.current_thread().name)
        self.call_segments.append(call_segments)
        if each_call is not None:
            each_call()  # as BatchedDma does before each of its calls (one call here)
        self.rt.calls.append((self.rt.current, "batched", *args))


def _pushing_engine(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Runtime, _Blocked]:
    rt = Runtime(can=set())
    eng = _engine(monkeypatch, rt, 1)
    eng._pusher = Pusher("priod-cuda-pusher")
    eng._bulk_batched = blocked = _Blocked(rt)  # type: ignore[assignment]
    lane = eng._devices[0].d2d
    lane.dma, lane.strict = "bulk-stream", "strict-stream"  # the stand-in opened no local streams
    record = rt.cudaEventRecord

    def recorded(event: Any, stream: Any) -> tuple[Any, ...]:
        rt.calls.append((rt.current, "record", event, stream))
        return record(event, stream)

    rt.cudaEventRecord = recorded  # type: ignore[method-assign]
    return eng, rt, blocked


def _submit(eng: Any, strict: bool = False) -> Any:
    """A chunk of two segments on gpu0/d2d (the calls recorded so far cleared first)."""
    eng._rt.calls.clear()
    cells = np.array([[0, 0, 16], [64, 64, 32]], np.uint64)
    return eng.submit(
        ChunkJob(LaneKey(0, Direction.D2D), Path.DMA, _dev(5000, 0), _dev(9000, 0), cells=cells, strict=strict)
    )


def test_a_bulk_batch_chunk_is_enqueued_by_the_pusher_and_not_done_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk: the batched call and the chunk's event record run on the pusher's thread, in that
    order, on the lane's bulk stream; until then the completion is not done (the fake's event
    query says complete: an event not yet recorded reads so on CUDA too). Urgent (strict): the
    batched call at once, on the caller's thread."""
    eng, rt, blocked = _pushing_engine(monkeypatch)
    bulk = _submit(eng)
    assert isinstance(bulk, EventCompletion) and bulk.pending and not bulk.done()
    assert not [c for c in rt.calls if c[1] in ("batched", "record")]
    blocked.release.set()
    _wait(lambda: not bulk.pending)
    assert bulk.done()
    assert [c[1] for c in rt.calls if c[1] in ("batched", "record")] == ["batched", "record"]
    assert blocked.threads == ["priod-cuda-pusher"]
    assert [c[-1] for c in rt.calls if c[1] in ("batched", "record")] == ["bulk-stream", "bulk-stream"]

    eng._batched = types.SimpleNamespace(
        copy=lambda *a: rt.calls.append((rt.current, "urgent_batched", threading.current_thread().name))
    )
    urgent = _submit(eng, strict=True)
    assert [c for c in rt.calls if c[1] == "urgent_batched"] == [(0, "urgent_batched", threading.current_thread().name)]
    assert isinstance(urgent, EventCompletion) and not urgent.pending
    eng._pusher.close()


def test_a_signal_event_waits_behind_a_chunk_still_with_the_pusher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy's signal_event recorded while its last chunk waits for the pusher is recorded
    after that chunk, on its stream; a failed enqueue makes the chunk fail with the error."""
    eng, rt, blocked = _pushing_engine(monkeypatch)
    chunk = _submit(eng)
    signal = CudaIpcEvent("client-event", 0, eng._devices[0].events, lambda e: None)
    eng.record_event(signal, [chunk])
    assert not [c for c in rt.calls if c[1] == "record"]  # nothing recorded ahead of the chunk
    blocked.release.set()
    _wait(lambda: eng._pusher.pending == 0 and len([c for c in rt.calls if c[1] == "record"]) == 2)
    records = [c[2:] for c in rt.calls if c[1] == "record"]
    assert records[1] == ("client-event", "bulk-stream") and records[0][1] == "bulk-stream"

    def fail(*args: Any, **options: Any) -> None:
        raise CudaError("CUDA_ERROR_INVALID_VALUE", "bad batch")

    eng._bulk_batched = types.SimpleNamespace(copy=fail)
    failed = _submit(eng)
    _wait(lambda: eng._pusher.pending == 0)
    _wait(lambda: not isinstance(failed, EventCompletion) or failed.ticket is None or failed.ticket.done)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        failed.done()
    eng._pusher.close()


def test_an_event_closed_while_its_record_waits_is_destroyed_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's event closed (its connection ended) while its record still waits behind a
    chunk in the pusher's queue is destroyed after the record, not before it; with nothing
    waiting, at once."""
    eng, rt, blocked = _pushing_engine(monkeypatch)
    eng._ipc_events = set()
    destroy = rt.cudaEventDestroy

    def destroyed(event: Any) -> tuple[Any, ...]:
        rt.calls.append((rt.current, "destroy", event))
        return destroy(event)

    rt.cudaEventDestroy = destroyed  # type: ignore[method-assign]
    chunk = _submit(eng)
    signal = CudaIpcEvent("client-event", 0, eng._devices[0].events, eng._close_event)
    eng.record_event(signal, [chunk])
    signal.close()
    assert not [c for c in rt.calls if c[1] in ("record", "destroy")]
    blocked.release.set()
    _wait(lambda: eng._pusher.pending == 0)
    assert [c[1:3] for c in rt.calls if c[1] in ("batched", "record", "destroy")][1:] == [
        ("record", "chunk-event"),
        ("record", "client-event"),
        ("destroy", "client-event"),
    ]
    rt.calls.clear()
    idle = CudaIpcEvent("idle-event", 0, eng._devices[0].events, eng._close_event)
    idle.close()
    assert [c[1:3] for c in rt.calls] == [("destroy", "idle-event")]
    eng._pusher.close()


def test_a_gated_bulk_batch_chunk_waits_on_its_gate_first_on_the_pushers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gated bulk chunk (`Engine.set_gates`): the wait on the lane's gate word goes on the
    lane's bulk stream right before each batched call (calls of `GATED_CALL_SEGMENTS`), all on
    the pusher's thread; a chunk not gated, or a lane without a gate, enqueues no wait and goes
    in the bulk calls' own size."""
    eng, rt, blocked = _pushing_engine(monkeypatch)
    lane = eng._devices[0].d2d
    lane.dma_cu = "bulk-cu"
    eng._gate_eq = "eq"

    def wait_value(stream: Any, address: Any, value: int, flags: Any) -> tuple[Any, ...]:
        rt.calls.append((rt.current, "wait", stream, address, value, flags, threading.current_thread().name))
        return (rt.cudaError_t.cudaSuccess,)

    eng._wait_value = wait_value
    blocked.release.set()
    cells = np.array([[0, 0, 16], [64, 64, 32]], np.uint64)
    for gated, gate in ((True, "gate-word"), (False, "gate-word"), (True, None)):
        lane.gate = gate
        rt.calls.clear()
        c = eng.submit(
            ChunkJob(LaneKey(0, Direction.D2D), Path.DMA, _dev(5000, 0), _dev(9000, 0), cells=cells, gated=gated)
        )
        _wait(lambda c=c: not c.pending)
        kinds = [call[1] for call in rt.calls if call[1] in ("wait", "batched", "record")]
        if gated and gate is not None:
            assert kinds == ["wait", "batched", "record"] and blocked.call_segments[-1] == GATED_CALL_SEGMENTS
            wait = next(call for call in rt.calls if call[1] == "wait")
            assert wait[2:6] == ("bulk-cu", "gate-word", 0, "eq") and wait[6] == "priod-cuda-pusher"
        else:
            assert kinds == ["batched", "record"] and blocked.call_segments[-1] == 0
    eng._pusher.close()
