"""The CUDA engine's peer lanes against stand-in bindings, on any machine: which calls set them
up (peer access where the hardware allows it, two streams per ordered pair on the source GPU),
how calibration times each pair, and that one GPU makes no call at all. No machine with two GPUs
has been lent, so this is the only place the set-up code has run; whether bytes land between
two real GPUs is tests/test_cuda_engine.py's two-GPU test (marker gpu, never run yet)."""

from __future__ import annotations

import types
from collections.abc import Set
from typing import Any

import numpy as np
import pytest

from priod.common.cuda import driver as _driver
from priod.common.types import Direction, LaneKey, Path
from priod.daemon.engines.cuda import device
from priod.daemon.engines.cuda.calibrate import NOMINAL
from priod.daemon.engines.cuda.device import Device
from priod.daemon.engines.cuda.engine import CudaEngine
from priod.daemon.engines.cuda.memory import CudaDeviceMemory
from priod.daemon.engines.cuda.peer import open_peer_lanes
from priod.errors import EngineError, InvalidRequest

OK, NOT_READY, ALREADY, REFUSED = "ok", "not-ready", "already-enabled", "peer-refused"
Pairs = Set[tuple[int, int]]


class Runtime:
    """cuda.bindings.runtime, as far as peer set-up uses it; every call recorded with the
    device current at the time."""

    cudaStreamNonBlocking = 1

    def __init__(self, can: Pairs, refuse: Pairs = frozenset(), already: Pairs = frozenset()) -> None:
        self.can, self.refuse, self.already = can, refuse, already
        self.calls: list[tuple[Any, ...]] = []
        self.current = -1
        self.cudaError_t = types.SimpleNamespace(cudaErrorPeerAccessAlreadyEnabled=ALREADY, cudaErrorNotReady=NOT_READY, cudaSuccess=OK)
        names = ("cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost", "cudaMemcpyDeviceToDevice", "cudaMemcpyDefault")
        self.cudaMemcpyKind = types.SimpleNamespace(**{n: n for n in names})
        self._n = 0

    def _log(self, *call: Any) -> None:
        self.calls.append((self.current, *call))

    def cudaEventQuery(self, event: Any) -> tuple[Any, ...]:
        return (OK,)

    def cudaDeviceGetStreamPriorityRange(self) -> tuple[Any, ...]:
        return (OK, 0, -5)

    def cudaDeviceCanAccessPeer(self, a: int, b: int) -> tuple[Any, ...]:
        return (OK, int((a, b) in self.can))

    def cudaDeviceEnablePeerAccess(self, peer: int, flags: int) -> tuple[Any, ...]:
        self._log("enable", peer)
        pair = (self.current, peer)
        return (REFUSED,) if pair in self.refuse else (ALREADY,) if pair in self.already else (OK,)

    def cudaGetLastError(self) -> tuple[Any, ...]:
        self._log("last_error")
        return (OK,)

    def cudaStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[Any, ...]:
        self._n += 1
        self._log("stream", priority)
        return (OK, f"s{self._n}@{self.current}")

    def cudaMalloc(self, nbytes: int) -> tuple[Any, ...]:
        self._log("malloc", nbytes)
        return (OK, 1000 * (self.current + 1))

    def cudaFree(self, ptr: int) -> tuple[Any, ...]:
        self._log("free", ptr)
        return (OK,)

    def cudaMemcpyPeerAsync(self, dst: int, dst_dev: int, src: int, src_dev: int, nbytes: int, stream: Any) -> tuple[Any, ...]:
        self._log("peer_copy", dst, dst_dev, src, src_dev, nbytes, stream)
        return (OK,)

    def cudaEventCreate(self) -> tuple[Any, ...]:
        return (OK, "event")

    def cudaEventRecord(self, event: Any, stream: Any) -> tuple[Any, ...]:
        return (OK,)

    def cudaEventSynchronize(self, event: Any) -> tuple[Any, ...]:
        return (OK,)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[Any, ...]:
        return (OK,)

    def cudaEventElapsedTime(self, start: Any, stop: Any) -> tuple[Any, ...]:
        return (OK, 2.0)  # ms: every timed copy takes 2 ms

    def cudaEventDestroy(self, event: Any) -> tuple[Any, ...]:
        return (OK,)

    cudaEventDisableTiming = 2

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[Any, ...]:
        return (OK, "chunk-event")

    def cudaSetDevice(self, index: int) -> tuple[Any, ...]:
        self.current = index
        return (OK,)

    def cudaGetErrorName(self, err: Any) -> tuple[Any, ...]:
        return (OK, str(err).encode())

    def cudaGetErrorString(self, err: Any) -> tuple[Any, ...]:
        return (OK, b"")


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, /, **kw: Any) -> None:
        self.records.append(("info", event, kw))

    def warning(self, event: str, /, **kw: Any) -> None:
        self.records.append(("warning", event, kw))


