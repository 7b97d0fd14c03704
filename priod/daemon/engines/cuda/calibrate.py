"""Calibration: what each lane of a device can do, measured once when the engine starts.

The scheduler sizes chunks and picks paths from each lane's DMA bandwidth (`LaneInfo`), so the
engine times one pinned copy of ``calibrate_bytes`` per direction on the lane's DMA stream, and
one copy of up to `EXPRESS_MAX` with the express kernel, each the median of three runs after a
warm-up, and logs the figures. With calibration off (0 bytes) the lanes assume `NOMINAL`.

Here too each lane gets its express range: up to `EXPRESS_MAX` where the kernel loaded, and
host-to-device copies only from `EXPRESS_MIN_H2D` (smaller ones are as fast by DMA).
"""

from __future__ import annotations

import ctypes
import statistics as _stats
from collections.abc import Callable
from typing import Any, Protocol

from priod.common.cuda.driver import bindings, check
from priod.common.cuda.express import EXPRESS_MAX, EXPRESS_MIN_H2D, ExpressKernel
from priod.common.types import Direction
from priod.daemon.engines.cuda.device import Device, Lane

__all__ = ["NOMINAL", "Log", "calibrate", "time_copy"]

NOMINAL = {Direction.H2D: 55e9, Direction.D2H: 55e9, Direction.D2D: 1.5e12, Direction.PEER: 300e9}
"""Bytes/s assumed when calibration is skipped (an H200 on PCIe Gen5 x16, measured; the peer
figure is NOT measured: no machine with two GPUs was lent. It is below NVLink 4's 450 GB/s per
direction, as copies fall short of a link's nominal rate; calibration replaces it at start)."""


class Log(Protocol):
    """The subset of a structlog logger the CUDA engine uses."""

    def info(self, event: str, /, **kw: Any) -> Any: ...

    def warning(self, event: str, /, **kw: Any) -> Any: ...


def calibrate(
    dev: Device,
    nbytes: int,
    *,
    use: Callable[[int], None],
    kernel: ExpressKernel,
    express: bool,
    log: Log,
) -> None:
    """Fill the lanes' express ranges, then time DMA and express copies of ``nbytes`` per
    direction on ``dev`` and fill the lanes' bandwidths (`NOMINAL` if ``nbytes`` is 0)."""
    has_express = dev.function is not None and express
    for lane in dev.local_lanes:
        direction = lane.key.direction
        lane.express_max = EXPRESS_MAX if has_express else 0
        lane.express_min = EXPRESS_MIN_H2D if (has_express and direction is Direction.H2D) else 0
        lane.dma_bandwidth = NOMINAL[direction]
    if nbytes <= 0:
        return
    rt, _ = bindings()
    use(dev.index)
    host = check(rt.cudaHostAlloc(nbytes, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped))
    dev_a = dev_b = 0
    start = stop = None
    try:
        host_alias = int(check(rt.cudaHostGetDevicePointer(host, 0)))
        dev_a = int(check(rt.cudaMalloc(nbytes)))
        dev_b = int(check(rt.cudaMalloc(nbytes)))
        check(rt.cudaMemset(dev_a, 1, nbytes))
        check(rt.cudaMemset(dev_b, 2, nbytes))
        ctypes.memset(int(host), 3, nbytes)
        start = check(rt.cudaEventCreate())
        stop = check(rt.cudaEventCreate())
        express_bytes = min(nbytes, EXPRESS_MAX)
        ends = {
            Direction.H2D: (dev_a, int(host), host_alias),
            Direction.D2H: (int(host), dev_a, dev_a),
            Direction.D2D: (dev_b, dev_a, dev_a),
        }
        figures: dict[str, float] = {}
        for lane in dev.local_lanes:
            direction = lane.key.direction
            dst, src, src_alias = ends[direction]
            dst_alias = host_alias if direction is Direction.D2H else dst

            def dma(dst: int = dst, src: int = src, lane: Lane = lane) -> None:
                check(rt.cudaMemcpyAsync(dst, src, nbytes, lane.kind, lane.dma))

            lane.dma_bandwidth = nbytes / _time(dma, lane.dma, start, stop)
            figures[f"{direction.value}_dma_gbps"] = round(lane.dma_bandwidth / 1e9, 2)
            if has_express:

                def copy_kernel(dst: int = dst_alias, src: int = src_alias, lane: Lane = lane) -> None:
                    kernel.launch(dev, dst, src, express_bytes, lane.express_cu)

                lane.express_bandwidth = express_bytes / _time(copy_kernel, lane.express, start, stop)
                figures[f"{direction.value}_express_gbps"] = round(lane.express_bandwidth / 1e9, 2)
        log.info("cuda calibration", gpu=dev.index, name=dev.name, bytes=nbytes, **figures)
    finally:
        for event in (start, stop):
            if event is not None:
                rt.cudaEventDestroy(event)
        for ptr in (dev_a, dev_b):
            if ptr:
                rt.cudaFree(ptr)
        rt.cudaFreeHost(host)


def time_copy(op: Callable[[], None], stream: Any, reps: int = 3) -> float:
    """Median seconds of ``op`` on ``stream`` (current device: the stream's) over ``reps`` runs
    after one warm-up, timed by a pair of events made and destroyed here."""
    rt, _ = bindings()
    start = check(rt.cudaEventCreate())
    try:
        stop = check(rt.cudaEventCreate())
        try:
            return _time(op, stream, start, stop, reps)
        finally:
            rt.cudaEventDestroy(stop)
    finally:
        rt.cudaEventDestroy(start)


def _time(op: Callable[[], None], stream: Any, start: Any, stop: Any, reps: int = 3) -> float:
    """Median seconds of ``op`` on ``stream`` over ``reps`` runs after one warm-up."""
    rt, _ = bindings()
    op()
    check(rt.cudaStreamSynchronize(stream))
    seconds = []
    for _ in range(reps):
        check(rt.cudaEventRecord(start, stream))
        op()
        check(rt.cudaEventRecord(stop, stream))
        check(rt.cudaEventSynchronize(stop))
        seconds.append(float(check(rt.cudaEventElapsedTime(start, stop))) / 1e3)
    return max(_stats.median(seconds), 1e-9)
