"""The CUDA engine's peer lanes against the fake CUDA (`priod.testing.FakeCuda`), on any machine: which calls set them
up (peer access where the hardware allows it, two streams per ordered pair on the source GPU),
how calibration times each pair, and that one GPU makes no call at all. No machine with two GPUs
has been lent, so this is the only place the set-up code has run; whether bytes land between
two real GPUs is tests/test_cuda_engine.py's two-GPU test (marker gpu, never run yet)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Set
from typing import Any

import numpy as np
import pytest

from priod.common.cuda.driver import BindingsOverride, use_bindings
from priod.common.types import Direction, LaneKey, Path
from priod.daemon.engines.base import ChunkJob
from priod.daemon.engines.cuda import device
from priod.daemon.engines.cuda.calibrate import NOMINAL
from priod.daemon.engines.cuda.device import Device
from priod.daemon.engines.cuda.engine import CudaEngine
from priod.daemon.engines.cuda.memory import CudaDeviceMemory
from priod.daemon.engines.cuda.peer import open_peer_lanes
from priod.errors import EngineError, InvalidRequest
from priod.testing import FakeCall, FakeCuda, RuntimeStatus

REFUSED, ALREADY = RuntimeStatus.cudaErrorPeerAccessUnsupported, RuntimeStatus.cudaErrorPeerAccessAlreadyEnabled
Pairs = Set[tuple[int, int]]
EVENTS = ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery")
"""What a chunk's completion costs, beside its copy."""


def _fake(n: int, can: Pairs, refuse: Pairs = frozenset(), already: Pairs = frozenset()) -> FakeCuda:
    """The fake CUDA with ``n`` GPUs, as far as peer set-up, calibration and a peer chunk use it:
    peer access allowed for the pairs ``can``, refused for ``refuse``, enabled before for
    ``already``; streams named ``s<n>@<device>``, a buffer at 1000 * (device + 1), every timed
    copy 2 ms."""
    cuda = FakeCuda(device_count=n)
    rt = cuda.runtime
    streams = iter(range(1, 1 << 30))

    def enable(peer: int, flags: int) -> tuple[Any, ...]:
        pair = (cuda.device, peer)
        return (REFUSED,) if pair in refuse else (ALREADY,) if pair in already else rt.ok()

    rt.script(
        cudaEventQuery=rt.ok(),
        cudaDeviceGetStreamPriorityRange=rt.ok(0, -5),
        cudaDeviceCanAccessPeer=lambda a, b: rt.ok(int((a, b) in can)),
        cudaDeviceEnablePeerAccess=enable,
        cudaStreamCreateWithPriority=lambda flags, priority: rt.ok(f"s{next(streams)}@{cuda.device}"),
        cudaMalloc=lambda nbytes: rt.ok(1000 * (cuda.device + 1)),
        cudaFree=rt.ok(),
        cudaMemcpyPeerAsync=rt.ok(),
        cudaEventCreate=rt.ok("event"),
        cudaEventRecord=rt.ok(),
        cudaEventSynchronize=rt.ok(),
        cudaStreamSynchronize=rt.ok(),
        cudaEventElapsedTime=rt.ok(2.0),  # ms: every timed copy takes 2 ms
        cudaEventDestroy=rt.ok(),
        cudaEventCreateWithFlags=rt.ok("chunk-event"),
    )
    return cuda


def at(cuda: FakeCuda, name: str) -> list[tuple[Any, ...]]:
    """The calls of ``name``: (the device current then, *args)."""
    return [(c.device, *c.args) for c in cuda.calls_to(name)]


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, /, **kw: Any) -> None:
        self.records.append(("info", event, kw))

    def warning(self, event: str, /, **kw: Any) -> None:
        self.records.append(("warning", event, kw))


