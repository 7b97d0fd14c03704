"""A client process for end-to-end tests: ``python tests/clientproc.py SOCKET MODE [ARGS]``.

Modes:
  verify SEED COUNT   copy random bytes host->device->host at random sizes and offsets, check
                      every byte at the device (sim maps it) and after the round trip; prints a
                      JSON line {"copies": n, "bytes": b} and exits 0, or exits 1 on a mismatch.
  hold NBYTES         allocate regions, queue large copies, print "ready", then wait to be killed.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import priod


def verify(path: str, seed: int, count: int) -> int:
    rng = np.random.default_rng(seed)
    size = 8 << 20
    with priod.SyncClient(path, name=f"verify-{seed}") as c:
        src = c.alloc_host(size)
        dev = c.alloc_device(size)
        back = c.alloc_host(size)
        assert src.array is not None and dev.array is not None and back.array is not None
        moved = 0
        for i in range(count):
            n = int(rng.integers(1, size // 2))
            so, do, bo = (int(rng.integers(0, size - n)) for _ in range(3))
            src.array[so : so + n] = rng.integers(0, 256, n, dtype=np.uint8)
            prio = ["urgent", "high", "normal", "bulk"][i % 4]
            r = c.copy(dev, src, n, dst_offset=do, src_offset=so, priority=prio)
            if r.nbytes != n or not np.array_equal(dev.array[do : do + n], src.array[so : so + n]):
                print(f"h2d mismatch at copy {i}", file=sys.stderr)
                return 1
            c.copy(back, dev, n, dst_offset=bo, src_offset=do, priority=prio)
            if not np.array_equal(back.array[bo : bo + n], src.array[so : so + n]):
                print(f"d2h mismatch at copy {i}", file=sys.stderr)
                return 1
            moved += 2 * n
        print(json.dumps({"copies": 2 * count, "bytes": moved}))
    return 0


def hold(path: str, nbytes: int) -> int:
    import asyncio

    async def run() -> None:
        c = await priod.connect(path, name="hold")
        h = await c.alloc_host(nbytes)
        d = await c.alloc_device(nbytes)
        for _ in range(4):
            c.start_copy(d, h, nbytes, priority="bulk")
        await c.ping()  # the copies are queued once this round trip is back
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sock, mode = sys.argv[1], sys.argv[2]
    if mode == "verify":
        sys.exit(verify(sock, int(sys.argv[3]), int(sys.argv[4])))
    if mode == "hold":
        sys.exit(hold(sock, int(sys.argv[3])))
    time.sleep(0)
    sys.exit(f"unknown mode {mode}")
