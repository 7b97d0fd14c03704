"""Probe: where does a direct batch's time go? 256 scattered 64 KiB blocks h2d by the copy kernel.

The bench's direct rows took ~540 us p50 idle where the same launches in a bare process took
~360 (urgent_batch_probe.py). Here, each 5 ms apart, in this process's CuPy context:
  full     DirectPair.copy_batch (validation, hold, launches, spin-wait)
  parts    the pair's launches and DirectCopies' spin-wait, no validation, no hold
  sync     the same launches, then cudaStreamSynchronize instead of the spin-wait
first with a hold page of our own (no daemon), then with a cuda daemon running, idle, and its
page; then with the daemon, a SyncClient connected the whole time (as in the bench).
"""

import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())

import priod
from priod.direct import DirectCopies, HoldPage, direct_table
from priod.engines.cuda._driver import bindings, check, gpu_uuid
from priod.holds import PAGE_BYTES
from priod.testing import daemon_process
import itertools

KiB = 1 << 10
N, BLOCK = 256, 64 * KiB
COUNT = int(os.environ.get("COUNT", "60"))
PAUSE_S = float(os.environ.get("PAUSE_S", "0.005"))
"""Idle before each copy (the bench leaves 5 ms; 0: back to back)."""


def main() -> None:
    import cupy as cp

    rt, _ = bindings()
    size = 2 * N * BLOCK
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8)
    rng = np.random.default_rng(6)
    segs = np.stack([rng.choice(2 * N, N, replace=False) * BLOCK, rng.choice(2 * N, N, replace=False) * BLOCK, np.full(N, BLOCK)], axis=1)
    rows = segs.astype(np.uint64)
    cells = np.ascontiguousarray(rows)  # (N, 3) row by row: what copy_batch hands the kernel

    def measure(page: HoldPage) -> dict[str, dict[str, float]]:
        direct = DirectCopies(page)
        pair = direct.pair(dev, host)
        pair.copy_batch(segs)  # loads the kernel, makes the streams
        stream = direct._streams[0]
        kernel = direct._kernels[0]
        assert kernel is not None

        def parts() -> None:
            kernel.launch(pair.on_device[0], pair.on_device[1], cells, BLOCK, stream)
            direct._wait(stream)

        def sync() -> None:
            kernel.launch(pair.on_device[0], pair.on_device[1], cells, BLOCK, stream)
            check(rt.cudaStreamSynchronize(stream))

        from priod.direct import KERNEL_BATCH_MEAN
        from priod.engines.cuda._driver import DeviceScope

        steps: list[list[float]] = []

        def stepped() -> None:
            """copy_batch's checks (direct_table), then _run_batch's steps, timed step by step."""
            t = [time.perf_counter()]
            cells_, total, largest = direct_table(segs, pair.dst_bytes, pair.src_bytes)
            t.append(time.perf_counter())
            with DeviceScope(pair._device):
                t.append(time.perf_counter())
                st = direct._streams.get(0)
                k = direct._kernel(0) if direct.batch_kernel and all(pair.on_device) and total < KERNEL_BATCH_MEAN * len(cells_) else None
                assert k is not None
                t.append(time.perf_counter())
                page.begin(pair._slot)
                t.append(time.perf_counter())
                k.launch(pair.on_device[0], pair.on_device[1], cells_, largest, st)
                t.append(time.perf_counter())
                direct._wait(st)
                t.append(time.perf_counter())
                page.end(pair._slot)
            t.append(time.perf_counter())
            steps.append([(b - a) * 1e6 for a, b in itertools.pairwise(t)])

        lsteps: list[list[float]] = []
        ek = kernel._express

        def launch_stepped() -> None:
            """_BatchKernel.launch and ExpressKernel.launch_table, timed call by call, then the wait
            (one table of 256 rows since TABLE_MAX went to 256: no side stream, no join)."""
            t = [time.perf_counter()]
            with kernel._launching:
                main = kernel._cu(stream)
                t.append(time.perf_counter())
                ek._table[0], ek._table[1] = pair.on_device[1], pair.on_device[0]
                flat = cells.ravel()
                t.append(time.perf_counter())
                ek._table_view[2 : 2 + 3 * N] = flat
                t.append(time.perf_counter())
                check(ek._cu_launch(kernel.table_function, 1, N, 1, 1024, 1, 1, 0, main, ek._tparams, 0))
                t.append(time.perf_counter())
            direct._wait(stream)
            t.append(time.perf_counter())
            lsteps.append([(b - a) * 1e6 for a, b in itertools.pairwise(t)])

        ways: dict[str, Any] = {
            "full": lambda: pair.copy_batch(segs),
            "parts": parts,
            "sync": sync,
            "contiguous": lambda: pair.copy(N * BLOCK),
            "stepped": stepped,
            "launch_stepped": launch_stepped,
        }
        lat: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(COUNT):
            for name, fn in ways.items():
                time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                fn()
                lat[name].append((time.perf_counter() - t0) * 1e6)
        dev.fill(0)
        pair.copy_batch(segs)
        got = cp.asnumpy(dev)
        for d, s_, n in segs.tolist():
            assert np.array_equal(got[d : d + n], host[s_ : s_ + n]), "a block differs"
        direct.close()
        out = {k: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} for k, v in lat.items()}
        names = ("validate", "scope", "choose", "begin", "launch", "wait", "end+scope")
        out["steps_p50"] = {n: float(np.percentile([x[i] for x in steps], 50)) for i, n in enumerate(names)}
        lnames = ("streams", "cells", "fill", "launch", "wait")
        out["launch_steps_p50"] = {n: float(np.percentile([x[i] for x in lsteps], 50)) for i, n in enumerate(lnames)}
        return out

    res: dict[str, Any] = {}
    fd = os.memfd_create("probe-page")
    os.ftruncate(fd, PAGE_BYTES)
    own = HoldPage(fd, [{"device": 0, "device_uuid": gpu_uuid(0), "direction": "h2d"}, {"device": 0, "device_uuid": gpu_uuid(0), "direction": "d2h"}])
    res["own page, no daemon"] = measure(own)
    env = {"PRIOD_LOG__LEVEL": '"warning"'}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="probe") as c:
        res["daemon idle, its page"] = measure(c.hold_page())
        res["daemon idle, own page"] = measure(own)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "direct_batch.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'condition':<26}" + "".join(f"{w:>18}" for w in ("full", "parts", "sync", "contiguous")))
    for cond, r in res.items():
        print(f"{cond:<26}" + "".join(f"{r[w]['p50']:>9.0f} /{r[w]['p99']:>6.0f}" for w in ("full", "parts", "sync", "contiguous")))
        print(f"{'':<26}stepped {r['stepped']['p50']:.0f} us p50: " + ", ".join(f"{k} {v:.1f}" for k, v in r["steps_p50"].items()))
        print(f"{'':<26}launch stepped {r['launch_stepped']['p50']:.0f} us p50: " + ", ".join(f"{k} {v:.1f}" for k, v in r["launch_steps_p50"].items()))


if __name__ == "__main__":
    main()
