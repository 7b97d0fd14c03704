"""Through the daemon, is an urgent batch slower by the copy kernel than by batched DMA, and why,
when in-process the kernel is ~120 us faster (kernel_probe.py, run B)? (Session 19, run H.)

One daemon at a time (so only its CUDA context is busy), its chooser bypassed
(force_site/sitecustomize.py: FORCE_URGENT_PATH=express, then dma): 256 scattered 64 KiB blocks as
one urgent copy_batch and the same 16 MiB as one urgent copy, alternating, COUNT each, a SyncClient
spinning 2 ms for its reply, 5 ms asleep after it. Per sample: client-observed us and the reply's
queued_us (arrival to first chunk handed out), transfer_us (to the last chunk seen done) and
total_us. Full numbers in $OUT/paths_probe_<direction>.json.

    DIRECTION=h2d COUNT=200 python3 docs/gpu/session19/paths_probe.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

import priod
from priod.testing import daemon_process

KiB = 1 << 10
BLOCKS, BLOCK = 256, 64 * KiB
SIZE = 2 * BLOCKS * BLOCK
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "force_site")


def main() -> None:
    from bench_gpu_batch import scattered

    direction = os.environ.get("DIRECTION", "h2d")
    count = int(os.environ.get("COUNT", "200"))
    out = os.environ.get("OUT", "out/paths_probe")
    os.makedirs(out, exist_ok=True)
    segs = scattered(BLOCKS, BLOCK, seed=4)
    res: dict[str, dict[str, dict[str, list[float | str]]]] = {}
    for forced in ("express", "dma"):
        env = {"PRIOD_LOG__LEVEL": '"warning"', "FORCE_URGENT_PATH": forced, "PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")])}
        rows: dict[str, dict[str, list[float | str]]] = {f: {k: [] for k in ("client", "queued", "transfer", "total", "path")} for f in ("contiguous", "batch")}
        with daemon_process(env, backend=os.environ.get("BACKEND", "cuda"), start_timeout=180) as dm, priod.SyncClient(dm.socket_path, name="paths", spin_us=2000) as c:
            h, g = c.alloc_host(SIZE), c.alloc_device(SIZE)
            dst, src = (g, h) if direction == "h2d" else (h, g)
            for i in range(10 + count):
                for form in ("contiguous", "batch") if i % 2 == 0 else ("batch", "contiguous"):
                    t0 = time.perf_counter()
                    if form == "contiguous":
                        r = c.copy(dst, src, BLOCKS * BLOCK, priority="urgent", timeout=30)
                    else:
                        r = c.copy_batch(dst, src, segs, priority="urgent", timeout=30)
                    took = (time.perf_counter() - t0) * 1e6
                    if i >= 10:
                        row = rows[form]
                        row["client"].append(took)
                        row["queued"].append(r.queued_us)
                        row["transfer"].append(r.transfer_us)
                        row["total"].append(r.total_us)
                        row["path"].append(r.path)
                    time.sleep(0.005)
        res[forced] = rows
    with open(os.path.join(out, f"paths_probe_{direction}.json"), "w") as f:
        json.dump({"direction": direction, "count": count, "rows": res, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, f)
    print(f"\n{direction}, 256 x 64 KiB, one daemon at a time, path forced, {count} each; us p50 (p99)")
    print(f"{'forced path, form':<22} {'client':>14} {'queued':>12} {'transfer':>14} {'total':>14}  paths")
    for forced, rows in res.items():
        for form, row in rows.items():
            cells = []
            for k in ("client", "queued", "transfer", "total"):
                v = np.array(row[k], dtype=float)
                cells.append(f"{np.percentile(v, 50):6.0f} ({np.percentile(v, 99):5.0f})")
            print(f"{forced + ' ' + form:<22} {cells[0]:>14} {cells[1]:>12} {cells[2]:>14} {cells[3]:>14}  {sorted(set(row['path']))}")


if __name__ == "__main__":
    main()
