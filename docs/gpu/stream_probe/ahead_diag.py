# Run from the repository root with PYTHONPATH=.:scripts (it reuses scripts/bench_gpu.py).
"""Diagnose the ahead row's runs of ~900-us copies: per copy, the daemon's hold figures and lane state.

DIR (d2h) and COT (none or gemm) pick the row; N copies per size (100). Writes
ahead_diag_<dir>_<cot>.json under $OUT (every copy: latency, the daemon's `direct` figures, the
lane's bytes in flight) and prints, per size, the copies over 400 us, holds cut and copies counted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, "scripts")
import bench_gpu as bg

import priod

untraced = bg.urgent_client


def traced(path: str, directions: tuple[str, ...], count: int, cpu_pid: int, interval_s: float = bg.URGENT_INTERVAL_S,
           spin_us: float = 2000, warm: int = 5, direct: Any = None, ahead_us: float = 0.0) -> dict[str, Any]:
    """bench_gpu's urgent client, direct copies held ahead only, with `status` read after every copy."""
    if direct is None:
        return untraced(path, directions, count, cpu_pid, interval_s, spin_us, warm, direct, ahead_us)
    from priod.direct import DirectCopies

    out: dict[str, Any] = {}
    with priod.SyncClient(path, name="urgent", spin_us=spin_us) as c, priod.SyncClient(path, name="probe") as sc:
        copier = DirectCopies(c.hold_page())
        host, dev = (direct.urgent_host.ptr, max(bg.SIZES)), (direct.urgent_dev.ptr, max(bg.SIZES))
        pairs = {"h2d": copier.pair(dev, host), "d2h": copier.pair(host, dev)}
        for d in directions:
            for n in bg.SIZES:
                rows = []
                for _ in range(warm + count):
                    with pairs[d].held():
                        until = time.perf_counter() + ahead_us / 1e6
                        while time.perf_counter() < until:
                            pass
                        t0 = time.perf_counter()
                        pairs[d].copy(n)
                        t1 = time.perf_counter()
                    st = sc.status()
                    lane = next(ln for ln in st["lanes"] if ln["lane"] == f"gpu0/{d}")
                    rows.append({"lat": (t1 - t0) * 1e6, "t": t0, "direct": st["direct"], "inflight": lane["inflight_bytes"],
                                 "queued": lane["queued_requests"], "polls": st["polls"], "lane_bytes": st["lane_bytes"].get(f"gpu0/{d}")})
                    time.sleep(interval_s)
                out[f"{d}/{n}"] = [r["lat"] for r in rows[warm:]]
                out[f"_trace/{d}/{n}"] = rows
    out["_paths"], out["_daemon_us"] = {}, {}
    out["_cpu_s"] = {k: (0.0, 1.0) for k in out if not k.startswith("_")}
    return out


def main() -> None:
    bg.urgent_client = traced
    load = bg.Load(directions=(os.environ.get("DIR", "d2h"),), bulk_bytes=2 << 30, count=int(os.environ.get("N", "100")),
                   cotenant=os.environ.get("COT", "none"), gemm_n=8192, warm_s=1.0)
    r = bg.priod_row(load, express=True, bulk_poll="timer", direct=True, ahead_us=300.0)
    with open(os.path.join(os.environ.get("OUT", "."), f"ahead_diag_{load.directions[0]}_{load.cotenant}.json"), "w") as f:
        json.dump(r, f)
    for k, v in r["loaded"].items():
        if k.startswith("_trace"):
            bad = [i for i, x in enumerate(v) if x["lat"] > 400]
            print(k, "bad", len(bad), "cut", v[-1]["direct"]["cut"], "copies", v[-1]["direct"]["copies"])


if __name__ == "__main__":
    main()
