#!/usr/bin/env python3
"""Two GPUs under one daemon: isolation between GPUs, peer copies, bytes checked.

Rows, in one run, each urgent figure from 60 copies 5 ms apart (client-observed, a SyncClient
spinning for its reply), bulk from other processes keeping two copies in flight per link:
  isolation   64 KiB urgent h2d to gpu1, idle, then while bulk saturates gpu0's h2d and d2h
              links, then while it saturates gpu1's own (the reference for "held for bulk")
  aggregate   bulk h2d on both GPUs at once through priod, against raw in-process
              cudaMemcpyAsync on both at once (the host's memory and root complex are shared)
  peer        raw cudaMemcpyPeerAsync gpu0 -> gpu1 (in-process); priod's peer bulk alone; a
              1 MiB urgent peer copy idle and under saturating peer bulk (target: p99 <= 2 x its
              idle p99 + 100 us); every peer copy's bytes read back and checked

    python3 scripts/bench_gpu_multi.py --out $OUT/multi                 # two GPUs, about 1 minute
    .venv/bin/python scripts/bench_gpu_multi.py --backend sim --out /tmp/multi   # a dry run on two sim GPUs

Needs two GPUs, cuda-bindings and CuPy for the cuda run. Prints a short table last; full numbers
in results.json under --out.
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
from priod.testing import daemon_process, summarize

KiB, MiB = 1 << 10, 1 << 20
SPAWN = mp.get_context("spawn")
INTERVAL_S = 0.005
LATENCY = ("p50", "p99")


def bulk_worker(path: str, kind: str, src_dev: int, dst_dev: int, nbytes: int, stop: Any, q: Any) -> None:
    """Bulk copies, two in flight, until ``stop``: ``kind`` h2d (host -> gpu ``dst_dev``), d2h
    (gpu ``src_dev`` -> host) or peer (gpu ``src_dev`` -> gpu ``dst_dev``). Reports (seconds, bytes) per copy."""
    with priod.SyncClient(path, copy_path="daemon", name=f"bulk-{kind}-{src_dev}-{dst_dev}") as c:
        host = c.alloc_host(nbytes) if kind != "peer" else None
        a = c.alloc_device(nbytes, src_dev) if kind != "h2d" else host
        b = c.alloc_device(nbytes, dst_dev) if kind != "d2h" else host
        assert a is not None and b is not None
        pending = [c.start_copy(b, a, priority="bulk") for _ in range(2)]
        done: list[tuple[float, int]] = []
        while pending:
            r = pending.pop(0).wait(timeout=60)
            done.append((time.perf_counter(), r.nbytes))
            if not stop.is_set():
                pending.append(c.start_copy(b, a, priority="bulk"))
        q.put(done)


class Bulk:
    """Bulk worker processes for the span of a ``with`` block; their rates over a window."""

    def __init__(self, path: str, specs: list[tuple[str, int, int]], nbytes: int) -> None:
        self.stop, self.q = SPAWN.Event(), SPAWN.Queue()
        self.procs = [
            SPAWN.Process(target=bulk_worker, args=(path, k, s, d, nbytes, self.stop, self.q), daemon=True)
            for k, s, d in specs
        ]
        self.results: list[list[tuple[float, int]]] = []

    def __enter__(self) -> Bulk:
        for p in self.procs:
            p.start()
        time.sleep(2.0)  # pinned, calibrated, flowing
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.results = [self.q.get(timeout=120) for _ in self.procs]
        for p in self.procs:
            p.join(30)

    def gbps(self, t0: float, t1: float) -> list[float]:
        return [sum(n for t, n in r if t0 < t <= t1) / (t1 - t0) / 1e9 for r in self.results]


def urgent_series(c: priod.SyncClient, dst: Any, src: Any, nbytes: int, count: int) -> list[float]:
    lat = []
    for i in range(5 + count):
        t0 = time.perf_counter()
        c.copy(dst, src, nbytes, priority="urgent")
        if i >= 5:
            lat.append((time.perf_counter() - t0) * 1e6)
        time.sleep(INTERVAL_S)
    return lat


def raw_rates(nbytes: int) -> dict[str, float]:
    """In-process: h2d on both GPUs at once, and cudaMemcpyPeerAsync gpu0 -> gpu1 (GB/s)."""
    import cupy as cp

    rt = cp.cuda.runtime
    out: dict[str, float] = {}
    hosts = [cp.cuda.alloc_pinned_memory(nbytes) for _ in range(2)]
    devs, streams = [], []
    for g in range(2):
        with cp.cuda.Device(g):
            devs.append(cp.empty(nbytes, dtype=cp.uint8))
            streams.append(cp.cuda.Stream(non_blocking=True))

    def h2d(g: int) -> None:
        with cp.cuda.Device(g):
            rt.memcpyAsync(devs[g].data.ptr, hosts[g].ptr, nbytes, rt.memcpyHostToDevice, streams[g].ptr)

    for g in range(2):
        h2d(g)
        streams[g].synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        for g in range(2):
            h2d(g)
    for g in range(2):
        streams[g].synchronize()
    out["h2d_both"] = 4 * 2 * nbytes / (time.perf_counter() - t0) / 1e9
    with cp.cuda.Device(0):
        rt.deviceEnablePeerAccess(1)  # as the daemon does: without it the copy is staged through the host
        s = cp.cuda.Stream(non_blocking=True)
        cp.cuda.runtime.memcpyPeerAsync(devs[1].data.ptr, 1, devs[0].data.ptr, 0, nbytes, s.ptr)
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            cp.cuda.runtime.memcpyPeerAsync(devs[1].data.ptr, 1, devs[0].data.ptr, 0, nbytes, s.ptr)
        s.synchronize()
        out["peer"] = 8 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": args.backend}
    if args.backend == "cuda":
        res["raw"] = raw_rates(args.bulk_mib * MiB)
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    if args.backend == "sim":
        env |= {
            "PRIOD_SIM__DEVICES": "2",
            "PRIOD_SIM__H2D_GBPS": "1",
            "PRIOD_SIM__D2H_GBPS": "1",
            "PRIOD_SIM__PEER_GBPS": "1",
        }
    nbytes = args.bulk_mib * MiB
    with (
        daemon_process(env, backend=args.backend, start_timeout=180) as d,
        priod.SyncClient(d.socket_path, copy_path="daemon", name="urgent", spin_us=2000) as c,
    ):
        st = c.status()
        res["lanes"] = {ln["lane"]: ln["bandwidth_gbps"] for ln in st["lanes"]}
        res["gpus"] = st["gpus"]
        host = c.alloc_host(16 * MiB)
        g0, g1 = c.alloc_device(16 * MiB, 0), c.alloc_device(16 * MiB, 1)
        back = c.alloc_host(16 * MiB)
        assert host.array is not None and back.array is not None
        host.array[:] = np.random.default_rng(1).integers(0, 256, 16 * MiB, dtype=np.uint8)
        # isolation: urgent h2d to gpu1, idle, under gpu0 bulk both ways, under gpu1's own bulk
        res["urgent_gpu1_idle"] = summarize(urgent_series(c, g1, host, 64 * KiB, args.count), LATENCY)
        with Bulk(d.socket_path, [("h2d", 0, 0), ("d2h", 0, 0)], nbytes):
            res["urgent_gpu1_under_gpu0_bulk"] = summarize(urgent_series(c, g1, host, 64 * KiB, args.count), LATENCY)
        with Bulk(d.socket_path, [("h2d", 1, 1)], nbytes):
            res["urgent_gpu1_under_gpu1_bulk"] = summarize(urgent_series(c, g1, host, 64 * KiB, args.count), LATENCY)
        # aggregate: h2d bulk on both GPUs at once
        with Bulk(d.socket_path, [("h2d", 0, 0), ("h2d", 1, 1)], nbytes) as b:
            t0 = time.perf_counter()
            time.sleep(args.seconds)
            t1 = time.perf_counter()
        res["bulk_h2d_both_gbps"] = b.gbps(t0, t1)
        # peer: bytes checked, idle urgent, bulk alone, urgent under peer bulk
        c.copy(g0, host, priority="normal")
        c.copy(g1, g0, priority="normal")
        c.copy(back, g1, priority="normal")
        res["peer_bytes_ok"] = bool(np.array_equal(back.array, host.array))
        res["urgent_peer_1mib_idle"] = summarize(urgent_series(c, g1, g0, MiB, args.count), LATENCY)
        with Bulk(d.socket_path, [("peer", 0, 1)], nbytes) as b:
            t0 = time.perf_counter()
            res["urgent_peer_1mib_under_peer_bulk"] = summarize(urgent_series(c, g1, g0, MiB, args.count), LATENCY)
            t1 = time.perf_counter()
            time.sleep(args.seconds)
            t2 = time.perf_counter()
        res["peer_bulk_under_urgent_gbps"] = b.gbps(t0, t1)[0]
        res["peer_bulk_alone_gbps"] = b.gbps(t1, t2)[0]
        back.array[:] = 0
        c.copy(back, g1, priority="normal")
        res["peer_bytes_ok_after_bulk"] = bool(np.array_equal(back.array, host.array))
    return res


def render(r: dict[str, Any]) -> str:
    lines = [
        f"two GPUs, {r['backend']} engine, {r['date']}; lanes (calibrated GB/s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["lanes"].items())
    ]
    for key in (
        "urgent_gpu1_idle",
        "urgent_gpu1_under_gpu0_bulk",
        "urgent_gpu1_under_gpu1_bulk",
        "urgent_peer_1mib_idle",
        "urgent_peer_1mib_under_peer_bulk",
    ):
        lines.append(f"{key:<36} p50 {r[key]['p50']:8.1f} us   p99 {r[key]['p99']:8.1f} us")
    raw = r.get("raw", {})
    both = sum(r["bulk_h2d_both_gbps"])
    versus = (
        f" (raw in-process both at once {raw['h2d_both']:.1f}: x {both / raw['h2d_both']:.3f}; target 0.95)"
        if raw
        else ""
    )
    lines.append(f"bulk h2d on both GPUs through priod: {both:.1f} GB/s{versus}")
    lines.append(
        f"peer bulk through priod: alone {r['peer_bulk_alone_gbps']:.1f} GB/s, under urgent {r['peer_bulk_under_urgent_gbps']:.1f}"
        + (
            f" (raw cudaMemcpyPeerAsync {raw['peer']:.1f}: x {r['peer_bulk_alone_gbps'] / raw['peer']:.3f}; target 0.9)"
            if raw
            else ""
        )
    )
    idle99, load99 = r["urgent_peer_1mib_idle"]["p99"], r["urgent_peer_1mib_under_peer_bulk"]["p99"]
    lines.append(
        f"urgent peer 1 MiB under peer bulk p99 {load99:.0f} us against 2 x idle + 100 = {2 * idle99 + 100:.0f}: {'met' if load99 <= 2 * idle99 + 100 else 'NOT met'}"
    )
    lines.append(f"peer bytes checked: {r['peer_bytes_ok']} (before bulk), {r['peer_bytes_ok_after_bulk']} (after)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--count", type=int, default=60)
    ap.add_argument("--bulk-mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default="out/multi")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = run(args)
    table = render(res)
    res["table"] = table
    with open(os.path.join(args.out, "results.json"), "w") as fp:
        json.dump(res, fp, indent=1)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