Gpus = Callable[..., tuple[FakeCuda, dict[int, Device]]]
"""``gpus(n, can, refuse=..., already=...)``: see the `gpus` fixture."""


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gpus]:
    """The `_fake` CUDA of ``n`` GPUs, installed until the test ends, and a `Device` for each
    (made without a CUDA call)."""
    monkeypatch.setattr(device, "_kinds", {})  # cudaMemcpyKind values cached from other bindings
    with contextlib.ExitStack() as stack:

        def make(
            n: int, can: Pairs, refuse: Pairs = frozenset(), already: Pairs = frozenset()
        ) -> tuple[FakeCuda, dict[int, Device]]:
            cuda = stack.enter_context(_fake(n, can, refuse, already))
            return cuda, {i: Device(i) for i in range(n)}

        yield make


def _use(cuda: FakeCuda) -> Callable[[int], None]:
    """Make a device current as the engine's ``use`` does (here without a call)."""

    def use(index: int) -> None:
        cuda.device = index

    return use


def test_one_gpu_makes_no_peer_call_and_no_peer_lane(gpus: Gpus) -> None:
    """One GPU: no peer lane, and not one CUDA call (the single-GPU engine is as it was)."""
    cuda, devices = gpus(1, can={(0, 1)})
    log = Log()
    open_peer_lanes(devices, _use(cuda), 64 << 20, log)
    assert cuda.calls == [] and log.records == []
    assert devices[0].peers == {} and [lane.key for lane in devices[0].lanes] == [
        LaneKey(0, d) for d in (Direction.H2D, Direction.D2H, Direction.D2D)
    ]


def test_each_ordered_pair_gets_streams_on_its_source_and_peer_access_where_allowed(gpus: Gpus) -> None:
    """Three GPUs: six peer lanes, each with a low- and a high-priority stream made on its
    source GPU. Peer access is asked for only where the hardware allows it; "already enabled"
    counts as enabled; a refusal is logged, cleared from the last error, and leaves the lane
    working without it (staged copies). No calibration with 0 bytes: the nominal rate."""
    cuda, devices = gpus(3, can={(0, 1), (1, 0), (0, 2), (2, 0)}, refuse={(2, 0)}, already={(1, 0)})
    log = Log()
    open_peer_lanes(devices, _use(cuda), 0, log)
    keys = [lane.key for dev in devices.values() for lane in dev.lanes if lane.key.direction is Direction.PEER]
    assert keys == [LaneKey(a, Direction.PEER, b) for a in range(3) for b in range(3) if a != b]
    access = {(a, b): lane.peer_access for a, dev in devices.items() for b, lane in dev.peers.items()}
    assert access == {(0, 1): True, (0, 2): True, (1, 0): True, (1, 2): False, (2, 0): False, (2, 1): False}
    assert at(cuda, "cudaDeviceEnablePeerAccess") == [
        (0, 1, 0),
        (0, 2, 0),
        (1, 0, 0),
        (2, 0, 0),
    ]  # (current, peer, flags)
    assert at(cuda, "cudaStreamCreateWithPriority") == [
        (a, 1, p) for a in range(3) for _ in range(2) for p in (0, -5)
    ]  # (current, non-blocking, priority)
    for a, dev in devices.items():
        for lane in dev.peers.values():
            assert lane.dma.endswith(f"@{a}") and lane.strict.endswith(f"@{a}") and lane.express is None
            assert lane.dma_bandwidth == NOMINAL[Direction.PEER] and lane.express_max == 0
    assert [r for r in log.records if r[0] == "warning"] == [
        (
            "warning",
            "cuda peer access",
            {
                "src": 2,
                "dst": 0,
                "error": "cudaErrorPeerAccessUnsupported",
                "effect": "copies stage through host memory",
            },
        )
    ]
    assert not cuda.calls_to("cudaMalloc") and not cuda.calls_to("cudaMemcpyPeerAsync")


