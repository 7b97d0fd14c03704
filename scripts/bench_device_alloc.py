#!/usr/bin/env python3
"""What a daemon-allocated device region costs as ``cuMemCreate`` memory, against ``cudaMalloc``.

The cuda engine allocates device regions with ``cuMemCreate`` and exports them as a POSIX fd
that the client keeps, so that the memory outlives a daemon restart (docs/reliability.md).
This measures, in one process on one GPU, side by side:
  alloc + free   ``cudaMalloc`` + ``cudaIpcGetMemHandle`` + ``cudaFree`` (what a region
                 exported by IPC handle costs) against the engine's ``alloc_device`` +
                 ``release_device`` (``cuMemCreate``, export, reserve, map, set access; and back)
  per copy       ``cudaMemcpyAsync`` host-to-device from pinned memory into each, 64 KiB and
                 16 MiB, p50 / p99 over --copies copies

    python scripts/bench_device_alloc.py

Needs a GPU and cuda-bindings. Prints the table last.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from priod.common.cuda.driver import bindings, check
from priod.daemon.engines.cuda.memory import Regions

MiB = 1 << 20


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="2,64,1024")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=300)
    args = ap.parse_args()
    rt, _ = bindings()
    check(rt.cudaSetDevice(0))
    check(rt.cudaFree(0))
    regions = Regions(lambda device: None)
    rows = []
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        n = mib * MiB

        def malloc_free(n: int = n) -> None:
            pointer = int(check(rt.cudaMalloc(n)))
            check(rt.cudaIpcGetMemHandle(pointer))
            check(rt.cudaFree(pointer))

        def vmm_alloc_free(n: int = n) -> None:
            regions.release_device(regions.alloc_device(n, 0))

        a = timed(malloc_free, args.reps)
        b = timed(vmm_alloc_free, args.reps)
        rows.append(
            f"alloc + free {mib:>5} MiB   cudaMalloc p50 {np.median(a):7.3f} ms   cuMemCreate p50 {np.median(b):7.3f} ms   x{np.median(b) / np.median(a):5.2f}"
        )

    stream = int(check(rt.cudaStreamCreateWithFlags(1)))
    host = int(check(rt.cudaHostAlloc(16 * MiB, 0)))
    plain = int(check(rt.cudaMalloc(16 * MiB)))
    vmm = regions.alloc_device(16 * MiB, 0)
    for size in (64 << 10, 16 * MiB):
        lat: dict[str, list[float]] = {"cudaMalloc": [], "cuMemCreate": []}
        for i in range(2 * args.copies):
            name = "cudaMalloc" if i % 2 else "cuMemCreate"
            dst = plain if i % 2 else vmm.pointer
            t0 = time.perf_counter()
            check(rt.cudaMemcpyAsync(dst, host, size, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))
            check(rt.cudaStreamSynchronize(stream))
            lat[name].append((time.perf_counter() - t0) * 1e6)
        cells = "   ".join(
            f"{k} p50 {np.percentile(v, 50):6.0f} / p99 {np.percentile(v, 99):6.0f} us" for k, v in lat.items()
        )
        rows.append(f"h2d copy {size >> 10:>6} KiB   {cells}")
    regions.release_device(vmm)
    check(rt.cudaFree(plain))
    check(rt.cudaFreeHost(host))
    check(rt.cudaStreamDestroy(stream))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
