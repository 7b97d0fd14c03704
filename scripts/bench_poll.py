#!/usr/bin/env python3
"""The daemon's poll loop: its CPU and the urgent latency under each ``[server] urgent_poll``,
side by side in one run, on an engine the daemon must poll (the sim with ``[sim] polled``, as
on a GPU).

    .venv/bin/python scripts/bench_poll.py            # about 1 minute on 2 cores
    .venv/bin/python scripts/bench_poll.py --backend cuda

For each setting ("spin", "timer"), a fresh daemon; a bulk client in its own process keeps
two large h2d copies outstanding; then, for ``--seconds``, the CPU of the daemon's event-loop
thread (the sim's copy threads, which stand for the GPU, are left out) with bulk alone, and
with urgent 64 KiB copies through the daemon every 5 ms beside it (client-observed p50 / p99,
every copy's bytes checked). Rounds alternate the settings. Full numbers to
``<out>/bench_poll.json``; a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

from priod.client import Client
from priod.testing import BulkProcess, CpuMeter, daemon_process, urgent_copies

SETTINGS = ("spin", "timer")


def _cpu_per_s(meter: CpuMeter, seconds: float) -> float:
    a = meter.sample()
    time.sleep(seconds)
    d = CpuMeter.delta(a, meter.sample())
    return float(d.get("loop_ns", d["loop"]) / d["seconds"])


async def one(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "PRIOD_SERVER__URGENT_POLL": f'"{setting}"',
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0",
    }
    if args.backend == "sim":
        env["PRIOD_SIM__POLLED"] = "true"
    with daemon_process(env, backend=args.backend) as d:
        meter = CpuMeter(d.proc.pid)
        bulk = BulkProcess(d.socket_path, args.bulk_mib << 20, 2)
        done: dict[str, Any] = {}
        try:
            bulk.wait_ready()
            alone = await asyncio.to_thread(_cpu_per_s, meter, args.seconds)
            c = await Client.connect(d.socket_path, copy_path="daemon")
            try:
                count = int(args.seconds / 0.005)
                a = meter.sample()
                probe = await urgent_copies(c, 65536, count, interval_s=0.005)
                dd = CpuMeter.delta(a, meter.sample())
            finally:
                await c.close()
            done = bulk.stop()
        finally:
            if not done:
                bulk.kill()
    lat = np.asarray(probe.latency_us)
    return {
        "setting": setting,
        "cpu_bulk_alone": alone,
        "cpu_with_urgent": float(dd.get("loop_ns", dd["loop"]) / dd["seconds"]),
        "urgent_p50_us": float(np.percentile(lat, 50)),
        "urgent_p99_us": float(np.percentile(lat, 99)),
        "urgent_copies": len(lat),
        "bulk_errors": len(done.get("errors", [])),
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--bulk-mib", type=int, default=256)
    p.add_argument("--out", default="out/bench_poll")
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            print(f"[bench_poll] round {r + 1}: urgent_poll = {setting}", flush=True)
            runs.append(await one(setting, args))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_poll.json"), "w") as fp:
        json.dump({"backend": args.backend, "runs": runs}, fp, indent=1)
    print(f"\n{args.backend}, {os.cpu_count()} CPUs; urgent 64 KiB every 5 ms beside 2 x {args.bulk_mib} MiB h2d bulk")
    print("urgent_poll | daemon loop CPU s/s, bulk alone | with urgent | urgent p50 / p99 us | errors")
    for setting in SETTINGS:
        rs = [x for x in runs if x["setting"] == setting]

        def span(key: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
            return f"{min(x[key] for x in rs):{fmt}}-{max(x[key] for x in rs):{fmt}}"

        print(
            f"{setting:11} | {span('cpu_bulk_alone', '.2f')} | {span('cpu_with_urgent', '.2f')} | "
            f"{span('urgent_p50_us', '.0f')} / {span('urgent_p99_us', '.0f')} | {sum(x['bulk_errors'] for x in rs)}"
        )


if __name__ == "__main__":
    asyncio.run(main())
