#!/usr/bin/env python3
"""How long clients take to carry on after a daemon restart, and that no byte is lost.

A blocking and an asyncio client each hold a host and a device region with known bytes; the
daemon is killed (SIGKILL, or stopped with SIGTERM) and a new one started on the same socket
path, ``--restarts`` times. Per restart: how long the new daemon takes to listen (on cuda: the
CUDA start and the lane calibration), and per client the time from the new daemon listening to
the client's first successful copy (the client reconnects and registers its regions again by
itself: host regions are pinned again), and whether every region's bytes came through
unchanged (the device region read back into a host region). Prints p50 / p99 / max.

    python scripts/bench_restart.py                       # 20 restarts, SIGKILL, about a minute
    python scripts/bench_restart.py --signal TERM --restarts 10
    python scripts/bench_restart.py --backend cuda --restarts 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import priod
from priod.testing import daemon_process

MiB = 1 << 20
ENV = {"PRIOD_LOG__LEVEL": '"warning"'}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument("--region-mib", type=int, default=16)
    ap.add_argument("--backend", choices=["sim", "cuda"], default="sim")
    args = ap.parse_args()
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGTERM
    n = args.region_mib * MiB
    rng = np.random.default_rng(7)
    path = os.path.join(tempfile.mkdtemp(prefix="priod-restart-"), "priod.sock")
    carry_on: dict[str, list[float]] = {"sync": [], "async": []}
    start_s: list[float] = []
    unchanged = 0

    def start() -> Any:
        return daemon_process(ENV, backend=args.backend, socket_path=path, start_timeout=120)

    with ExitStack() as stack:
        daemon = stack.enter_context(start())
        sync = stack.enter_context(priod.SyncClient(path, name="restart-sync", copy_path="daemon"))
        aclient = await priod.connect(path, name="restart-async", copy_path="daemon")
        # Per client: a host region of known bytes, a device region copied from it, and a host
        # region the device region's bytes are read back into after each restart.
        regions = {
            "sync": (sync.alloc_host(n), sync.alloc_device(n), sync.alloc_host(n)),
            "async": (await aclient.alloc_host(n), await aclient.alloc_device(n), await aclient.alloc_host(n)),
        }
        for host, _, _ in regions.values():
            assert host.array is not None
            host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        sync.copy(regions["sync"][1], regions["sync"][0])
        await aclient.copy(regions["async"][1], regions["async"][0])
        expected = {k: h.array.copy() for k, (h, _, _) in regions.items()}  # type: ignore[union-attr]
        for i in range(args.restarts):
            # On a thread, so the asyncio client's loop runs meanwhile, as it would in a service.
            await asyncio.to_thread(daemon.stop, sig)
            t0 = time.monotonic()
            daemon = await asyncio.to_thread(stack.enter_context, start())
            listening = time.monotonic()
            start_s.append(listening - t0)
            h, d, back = regions["sync"]
            sync.copy(d, h, 4096)
            carry_on["sync"].append(time.monotonic() - listening)
            sync.copy(back, d)
            h, d, aback = regions["async"]
            await aclient.copy(d, h, 4096)
            carry_on["async"].append(time.monotonic() - listening)
            await aclient.copy(aback, d)
            same = all(
                np.array_equal(h.array, expected[k]) and np.array_equal(b.array, expected[k])  # type: ignore[arg-type]
                for k, (h, _, b) in regions.items()
            )
            unchanged += same
            print(
                f"restart {i + 1:>3}: new daemon listening after {start_s[-1] * 1e3:7.1f} ms; first copy: sync "
                f"{carry_on['sync'][-1] * 1e3:7.1f} ms  async {carry_on['async'][-1] * 1e3:7.1f} ms  regions unchanged: {same}",
                flush=True,
            )
        await aclient.close()
    print(f"\nSIG{args.signal}, {args.restarts} restarts, {args.region_mib} MiB regions ({args.backend} engine)")
    print(
        f"a new daemon listening after the old one is gone, ms: p50 {percentile(start_s, 50) * 1e3:7.1f}"
        f"  p99 {percentile(start_s, 99) * 1e3:7.1f}  max {max(start_s) * 1e3:7.1f}"
    )
    print("client   carry on after the new daemon listens, ms: p50     p99     max")
    for k, v in carry_on.items():
        print(f"{k:<8} {'':>40}{percentile(v, 50) * 1e3:7.1f} {percentile(v, 99) * 1e3:7.1f} {max(v) * 1e3:7.1f}")
    print(f"restarts with every region bitwise unchanged (host, and device read back): {unchanged} of {args.restarts}")
    return 0 if unchanged == args.restarts else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
