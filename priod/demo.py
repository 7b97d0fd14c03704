"""``priod demo``: the problem and the fix, side by side, on the simulated engine.

Two daemons in turn (``mode = "fifo"``, then priod's scheduler), each with a bulk client
streaming large host-to-device copies and an urgent client sending small ones. One table.
"""

from __future__ import annotations

import asyncio

from priod.client.client import Client
from priod.testing import bulk_load, daemon_process, describe, urgent_probe

__all__ = ["measure_mode", "run_demo"]


async def _measure(path: str, seconds: float, urgent_bytes: int, bulk_bytes: int) -> dict[str, float]:
    bulk = await Client.connect(path, name="demo-bulk")
    urgent = await Client.connect(path, name="demo-urgent", copy_path="daemon")  # the scheduler is what the demo shows
    try:
        stop = asyncio.Event()
        load = asyncio.ensure_future(bulk_load(bulk, bulk_bytes, stop, priority="bulk"))
        await asyncio.sleep(0.2)  # let the bulk queue fill first
        interval = 0.02
        count = max(5, int(seconds / (interval + 0.002)))
        lat = await urgent_probe(urgent, urgent_bytes, count, interval_s=interval)
        stop.set()
        result = await load
        d = describe(lat)
        return {"urgent_p50_us": d["p50"], "urgent_p99_us": d["p99"], "bulk_gbps": result.gbps}
    finally:
        await urgent.close()
        await bulk.close()


def measure_mode(mode: str, seconds: float, urgent_bytes: int, bulk_bytes: int) -> dict[str, float]:
    import uvloop

    with daemon_process({"PRIOD_SCHEDULER__MODE": f'"{mode}"', "PRIOD_LOG__LEVEL": '"warning"'}) as d:
        return uvloop.run(_measure(d.socket_path, seconds, urgent_bytes, bulk_bytes))


def run_demo(seconds: float = 3.0, urgent_bytes: int = 1 << 20, bulk_bytes: int = 256 << 20) -> int:
    print(
        f"priod demo (sim engine): urgent {urgent_bytes >> 10} KiB copies while a bulk client streams {bulk_bytes >> 20} MiB copies, {seconds:.0f} s per run"
    )
    fifo = measure_mode("fifo", seconds, urgent_bytes, bulk_bytes)
    prio = measure_mode("priod", seconds, urgent_bytes, bulk_bytes)
    print()
    print(f"{'':<22}{'fifo (plain stream)':>21}{'priod':>12}{'fifo / priod':>14}")
    for key, label in (
        ("urgent_p50_us", "urgent p50 (us)"),
        ("urgent_p99_us", "urgent p99 (us)"),
        ("bulk_gbps", "bulk GB/s"),
    ):
        ratio = fifo[key] / prio[key] if prio[key] else float("nan")
        print(f"{label:<22}{fifo[key]:>21.1f}{prio[key]:>12.1f}{ratio:>13.1f}x")
    return 0