def test_calibration_times_one_peer_copy_per_pair_and_frees_its_buffers(gpus: Gpus) -> None:
    """With calibrate_bytes set: one buffer per GPU (made on it), each pair's copy issued from
    the source GPU on the lane's DMA stream with both GPUs named, its rate from the timed copy
    (64 MiB in 2 ms here), the figures logged, and every buffer freed on its own GPU."""
    cuda, devices = gpus(2, can={(0, 1), (1, 0)})
    log = Log()
    nbytes = 64 << 20
    open_peer_lanes(devices, _use(cuda), nbytes, log)
    assert at(cuda, "cudaMalloc") == [(0, nbytes), (1, nbytes)]
    copies = at(cuda, "cudaMemcpyPeerAsync")  # (current, dst, dst device, src, src device, nbytes, stream)
    assert {(c[0], c[2], c[4]) for c in copies} == {(0, 1, 0), (1, 0, 1)}
    first = next(c for c in copies if c[0] == 0)
    assert first == (0, 2000, 1, 1000, 0, nbytes, devices[0].peers[1].dma)
    for dev in devices.values():
        for lane in dev.peers.values():
            assert lane.dma_bandwidth == pytest.approx(nbytes / 2e-3)
    assert at(cuda, "cudaFree") == [(0, 1000), (1, 2000)]
    calibration = [r for r in log.records if r[1] == "cuda peer calibration"]
    assert calibration == [
        ("info", "cuda peer calibration", {"bytes": nbytes, "gpu0_to_gpu1_gbps": 33.55, "gpu1_to_gpu0_gbps": 33.55})
    ]


BATCHED = "BatchedDma.copy"
"""What the engine's batched call is logged as here."""
QUIET = ("cudaSetDevice", *EVENTS)
"""Calls a chunk makes beside its copies."""


def _peer_engine(cuda: FakeCuda, devices: dict[int, Device]) -> CudaEngine:
    """A CudaEngine over fake GPUs with peer lanes, built without the constructor (which opens
    real devices); ``_batched`` logs any call (as `BATCHED`), which a peer chunk must not make."""
    open_peer_lanes(devices, _use(cuda), 0, Log())
    eng = object.__new__(CudaEngine)
    eng._rt, eng._devices, eng._closed, eng._current, eng._express_error = cuda.runtime, devices, False, None, None
    eng._batched = types.SimpleNamespace(copy=lambda *a: cuda.calls.append(FakeCall(BATCHED, a, cuda.device)))  # type: ignore[assignment]
    return eng


def _dev(pointer: int, gpu: int) -> CudaDeviceMemory:
    return CudaDeviceMemory(pointer, 1 << 20, gpu)


def test_a_peer_chunk_is_one_peer_copy_on_the_source_gpu_naming_both(gpus: Gpus) -> None:
    """A chunk on gpu0/peer/gpu1 is one cudaMemcpyPeerAsync from GPU 0 (current), on the lane's
    bulk stream (strict: its high-priority one), with offsets applied and both GPUs named; a
    batch's chunk is one such call per segment, never the batched call."""
    cuda, devices = gpus(2, can={(0, 1), (1, 0)})
    eng = _peer_engine(cuda, devices)
    lane, info = LaneKey(0, Direction.PEER, 1), eng._devices[0].peers[1]
    src, dst = _dev(9000, 0), _dev(5000, 1)
    eng.submit(ChunkJob(lane, Path.DMA, dst, src, dst_offset=16, src_offset=32, nbytes=100))
    eng.submit(ChunkJob(lane, Path.DMA, dst, src, dst_offset=0, src_offset=0, nbytes=8, strict=True))
    assert at(cuda, "cudaMemcpyPeerAsync") == [
        (0, 5016, 1, 9032, 0, 100, info.dma),
        (0, 5000, 1, 9000, 0, 8, info.strict),
    ]
    cuda.calls.clear()
    eng.submit(ChunkJob(lane, Path.DMA, dst, src, cells=np.array([[0, 8, 16], [64, 200, 32]], np.uint64)))
    assert [(c.device, c.name, *c.args) for c in cuda.calls if c.name not in QUIET] == [
        (0, "cudaMemcpyPeerAsync", 5000, 1, 9008, 0, 16, info.dma),
        (0, "cudaMemcpyPeerAsync", 5064, 1, 9200, 0, 32, info.dma),
    ]


