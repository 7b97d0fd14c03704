"""Is the copy kernel's table form slower than its contiguous form, and why? (Session 19.)

In-process, priod's own engine (`CudaEngine`), nothing else on the GPU, 2 ms asleep before
each copy. 256 blocks of 64 KiB (16 MiB) between a mapped host region and a device region of
32 MiB, h2d or d2h (DIRECTION), each form COUNT times, the forms interleaved:
  kernel contiguous    the copy kernel over the same 16 MiB as one range (`submit`, express)
  table TxB scattered  ``priod_copy_table`` over the 256 scattered rows, grid of B blocks per
                       row of T threads (priod today: 1 x 1024)
  table TxB in order   the same with the 256 rows laid end to end (the contiguous copy's bytes)
  dma contiguous       one ``cudaMemcpyAsync`` on the lane's strict stream
  dma batch            the scattered rows as priod's batched DMA (``cuMemcpyBatchAsync``)
Figures: host-observed us from the launch call to the completion seen done (spinning on it),
and the GPU's own time between two events around the work, p50 / p99. Full numbers in
$OUT/kernel_probe_<direction>.json.

    DIRECTION=h2d COUNT=150 python3 docs/gpu/session19/kernel_probe.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())

from priod.engines.base import Direction, LaneKey, Path
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import bindings, check

rt, drv = bindings()
KiB = 1 << 10
BLOCKS, BLOCK = 256, 64 * KiB
SIZE = 2 * BLOCKS * BLOCK
GRIDS = ((1024, 1), (512, 2), (256, 4), (128, 8))


def main() -> None:
    direction = os.environ.get("DIRECTION", "h2d")
    count = int(os.environ.get("COUNT", "150"))
    out = os.environ.get("OUT", "out/kernel_probe")
    os.makedirs(out, exist_ok=True)
    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    fd = os.memfd_create("kprobe")
    os.ftruncate(fd, SIZE)
    host, dev_mem = eng.map_host(fd, SIZE), eng.alloc_device(SIZE, 0)
    lane = LaneKey(0, Direction.H2D if direction == "h2d" else Direction.D2H)
    dst, src = (dev_mem, host) if direction == "h2d" else (host, dev_mem)
    dev, info, s_host, d_host = eng._ends(lane, dst, src)
    sp = s_host.device_pointer if s_host is not None else src.pointer  # type: ignore[attr-defined]
    dp = d_host.device_pointer if d_host is not None else dst.pointer  # type: ignore[attr-defined]
    rng = np.random.default_rng(4)
    scattered = np.stack([rng.choice(2 * BLOCKS, BLOCKS, replace=False) * BLOCK, rng.choice(2 * BLOCKS, BLOCKS, replace=False) * BLOCK, np.full(BLOCKS, BLOCK)], 1).astype(np.uint64)
    in_order = np.stack([np.arange(BLOCKS) * BLOCK, np.arange(BLOCKS) * BLOCK, np.full(BLOCKS, BLOCK)], 1).astype(np.uint64)
    kern = eng._kernel
    e0, e1 = check(rt.cudaEventCreate()), check(rt.cudaEventCreate())
    express_rt = info.express  # the runtime handle of the express stream, for the events

    def table(cells: np.ndarray, threads: int, per_row: int) -> Any:
        def go() -> Any:
            kern._table[0] = sp
            kern._table[1] = dp
            kern._table_rows[:BLOCKS] = cells
            check(kern._cu_launch(dev.table_function, per_row, BLOCKS, 1, threads, 1, 1, 0, info.express_cu, kern._tparams, 0))
            return None

        return go

    forms: dict[str, tuple[Any, Any]] = {"kernel contiguous": (lambda: eng.submit(lane, Path.EXPRESS, dst, 0, src, 0, BLOCKS * BLOCK), express_rt)}
    for threads, per_row in GRIDS:
        forms[f"table {threads}x{per_row} scattered"] = (table(scattered, threads, per_row), express_rt)
        forms[f"table {threads}x{per_row} in order"] = (table(in_order, threads, per_row), express_rt)
    forms["dma contiguous"] = (lambda: eng.submit(lane, Path.DMA, dst, 0, src, 0, BLOCKS * BLOCK, strict=True), info.strict)
    forms["dma batch"] = (lambda: eng.submit_segments(lane, Path.DMA, dst, src, scattered, strict=True), info.strict)
    wall: dict[str, list[float]] = {k: [] for k in forms}
    gpu: dict[str, list[float]] = {k: [] for k in forms}
    for i in range(5 + count):
        names = list(forms) if i % 2 == 0 else list(reversed(forms))
        for name in names:
            go, stream = forms[name]
            time.sleep(0.002)
            check(rt.cudaEventRecord(e0, stream))
            t0 = time.perf_counter()
            comp = go()
            check(rt.cudaEventRecord(e1, stream))
            while rt.cudaEventQuery(e1)[0] != rt.cudaError_t.cudaSuccess:
                pass
            took = (time.perf_counter() - t0) * 1e6
            if comp is not None:
                while not comp.done():
                    pass
                comp.release()
            ms = check(rt.cudaEventElapsedTime(e0, e1))
            if i >= 5:
                wall[name].append(took)
                gpu[name].append(ms * 1e3)
    with open(os.path.join(out, f"kernel_probe_{direction}.json"), "w") as f:
        json.dump({"direction": direction, "count": count, "wall_us": wall, "gpu_us": gpu, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f)
    print(f"\n{direction}, 256 x 64 KiB, in-process, idle GPU, {count} each; us, p50 / p99")
    print(f"{'form':<28} {'host-observed':>16} {'GPU (events)':>16}")
    for k in forms:
        w, g = np.array(wall[k]), np.array(gpu[k])
        print(f"{k:<28} {np.percentile(w, 50):7.0f} / {np.percentile(w, 99):6.0f} {np.percentile(g, 50):7.0f} / {np.percentile(g, 99):6.0f}")
    eng.close()


if __name__ == "__main__":
    main()
