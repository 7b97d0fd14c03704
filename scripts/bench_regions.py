#!/usr/bin/env python3
"""What region set-up and teardown cost, and what they do to urgent copies meanwhile.

One daemon; a bulk client streams host-to-device copies the whole time. Phases, side by side:
  quiet        urgent copies only (the reference)
  host churn   another client allocates and frees host regions in a loop (memfd, pinning)
  device churn another client allocates and frees device regions in a loop (cudaMalloc/cudaFree)
Per phase: urgent 64 KiB latency p50/p99/max (client-observed and the daemon's own), and the
churning client's alloc and free times.

    python scripts/bench_regions.py --backend cuda --out out/bench_regions

Prints the table last; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod
from priod.testing import daemon_process

MiB = 1 << 20


def bulk(path: str, stop: Any) -> None:
    with priod.SyncClient(path, copy_path="daemon", name="bulk") as c:
        h, d = c.alloc_host(256 * MiB), c.alloc_device(256 * MiB)
        while not stop.is_set():
            c.copy(d, h, priority="bulk")


def churn(path: str, kind: str, nbytes: int, stop: Any, q: Any) -> None:
    alloc_ms, free_ms = [], []
    with priod.SyncClient(path, copy_path="daemon", name=f"churn-{kind}") as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.alloc_host(nbytes) if kind == "host" else c.alloc_device(nbytes)
            t1 = time.perf_counter()
            c.free(r)
            t2 = time.perf_counter()
            alloc_ms.append((t1 - t0) * 1e3)
            free_ms.append((t2 - t1) * 1e3)
            time.sleep(0.01)
    q.put({"alloc_ms": alloc_ms, "free_ms": free_ms})


def urgent(c: priod.SyncClient, h: Any, d: Any, count: int) -> dict[str, list[float]]:
    lat, daemon = [], []
    for _ in range(count):
        t0 = time.perf_counter()
        r = c.copy(d, h, 64 << 10, priority="urgent")
        lat.append((time.perf_counter() - t0) * 1e6)
        daemon.append(r.total_us)
        time.sleep(0.003)
    return {"lat_us": lat, "daemon_us": daemon}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default="out/bench_regions")
    ap.add_argument("--count", type=int, default=600, help="urgent copies per phase")
    ap.add_argument("--region-mib", type=int, default=16, help="size of each churned region")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "phases": {}}
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend=args.backend, start_timeout=120) as dmn:
        stop_bulk = ctx.Event()
        b = ctx.Process(target=bulk, args=(dmn.socket_path, stop_bulk))
        b.start()
        with priod.SyncClient(dmn.socket_path, copy_path="daemon", name="urgent", spin_us=2000) as c:
            h, d = c.alloc_host(MiB), c.alloc_device(MiB)
            time.sleep(3.0)  # bulk warm
            for phase in ("quiet", "host", "device", "quiet again"):
                stop, q = ctx.Event(), ctx.Queue()
                p = None
                if phase in ("host", "device"):
                    p = ctx.Process(target=churn, args=(dmn.socket_path, phase, args.region_mib * MiB, stop, q))
                    p.start()
                    time.sleep(1.0)
                res: dict[str, Any] = urgent(c, h, d, args.count)
                if p is not None:
                    stop.set()
                    res.update(q.get(timeout=60))
                    p.join(timeout=60)
                results["phases"][phase] = res
        stop_bulk.set()
        b.join(timeout=60)
        results["backend"] = args.backend
    with open(os.path.join(args.out, "results.json"), "w") as fp:
        json.dump(results, fp)
    print(render(results, args.region_mib))
    return 0


def render(results: dict[str, Any], region_mib: int) -> str:
    def pc(v: list[float], q: float) -> float:
        return float(np.percentile(v, q)) if v else float("nan")

    lines = [
        f"urgent 64 KiB h2d under bulk, while another client churns {region_mib} MiB regions",
        f"{'phase':<12} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'daemon p99':>11} {'daemon max':>11} {'alloc p50 ms':>13} {'free p50 ms':>12} {'cycles':>7}",
    ]
    for phase, r in results["phases"].items():
        lat, dm = r["lat_us"], r["daemon_us"]
        a, f = r.get("alloc_ms", []), r.get("free_ms", [])
        churn_cols = f"{pc(a, 50):13.2f} {pc(f, 50):12.2f} {len(a):7d}" if a else f"{'':>13} {'':>12} {'':>7}"
        lines.append(
            f"{phase:<12} {pc(lat, 50):8.0f} {pc(lat, 99):8.0f} {max(lat):8.0f} {pc(dm, 99):11.0f} {max(dm):11.0f} {churn_cols}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