def test_a_chunk_whose_ends_do_not_fit_its_lane_is_refused(gpus: Gpus) -> None:
    """Across GPUs only the pair's peer lane is right: a d2d lane with ends on two GPUs, a peer
    lane whose destination is another GPU than its peer, a peer lane the engine lacks, and the
    express path (peer lanes have none) are refused, and nothing is issued."""
    cuda, devices = gpus(3, can=set())
    eng = _peer_engine(cuda, devices)
    cuda.calls.clear()
    on0, on1, on2 = _dev(1000, 0), _dev(2000, 1), _dev(3000, 2)
    with pytest.raises(InvalidRequest, match=r"^lane gpu0/d2d got gpu0 -> gpu1: a device end is on another GPU$"):
        eng.submit(ChunkJob(LaneKey(0, Direction.D2D), Path.DMA, on1, on0, dst_offset=0, src_offset=0, nbytes=64))
    with pytest.raises(InvalidRequest, match=r"^lane gpu0/peer/gpu1 got gpu0 -> gpu2: a device end is on another GPU$"):
        eng.submit(ChunkJob(LaneKey(0, Direction.PEER, 1), Path.DMA, on2, on0, dst_offset=0, src_offset=0, nbytes=64))
    with pytest.raises(InvalidRequest, match=r"^this engine has no lane gpu0/peer/gpu7$"):
        eng.submit(ChunkJob(LaneKey(0, Direction.PEER, 7), Path.DMA, on1, on0, dst_offset=0, src_offset=0, nbytes=64))
    with pytest.raises(EngineError, match=r"^lane gpu0/peer/gpu1 has no express path"):
        eng.submit(
            ChunkJob(LaneKey(0, Direction.PEER, 1), Path.EXPRESS, on1, on0, dst_offset=0, src_offset=0, nbytes=64)
        )
    assert not any(c.name in ("cudaMemcpyPeerAsync", "cudaMemcpyAsync", BATCHED) for c in cuda.calls)


# -- for tests/test_cuda_pusher.py, which builds its engine here ---------------------------------


class Runtime:
    """The runtime of an `_engine`, for tests that log the calls they look at themselves
    (tests/test_cuda_pusher.py): `_fake`'s runtime answers behind it, ``calls`` is the test's
    log (each entry starting with the device current then, `current`), and a call is replaced
    by assigning it here (``rt.cudaEventRecord = recorded``)."""

    def __init__(self, can: Pairs, refuse: Pairs = frozenset(), already: Pairs = frozenset()) -> None:
        self.cuda = _fake(1, can, refuse, already)
        self.calls: list[tuple[Any, ...]] = []

    @property
    def current(self) -> int:
        return self.cuda.device

    def cudaEventRecord(self, event: Any, stream: Any) -> tuple[Any, ...]:
        return self.cuda.runtime.cudaEventRecord(event, stream)  # type: ignore[no-any-return]

    def cudaEventDestroy(self, event: Any) -> tuple[Any, ...]:
        return self.cuda.runtime.cudaEventDestroy(event)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "cuda":
            raise AttributeError(name)
        return getattr(self.cuda.runtime, name)

    def __delattr__(self, name: str) -> None:
        # monkeypatch undoes `_engine`'s ``installed`` by deleting it: the bindings go back then.
        value = self.__dict__.pop(name)
        if isinstance(value, BindingsOverride):
            value.restore()


def _engine(monkeypatch: pytest.MonkeyPatch, rt: Runtime, n: int) -> CudaEngine:
    """A CudaEngine over ``n`` fake GPUs with peer lanes, ``rt`` its runtime (in place of the
    bindings, through `use_bindings`, until the test ends), built without the constructor;
    ``_batched`` logs its calls in ``rt.calls`` as ``(current, "batched", *args)``."""
    monkeypatch.setattr(device, "_kinds", {})  # cudaMemcpyKind values cached from other bindings
    rt.cuda.device_count = n
    monkeypatch.setattr(rt, "installed", use_bindings(rt, rt.cuda.driver), raising=False)
    devices = {i: Device(i) for i in range(n)}
    open_peer_lanes(devices, _use(rt.cuda), 0, Log())
    eng = object.__new__(CudaEngine)
    eng._rt, eng._devices, eng._closed, eng._current, eng._express_error = rt, devices, False, None, None
    eng._batched = types.SimpleNamespace(copy=lambda *a: rt.calls.append((rt.current, "batched", *a)))  # type: ignore[assignment]
    return eng