def _setup(monkeypatch: pytest.MonkeyPatch, rt: Runtime, n: int) -> dict[int, Device]:
    for name, value in (("_rt", rt), ("_drv", types.SimpleNamespace()), ("_RT_OK", OK), ("_DRV_OK", object()), ("_NOT_READY", NOT_READY)):
        monkeypatch.setattr(_driver, name, value)
    monkeypatch.setattr(device, "_kinds", {})
    return {i: Device(i) for i in range(n)}


def _use(rt: Runtime) -> Any:
    def use(index: int) -> None:
        rt.current = index

    return use


def test_one_gpu_makes_no_peer_call_and_no_peer_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU: no peer lane, and not one CUDA call (the single-GPU engine is as it was)."""
    rt = Runtime(can={(0, 1)})
    devices = _setup(monkeypatch, rt, 1)
    log = Log()
    open_peer_lanes(devices, _use(rt), 64 << 20, log)
    assert rt.calls == [] and log.records == []
    assert devices[0].peers == {} and [lane.key for lane in devices[0].lanes] == [LaneKey(0, d) for d in (Direction.H2D, Direction.D2H, Direction.D2D)]


def test_each_ordered_pair_gets_streams_on_its_source_and_peer_access_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three GPUs: six peer lanes, each with a low- and a high-priority stream made on its
    source GPU. Peer access is asked for only where the hardware allows it; "already enabled"
    counts as enabled; a refusal is logged, cleared from the last error, and leaves the lane
    working without it (staged copies). No calibration with 0 bytes: the nominal rate."""
    rt = Runtime(can={(0, 1), (1, 0), (0, 2), (2, 0)}, refuse={(2, 0)}, already={(1, 0)})
    devices = _setup(monkeypatch, rt, 3)
    log = Log()
    open_peer_lanes(devices, _use(rt), 0, log)
    keys = [lane.key for dev in devices.values() for lane in dev.lanes if lane.key.direction is Direction.PEER]
    assert keys == [LaneKey(a, Direction.PEER, b) for a in range(3) for b in range(3) if a != b]
    access = {(a, b): lane.peer_access for a, dev in devices.items() for b, lane in dev.peers.items()}
    assert access == {(0, 1): True, (0, 2): True, (1, 0): True, (1, 2): False, (2, 0): False, (2, 1): False}
    assert [c for c in rt.calls if c[1] == "enable"] == [(0, "enable", 1), (0, "enable", 2), (1, "enable", 0), (2, "enable", 0)]
    streams = [c for c in rt.calls if c[1] == "stream"]
    assert [(c[0], c[2]) for c in streams] == [(a, p) for a in range(3) for _ in range(2) for p in (0, -5)]
    for a, dev in devices.items():
        for lane in dev.peers.values():
            assert lane.dma.endswith(f"@{a}") and lane.strict.endswith(f"@{a}") and lane.express is None
            assert lane.dma_bandwidth == NOMINAL[Direction.PEER] and lane.express_max == 0
    assert [r for r in log.records if r[0] == "warning"] == [
        ("warning", "cuda peer access", {"src": 2, "dst": 0, "error": "peer-refused", "effect": "copies stage through host memory"})
    ]
    assert not any(c[1] in ("malloc", "peer_copy") for c in rt.calls)


