"""Probe: how fast can one process move 256 scattered 64 KiB blocks (16 MiB) h2d, by which way?

No daemon. In this process's own CUDA context (CuPy's), on a high-priority stream, back to back
(synchronised after each), after 5 ms of idle, and with 2 GiB bulk copies running in another
process (its own context): a contiguous copy of the same bytes, batched DMA in calls of 64 (as
shipped) and of 256, and the copy kernel's table form with several grid shapes, one launch of
128 rows after the other (as shipped) or the two launches on two streams at once.
Prints p50/p99 in us per way and condition; the full numbers go to $OUT/urgent_batch.json.
"""

import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

import bench_gpu

from priod.direct import _BatchKernel
from priod.engines.cuda._driver import bindings, check
from priod.engines.cuda.batched import BatchedDma

KiB, MiB = 1 << 10, 1 << 20
N, BLOCK = 256, 64 * KiB
COUNT = int(os.environ.get("COUNT", "60"))


def main() -> None:
    import cupy as cp

    rt, drv = bindings()
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    _, greatest = check(rt.cudaDeviceGetStreamPriorityRange())
    s1 = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
    s2 = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
    joined = check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))
    size = 2 * N * BLOCK
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8)
    hptr = check(rt.cudaHostGetDevicePointer(pinned.ptr, 0))
    rng = np.random.default_rng(6)
    d_offs = (rng.choice(2 * N, N, replace=False) * BLOCK).astype(np.uint64)
    s_offs = (rng.choice(2 * N, N, replace=False) * BLOCK).astype(np.uint64)
    sizes = np.full(N, BLOCK, dtype=np.uint64)
    dst, src = int(dev.data.ptr), int(pinned.ptr)

    kernel = _BatchKernel.load(0)
    assert kernel is not None, "the copy kernel did not load"
    ek = kernel._express
    cs1, cs2 = drv.CUstream(int(s1)), drv.CUstream(int(s2))
    dma64, dma256 = BatchedDma(64), BatchedDma(256)

    def table_launch(first: int, last: int, per_row: int, threads: int, stream: Any) -> None:
        view = ek._table_view
        ek._table[0], ek._table[1] = hptr, dst
        rows = last - first
        cells = view[2 : 2 + 3 * rows].reshape(rows, 3)
        cells[:, 0], cells[:, 1], cells[:, 2] = d_offs[first:last], s_offs[first:last], sizes[first:last]
        check(ek._cu_launch(kernel.table_function, per_row, rows, 1, threads, 1, 1, 0, stream, ek._tparams, 0))

    def kern(per_row: int, threads: int, two_streams: bool = False) -> Any:
        def run() -> None:
            table_launch(0, 128, per_row, threads, cs1)
            if two_streams:
                table_launch(128, 256, per_row, threads, cs2)
                check(rt.cudaEventRecord(joined, s2))
                check(rt.cudaStreamWaitEvent(s1, joined, 0))
            else:
                table_launch(128, 256, per_row, threads, cs1)

        return run

    ways: dict[str, Any] = {
        "contiguous DMA": lambda: check(rt.cudaMemcpyAsync(dst, src, N * BLOCK, kind, s1)),
        "batched DMA, calls of 64": lambda: dma64.copy(dst, src, d_offs, s_offs, sizes, kind, s1),
        "batched DMA, one call": lambda: dma256.copy(dst, src, d_offs, s_offs, sizes, kind, s1),
        "kernel 1x1024 (shipped)": kern(1, 1024),
        "kernel 2x512": kern(2, 512),
        "kernel 4x256": kern(4, 256),
        "kernel 8x128": kern(8, 128),
        "kernel 2x1024": kern(2, 1024),
        "kernel 1x1024, two streams": kern(1, 1024, True),
        "kernel 2x512, two streams": kern(2, 512, True),
    }

    def check_bytes() -> None:
        got = cp.asnumpy(dev)
        for d, s_, n in zip(d_offs.tolist(), s_offs.tolist(), sizes.tolist(), strict=True):
            assert np.array_equal(got[d : d + n], host[s_ : s_ + n]), "a block differs"

    for name, fn in ways.items():  # warm, and every way checked once
        dev.fill(0)
        cp.cuda.Device().synchronize()
        fn()
        check(rt.cudaStreamSynchronize(s1))
        if name != "contiguous DMA":
            check_bytes()

    def measure(pause_s: float) -> dict[str, dict[str, float]]:
        lat: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(COUNT):
            for name, fn in ways.items():
                if pause_s:
                    time.sleep(pause_s)
                t0 = time.perf_counter()
                fn()
                check(rt.cudaStreamSynchronize(s1))
                lat[name].append((time.perf_counter() - t0) * 1e6)
        return {k: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} for k, v in lat.items()}

    res = {"back to back": measure(0.0), "after 5 ms idle": measure(0.005)}
    ctx = bench_gpu.SPAWN
    ready, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
    with bench_gpu.child(bench_gpu.dma_bulk_process, ("h2d",), 2 << 30, ready, stop, q) as p:
        bench_gpu.wait_ready(ready, [p], "bulk")
        time.sleep(0.3)
        res["under other-process bulk (5 ms apart)"] = measure(0.005)
        stop.set()
        bench_gpu.get_result(q, [p])
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "urgent_batch.json"), "w") as f:
        json.dump(res, f, indent=1)
    conds = list(res)
    print(f"{'way (256 x 64 KiB h2d, us)':<30}" + "".join(f"{c[:22]:>24}" for c in conds))
    for name in ways:
        print(f"{name:<30}" + "".join(f"{res[c][name]['p50']:>11.0f} /{res[c][name]['p99']:>8.0f}   " for c in conds))


if __name__ == "__main__":
    main()
