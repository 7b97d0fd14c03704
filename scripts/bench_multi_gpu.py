#!/usr/bin/env python3
"""One event loop's cost as GPUs grow: the daemon's CPU per copy and per GB with 1,
2 and 4 sim GPUs, bulk on every link, and what an urgent copy sees meanwhile.

    .venv/bin/python scripts/bench_multi_gpu.py                  # 1, 2, 4 GPUs, about 20 s
    .venv/bin/python scripts/bench_multi_gpu.py --gpus 1 2 4 8 --seconds 5 --peer --max-block-us 4000

For each GPU count a sim daemon serves that many GPUs (``--gbps`` per h2d and d2h link; with
``--peer`` also every ordered pair's peer link at the same rate). A bulk client keeps two
``--bulk-mib`` copies in flight on every link; a prober sends a 64 KiB urgent h2d copy to the
last GPU every 10 ms. After a warm-up, ``--seconds`` are measured: bytes per lane (status),
copies finished, and CPU seconds of the daemon's event-loop thread (schedstat; the sim's copy
threads, which stand in for the hardware, are in "process"), and the seconds that thread waited
runnable for a CPU ("loop wait": on a shared 2-core box, the loop starved rather than busy).

At the default 0.5 GB/s per link a lane's chunk is 256 KiB ([tuning] min_chunk_bytes), so a
busy link ends about 1,900 chunks a second: the same chunk rate per link as an H200's 55 GB/s
link in 27 MiB chunks. The loop's cost per chunk therefore carries over to the H200; its cost
per GB does not (chunks there are ~100x larger) and is shown for the sim as run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

import priod
from priod.client.client import Client, Region
from priod.testing import daemon_process, schedstat_seconds

URGENT = 64 << 10


def _loop_wait_seconds(pid: int) -> float:
    """Seconds the daemon's event-loop thread (its main thread) has waited runnable for a CPU:
    the second figure of its schedstat. Low CPU with high waiting is a starved loop, not an
    idle one; only both together say whether one loop keeps up."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as fp:
        return int(fp.read().split()[1]) / 1e9


async def _keep_busy(c: Client, dst: Region, src: Region, stop: asyncio.Event, done: list[int]) -> None:
    handles = [c.start_copy(dst, src, priority="bulk") for _ in range(2)]
    while not stop.is_set():
        await handles.pop(0)
        done[0] += 1
        handles.append(c.start_copy(dst, src, priority="bulk"))
    for h in handles:
        await h


async def _probe(c: Client, dst: Region, src: Region, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await c.copy(dst, src, priority="urgent")
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)