def test_calibration_times_one_peer_copy_per_pair_and_frees_its_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With calibrate_bytes set: one buffer per GPU (made on it), each pair's copy issued from
    the source GPU on the lane's DMA stream with both GPUs named, its rate from the timed copy
    (64 MiB in 2 ms here), the figures logged, and every buffer freed on its own GPU."""
    rt = Runtime(can={(0, 1), (1, 0)})
    devices = _setup(monkeypatch, rt, 2)
    log = Log()
    nbytes = 64 << 20
    open_peer_lanes(devices, _use(rt), nbytes, log)
    assert [c for c in rt.calls if c[1] == "malloc"] == [(0, "malloc", nbytes), (1, "malloc", nbytes)]
    copies = {(c[0], c[3], c[5]) for c in rt.calls if c[1] == "peer_copy"}  # (current, dst device, src device)
    assert copies == {(0, 1, 0), (1, 0, 1)}
    first = next(c for c in rt.calls if c[1] == "peer_copy" and c[0] == 0)
    assert first == (0, "peer_copy", 2000, 1, 1000, 0, nbytes, devices[0].peers[1].dma)
    for dev in devices.values():
        for lane in dev.peers.values():
            assert lane.dma_bandwidth == pytest.approx(nbytes / 2e-3)
    assert [c for c in rt.calls if c[1] == "free"] == [(0, "free", 1000), (1, "free", 2000)]
    calibration = [r for r in log.records if r[1] == "cuda peer calibration"]
    assert calibration == [("info", "cuda peer calibration", {"bytes": nbytes, "gpu0_to_gpu1_gbps": 33.55, "gpu1_to_gpu0_gbps": 33.55})]


def _engine(monkeypatch: pytest.MonkeyPatch, rt: Runtime, n: int) -> CudaEngine:
    """A CudaEngine over stand-in GPUs with peer lanes, built without the constructor (which
    opens real devices); ``_batched`` records any call, which a peer chunk must not make."""
    devices = _setup(monkeypatch, rt, n)
    open_peer_lanes(devices, _use(rt), 0, Log())
    eng = object.__new__(CudaEngine)
    eng._rt, eng._devices, eng._closed, eng._current, eng._express_error = rt, devices, False, None, None
    eng._batched = types.SimpleNamespace(copy=lambda *a: rt.calls.append((rt.current, "batched", *a)))  # type: ignore[assignment]
    return eng


def _dev(pointer: int, gpu: int) -> CudaDeviceMemory:
    return CudaDeviceMemory(pointer, 1 << 20, gpu, owned=True)


def test_a_peer_chunk_is_one_peer_copy_on_the_source_gpu_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk on gpu0/peer/gpu1 is one cudaMemcpyPeerAsync from GPU 0 (current), on the lane's
    bulk stream (strict: its high-priority one), with offsets applied and both GPUs named; a
    batch's chunk is one such call per segment, never the batched call."""
    rt = Runtime(can={(0, 1), (1, 0)})
    eng = _engine(monkeypatch, rt, 2)
    lane, info = LaneKey(0, Direction.PEER, 1), eng._devices[0].peers[1]
    src, dst = _dev(9000, 0), _dev(5000, 1)
    eng.submit(lane, Path.DMA, dst, 16, src, 32, 100)
    eng.submit(lane, Path.DMA, dst, 0, src, 0, 8, strict=True)
    copies = [c for c in rt.calls if c[1] == "peer_copy"]
    assert copies == [(0, "peer_copy", 5016, 1, 9032, 0, 100, info.dma), (0, "peer_copy", 5000, 1, 9000, 0, 8, info.strict)]
    rt.calls.clear()
    eng.submit_segments(lane, Path.DMA, dst, src, np.array([[0, 8, 16], [64, 200, 32]], np.uint64))
    assert rt.calls == [(0, "peer_copy", 5000, 1, 9008, 0, 16, info.dma), (0, "peer_copy", 5064, 1, 9200, 0, 32, info.dma)]


def test_a_chunk_whose_ends_do_not_fit_its_lane_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Across GPUs only the pair's peer lane is right: a d2d lane with ends on two GPUs, a peer
    lane whose destination is another GPU than its peer, a peer lane the engine lacks, and the
    express path (peer lanes have none) are refused, and nothing is issued."""
    rt = Runtime(can=set())
    eng = _engine(monkeypatch, rt, 3)
    rt.calls.clear()
    on0, on1, on2 = _dev(1000, 0), _dev(2000, 1), _dev(3000, 2)
    with pytest.raises(InvalidRequest, match=r"^lane gpu0/d2d got gpu0 -> gpu1: a device end is on another GPU$"):
        eng.submit(LaneKey(0, Direction.D2D), Path.DMA, on1, 0, on0, 0, 64)
    with pytest.raises(InvalidRequest, match=r"^lane gpu0/peer/gpu1 got gpu0 -> gpu2: a device end is on another GPU$"):
        eng.submit(LaneKey(0, Direction.PEER, 1), Path.DMA, on2, 0, on0, 0, 64)
    with pytest.raises(InvalidRequest, match=r"^this engine has no lane gpu0/peer/gpu7$"):
        eng.submit(LaneKey(0, Direction.PEER, 7), Path.DMA, on1, 0, on0, 0, 64)
    with pytest.raises(EngineError, match=r"^lane gpu0/peer/gpu1 has no express path"):
        eng.submit(LaneKey(0, Direction.PEER, 1), Path.EXPRESS, on1, 0, on0, 0, 64)
    assert not any(c[1] in ("peer_copy", "batched") for c in rt.calls)
