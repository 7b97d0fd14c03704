"""Probe (session 17, from session 14's): do bulk *batches* through the daemon cost a direct
urgent copy more than bulk contiguous copies do, and does the batch's size (its segments, which
the daemon's loop checks as one unit) matter?

A phase named ``batchN`` streams bulk batches of N MiB in 64 KiB blocks (N = 256: 4,096 blocks,
session 14's), ``contiguous`` 256 MiB contiguous copies; ``#2`` repeats a phase; ``-quiet``
runs the bulk alone, no urgent copies.

Each bulk batch of 4,096 scattered 64 KiB blocks takes the daemon's loop ~330 us to take
(`take_batch`, H200 host, docs/benchmarks.md session 14), time in which it does not read the
hold page; a direct copy's hold closes the gate only once the loop reads it. Here, with one cuda
daemon: direct urgent 64 KiB h2d copies (this process, CuPy pinned buffers), 5 ms apart, COUNT a
phase, while nothing else runs, while a bulk client streams 256 MiB contiguous copies (two
outstanding), and while one streams bulk batches of 4,096 x 64 KiB (two outstanding, the blocks
scattered). Client-observed us, p50 / p99, and the bulk GB/s of each phase.

    python3 docs/gpu/session17/batch_bulk_probe.py
    SETS="scheduler__depth=2;scheduler__depth=4" PHASES=contiguous,batch256,batch16 python3 docs/gpu/session17/batch_bulk_probe.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())

import priod
from priod.direct import DirectCopies
from priod.testing import daemon_process

COUNT = int(os.environ.get("COUNT", "200"))
MiB = 1 << 20

BULK = r"""
import signal, sys, time, numpy as np, priod
path, mode, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
n = mib << 20
with priod.SyncClient(path, name="bulk-" + mode) as c:
    h, d = c.alloc_host(n), c.alloc_device(n)
    blocks = n // (64 << 10)
    rng = np.random.default_rng(7)
    segs = np.stack([rng.permutation(blocks) * (64 << 10), np.arange(blocks) * (64 << 10), np.full(blocks, 64 << 10)], axis=1)
    start = (lambda: c.start_copy_batch(d, h, segs, priority="bulk")) if mode == "batch" else (lambda: c.start_copy(d, h, n, priority="bulk"))
    start().wait(60)
    print("ready", flush=True)
    pending = [start(), start()]
    moved, t0 = 0, time.perf_counter()
    while not stop:
        moved += pending.pop(0).wait(60).nbytes
        pending.append(start())
    took = time.perf_counter() - t0
    for p in pending:
        p.wait(60)
    print(f"gbps {moved / took / 1e9:.2f}", flush=True)
"""


def main() -> None:
    import cupy as cp

    size = 64 << 10
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    dev = cp.zeros(size, dtype=cp.uint8)
    res = {}
    # SETS: daemon settings to compare, ";" between variants, "," within one (run 2 of the probe);
    # PHASES: which phases each variant runs.
    variants = os.environ.get("SETS", "").split(";")
    phases = os.environ.get("PHASES", "idle,contiguous,batch256,batch16,contiguous#2,batch256#2,batch16#2").split(",")
    for variant in variants:
        env = {"PRIOD_LOG__LEVEL": '"warning"'}
        for item in filter(None, variant.split(",")):
            key, _, value = item.partition("=")
            env[f"PRIOD_{key.upper()}"] = value
        print(f"== daemon settings: {variant or 'default'}", flush=True)
        res[variant or "default"] = one_daemon(env, phases, pair_of=(dev, host), cp=cp)
    with open(os.path.join(os.environ.get("OUT", "."), "batch_bulk_probe.json"), "w") as f:
        json.dump(res, f)


def one_daemon(env: dict, phases: list, pair_of: tuple, cp: object) -> dict:
    dev, host = pair_of
    res = {}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="urgent") as c:
        direct = DirectCopies(c.hold_page())
        pair = direct.pair(dev, host)
        for phase in phases:
            child = None
            if phase != "idle":
                kind = phase.split("#")[0].removesuffix("-quiet")
                mode, mib = ("batch", int(kind[5:])) if kind.startswith("batch") else (kind, 256)
                child = subprocess.Popen([sys.executable, "-c", BULK, d.socket_path, mode, str(mib)], stdout=subprocess.PIPE, text=True)
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                time.sleep(1.0)
            lat = [0.0]
            if phase.endswith("-quiet"):  # the bulk alone, for as long as a phase with urgent copies
                time.sleep(COUNT * 0.0055)
            else:
                lat = []
                for i in range(COUNT):
                    host[:8] = i % 256
                    t0 = time.perf_counter()
                    pair.copy()
                    lat.append((time.perf_counter() - t0) * 1e6)
                    time.sleep(0.005)
                assert int(cp.asnumpy(dev[:1])[0]) == (COUNT - 1) % 256  # type: ignore[attr-defined]
            gbps = None
            if child is not None:
                child.send_signal(signal.SIGTERM)
                out, _ = child.communicate(timeout=120)
                gbps = float(out.split()[-1])
            res[phase] = {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "bulk_gbps": gbps, "raw": lat}
            print(f"{phase:<14} direct 64 KiB p50 {res[phase]['p50']:7.1f}  p99 {res[phase]['p99']:7.1f} us   bulk {gbps if gbps is not None else '-'} GB/s", flush=True)
        direct.close()
    return res


if __name__ == "__main__":
    main()
