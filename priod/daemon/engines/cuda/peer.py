"""Peer lanes: copies from one GPU of this engine to another, a lane per ordered pair.

A copy between two GPUs runs on neither GPU's host-link copy engines: over NVLink (or PCIe
peer-to-peer) it has engines and bandwidth of its own, so it gets lanes of its own with their
own in-flight bound, and bulk between GPUs never queues an urgent host copy (docs/design.md,
"Several GPUs"). Each ordered pair (a -> b) is one lane on GPU a: two low/high-priority streams
made on a, chunks issued with ``cudaMemcpyPeerAsync`` (a batch's chunk one per segment). No
express path: the copy kernel would have to read peer
memory, which is not built (nor measured).

Peer access is enabled where ``cudaDeviceCanAccessPeer`` allows it; where it does not, the lane
still exists (``cudaMemcpyPeerAsync`` then stages through host memory) and says so in the
engine's statistics (``peer_access``), with its calibrated, lower, bandwidth.

With one GPU nothing here runs: no peer lane, no peer-access call, the engine as it was.
"""

from __future__ import annotations

from collections.abc import Callable

from priod.common.cuda.driver import bindings, check, error, status_codes
from priod.common.types import Direction
from priod.daemon.engines.cuda.calibrate import NOMINAL, Log, time_copy
from priod.daemon.engines.cuda.device import Device, Lane

__all__ = ["open_peer_lanes"]


def open_peer_lanes(devices: dict[int, Device], use: Callable[[int], None], calibrate_bytes: int, log: Log) -> None:
    """Give every ordered pair of ``devices`` a peer lane (streams, peer access where the
    hardware has it), then time one ``cudaMemcpyPeerAsync`` of ``calibrate_bytes`` per pair
    (`NOMINAL` where 0). Each lane is added to its device before its streams are made, so the
    engine's close frees whatever was made if a later step fails."""
    if len(devices) < 2:
        return
    rt, _ = bindings()
    ok, _ = status_codes()
    for a, dev in devices.items():
        use(a)
        least, greatest = (int(v) for v in check(rt.cudaDeviceGetStreamPriorityRange()))
        for b in devices:
            if b == a:
                continue
            lane = dev.add_peer(b)
            lane.dma_bandwidth = NOMINAL[Direction.PEER]
            if check(rt.cudaDeviceCanAccessPeer(a, b)):
                err = rt.cudaDeviceEnablePeerAccess(b, 0)[0]
                if err is ok or err is rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled:
                    lane.peer_access = True
                else:
                    log.warning(
                        "cuda peer access",
                        src=a,
                        dst=b,
                        error=str(error(err)),
                        effect="copies stage through host memory",
                    )
                rt.cudaGetLastError()  # the refusal is not sticky, but would linger as the last error
            lane.dma = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, least))
            lane.strict = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
    if calibrate_bytes > 0:
        _calibrate(devices, use, calibrate_bytes, log)


def _calibrate(devices: dict[int, Device], use: Callable[[int], None], nbytes: int, log: Log) -> None:
    """One buffer per GPU, then each pair's copy timed on its lane's DMA stream."""
    rt, _ = bindings()
    buffers: dict[int, int] = {}
    try:
        for index in devices:
            use(index)
            buffers[index] = int(check(rt.cudaMalloc(nbytes)))
        figures: dict[str, float] = {}
        for a, dev in devices.items():
            use(a)
            for b, lane in dev.peers.items():

                def copy(lane: Lane = lane, a: int = a, b: int = b) -> None:
                    check(rt.cudaMemcpyPeerAsync(buffers[b], b, buffers[a], a, nbytes, lane.dma))

                lane.dma_bandwidth = nbytes / time_copy(copy, lane.dma)
                figures[f"gpu{a}_to_gpu{b}_gbps"] = round(lane.dma_bandwidth / 1e9, 2)
        log.info("cuda peer calibration", bytes=nbytes, **figures)
    finally:
        for index, ptr in buffers.items():
            use(index)
            rt.cudaFree(ptr)