async def _measure(path: str, pid: int, gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.bulk_mib << 20
    stop = asyncio.Event()
    done = [0]
    urgent: list[float] = []
    async with priod.connect(path, copy_path="daemon", name="bulk") as bulk, priod.connect(path, name="probe") as probe:
        links: list[tuple[Region, Region]] = []
        loaded: set[str] = set()
        for g in range(gpus):
            host_a, host_b = await bulk.alloc_host(nbytes), await bulk.alloc_host(nbytes)
            dev_a, dev_b = await bulk.alloc_device(nbytes, device=g), await bulk.alloc_device(nbytes, device=g)
            links += [(dev_a, host_a), (host_b, dev_b)]
            loaded |= {f"gpu{g}/h2d", f"gpu{g}/d2h"}
            if args.peer:
                for h in range(gpus):
                    if h != g:
                        links.append(
                            (await bulk.alloc_device(nbytes, device=h), await bulk.alloc_device(nbytes, device=g))
                        )
                        loaded.add(f"gpu{g}/peer/gpu{h}")
        usrc, udst = await probe.alloc_host(URGENT), await probe.alloc_device(URGENT, device=gpus - 1)
        tasks = [asyncio.create_task(_keep_busy(bulk, dst, src, stop, done)) for dst, src in links]
        tasks.append(asyncio.create_task(_probe(probe, udst, usrc, stop, urgent)))
        await asyncio.sleep(args.warmup)
        st0, copies0, cpu0, wait0, t0 = (
            await probe.status(),
            done[0],
            schedstat_seconds(pid),
            _loop_wait_seconds(pid),
            time.perf_counter(),
        )
        urgent.clear()
        await asyncio.sleep(args.seconds)
        st1, copies1, cpu1, wait1, t1 = (
            await probe.status(),
            done[0],
            schedstat_seconds(pid),
            _loop_wait_seconds(pid),
            time.perf_counter(),
        )
        lat = list(urgent)
        stop.set()
        await asyncio.gather(*tasks)
    if cpu0 is None or cpu1 is None:
        raise SystemExit("this kernel hides /proc/<pid>/task/*/schedstat: the loop's CPU cannot be measured here")
    wall = t1 - t0
    chunk = {ln["lane"]: ln["chunk_bytes"] for ln in st1["lanes"]}
    moved = {lane: n - st0["lane_bytes"].get(lane, 0) for lane, n in st1["lane_bytes"].items()}
    busy = {lane: moved[lane] for lane in loaded}
    nbytes_total = sum(moved.values())
    chunks = sum(n / chunk[lane] for lane, n in moved.items())
    copies = copies1 - copies0 + len(lat)
    loop_cpu = cpu1[1] - cpu0[1]
    modelled = sum(ln["bandwidth_gbps"] * 1e9 for ln in st1["lanes"] if ln["lane"] in busy)
    return {
        "gpus": gpus,
        "links": len(busy),
        "gbps": nbytes_total / wall / 1e9,
        "of_modelled": nbytes_total / wall / modelled if modelled else float("nan"),
        "copies_s": copies / wall,
        "chunks_s": chunks / wall,
        "loop_cpu_s": loop_cpu / wall,
        "loop_wait_s": (wait1 - wait0) / wall,
        "loop_us_copy": loop_cpu / copies * 1e6,
        "loop_us_chunk": loop_cpu / chunks * 1e6,
        "loop_ms_gb": loop_cpu / (nbytes_total / 1e9) * 1e3,
        "process_cpu_s": (cpu1[0] - cpu0[0]) / wall,
        "urgent_p50_ms": statistics.median(lat) * 1e3 if lat else float("nan"),
        "urgent_p99_ms": sorted(lat)[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else float("nan"),
        "urgent_n": len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--gbps", type=float, default=0.5, help="each h2d, d2h (and peer) link's modelled rate")
    ap.add_argument("--bulk-mib", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--peer", action="store_true", help="also bulk on every ordered pair's peer link")
    ap.add_argument(
        "--max-block-us", type=float, default=1000.0, help="[scheduler] max_block_us: fewer, larger chunks above 1000"
    )
    args = ap.parse_args()
    rows = []
    for gpus in args.gpus:
        g = str(args.gbps)
        env = {
            "PRIOD_LOG__LEVEL": '"warning"',
            "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0",
            "PRIOD_SIM__DEVICES": str(gpus),
            "PRIOD_SIM__H2D_GBPS": g,
            "PRIOD_SIM__D2H_GBPS": g,
            "PRIOD_SIM__PEER_GBPS": g,
            "PRIOD_SCHEDULER__MAX_BLOCK_US": str(args.max_block_us),
        }
        with daemon_process(env) as d:
            rows.append(asyncio.run(_measure(d.socket_path, d.proc.pid, gpus, args)))
        print(f"gpus={gpus}: done", file=sys.stderr)
    print(
        f"# sim engine, {args.gbps} GB/s per link{' (peer links too)' if args.peer else ''}, {args.bulk_mib} MiB bulk copies "
        f"(2 in flight per link), max_block_us {args.max_block_us:g}, {args.seconds} s per row, {os.cpu_count()} CPUs"
    )
    head = (
        "gpus",
        "links",
        "GB/s",
        "of model",
        "copies/s",
        "chunks/s",
        "loop CPU s/s",
        "loop wait s/s",
        "us/copy",
        "us/chunk",
        "ms/GB",
        "proc CPU s/s",
        "urgent p50 ms",
        "p99 ms",
    )
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['gpus']} | {r['links']} | {r['gbps']:.2f} | {r['of_modelled']:.3f} | {r['copies_s']:.0f} | {r['chunks_s']:.0f} | "
            f"{r['loop_cpu_s']:.3f} | {r['loop_wait_s']:.3f} | {r['loop_us_copy']:.0f} | {r['loop_us_chunk']:.1f} | {r['loop_ms_gb']:.1f} | {r['process_cpu_s']:.2f} | "
            f"{r['urgent_p50_ms']:.2f} | {r['urgent_p99_ms']:.2f}"
        )


if __name__ == "__main__":
    main()
