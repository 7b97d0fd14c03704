#!/usr/bin/env python3
"""How long clients take to carry on after a daemon restart, and that no byte is lost (sim engine).

A blocking and an asyncio client each hold a host and a device region with known bytes; the
daemon is killed (SIGKILL, or stopped with SIGTERM) and a new one started on the same socket
path, ``--restarts`` times. Per restart and client: the time from the new daemon listening to
the client's first successful copy (the client reconnects and re-registers its regions by
itself), and whether every region's bytes came through unchanged. Prints p50 / p99 / max.

    python scripts/bench_restart.py                       # 20 restarts, SIGKILL, about a minute
    python scripts/bench_restart.py --signal TERM --restarts 10
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
    args = ap.parse_args()
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGTERM
    n = args.region_mib * MiB
    rng = np.random.default_rng(7)
    path = os.path.join(tempfile.mkdtemp(prefix="priod-restart-"), "priod.sock")
    carry_on: dict[str, list[float]] = {"sync": [], "async": []}
    unchanged = 0
    with ExitStack() as stack:
        daemon = stack.enter_context(daemon_process(ENV, socket_path=path))
        sync = stack.enter_context(priod.SyncClient(path, name="restart-sync"))
        aclient = await priod.connect(path, name="restart-async")
        regions = {
            "sync": (sync.alloc_host(n), sync.alloc_device(n)),
            "async": (await aclient.alloc_host(n), await aclient.alloc_device(n)),
        }
        for host, _ in regions.values():
            assert host.array is not None
            host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        sync.copy(regions["sync"][1], regions["sync"][0])
        await aclient.copy(regions["async"][1], regions["async"][0])
        for i in range(args.restarts):
            before = {k: (h.array.copy(), d.array.copy()) for k, (h, d) in regions.items()}  # type: ignore[union-attr]
            # On a thread, so the asyncio client's loop runs meanwhile, as it would in a service.
            await asyncio.to_thread(daemon.stop, sig)
            daemon = await asyncio.to_thread(stack.enter_context, daemon_process(ENV, socket_path=path))
            listening = time.monotonic()
            h, d = regions["sync"]
            sync.copy(d, h, 4096)
            carry_on["sync"].append(time.monotonic() - listening)
            h, d = regions["async"]
            await aclient.copy(d, h, 4096)
            carry_on["async"].append(time.monotonic() - listening)
            same = all(
                np.array_equal(h.array, b_h) and np.array_equal(d.array, b_d)  # type: ignore[arg-type]
                for k, (h, d) in regions.items()
                for b_h, b_d in [before[k]]
            )
            unchanged += same
            print(
                f"restart {i + 1:>3}: sync {carry_on['sync'][-1] * 1e3:7.1f} ms  async {carry_on['async'][-1] * 1e3:7.1f} ms"
                f"  regions unchanged: {same}",
                flush=True,
            )
        await aclient.close()
    print(f"\nSIG{args.signal}, {args.restarts} restarts, {args.region_mib} MiB regions (sim engine)")
    print("client   carry on after the new daemon listens, ms: p50     p99     max")
    for k, v in carry_on.items():
        print(f"{k:<8} {'':>40}{percentile(v, 50) * 1e3:7.1f} {percentile(v, 99) * 1e3:7.1f} {max(v) * 1e3:7.1f}")
    print(f"restarts with every region bitwise unchanged: {unchanged} of {args.restarts}")
    return 0 if unchanged == args.restarts else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
