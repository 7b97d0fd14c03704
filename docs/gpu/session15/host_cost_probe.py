"""Session 15's host-cost probes, on any machine: what a direct batch's host work costs on a
thread that has just woken (each call 5 ms after the last, as an inference step's copies come).

    .venv/bin/python docs/gpu/session15/host_cost_probe.py

Prints p50 / p99 microseconds of: the daemon-style path choice (`PathChooser.choose`, looked up
per copy) against the pair's kept figures (`choose_in` + `observe_in`); and a 256-row table made
ready for batched DMA, through `direct_table` and `BatchedDma.copy`'s own preparation (the old
path) against `direct_pointers` (the new one). No GPU: the driver call itself is not made.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from priod.choice import PathChooser
from priod.direct import direct_pointers, direct_rows, direct_table
from priod.engines.base import Direction, LaneKey

ROWS, BLOCK = 256, 64 << 10
DST, SRC = 1 << 40, 1 << 41


def interleaved(forms: dict[str, Callable[[], object]], rounds: int = 400) -> dict[str, str]:
    """Each form once a round, in turn (the order flips every round), each call 5 ms after the
    last: p50 / p99 microseconds per form. Interleaved, as a one-after-the-other series read
    20-40 us apart from run to run on this VM."""
    lat: dict[str, list[float]] = {name: [] for name in forms}
    order = list(forms.items())
    for i in range(rounds):
        for name, fn in order if i % 2 else order[::-1]:
            time.sleep(0.005)
            t0 = time.perf_counter()
            fn()
            lat[name].append(time.perf_counter() - t0)
    return {name: f"p50 {statistics.median(v) * 1e6:7.1f}  p99 {float(np.percentile(v, 99)) * 1e6:7.1f} us" for name, v in lat.items()}


def main() -> None:
    lane = LaneKey(0, Direction.H2D)
    chooser = PathChooser(2.0)
    figures = chooser.bucket(lane, 16 << 20)

    def lookup() -> None:
        path = chooser.choose(lane, 16 << 20, time.perf_counter())
        chooser.observe(lane, path, 16 << 20, 4e-4, time.perf_counter())

    def kept() -> None:
        path = chooser.choose_in(figures, time.perf_counter())
        chooser.observe_in(figures, path, 4e-4, time.perf_counter())

    rng = np.random.default_rng(1)
    table = np.stack([rng.choice(2 * ROWS, ROWS, replace=False) * BLOCK, rng.choice(2 * ROWS, ROWS, replace=False) * BLOCK, np.full(ROWS, BLOCK)], axis=1).astype(np.int64)
    bases = np.array([[DST], [SRC], [0]], dtype=np.uint64)
    size = 2 * ROWS * BLOCK

    def old_prep() -> int:  # direct_table, then BatchedDma.copy's preparation
        cells, _, _ = direct_table(direct_rows(table), size, size)
        pointers = np.empty((3, ROWS), dtype=np.uint64)
        np.add(cells[:, 0], np.uint64(DST), out=pointers[0])
        np.add(cells[:, 1], np.uint64(SRC), out=pointers[1])
        pointers[2] = cells[:, 2]
        return int(pointers.ctypes.data)

    def new_prep() -> int:
        return int(direct_pointers(direct_rows(table), DST, size, SRC, size, bases).ctypes.data)

    forms: tuple[dict[str, Callable[[], object]], ...] = (
        {"choose + observe, looked up": lookup, "choose_in + observe_in, kept": kept},
        {"256 rows for DMA, old": old_prep, "256 rows for DMA, direct_pointers": new_prep},
    )
    for pair in forms:
        for name, figure in interleaved(pair).items():
            print(f"{name:<36} {figure}")


if __name__ == "__main__":
    main()
