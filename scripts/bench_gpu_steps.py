#!/usr/bin/env python3
"""Where an urgent copy through the daemon spends its time on a GPU host, step by step, beside
the floors of the steps that are not priod's (docs/design.md, "The copy ring").

    python scripts/bench_gpu_steps.py --out out/steps          # about 1 minute per daemon setting

A blocking client (`SyncClient`, the daemon path) makes an urgent 64 KiB host-to-device copy
once every 5 ms, asleep between copies, through an idle daemon and then beside a bulk client's
2 GiB copies. Every step is timed on CLOCK_MONOTONIC, which the daemon and the client share
(``time.perf_counter``): the client's timestamps come from wrapping two of its ring's methods
(the doorbell, and the reply made from the landed word), the daemon's from the figures it
stamps for the landed word (when the copy was taken, when its first chunk was submitted).

    client          copy() called -> descriptor published, doorbell written
    wake-up         doorbell written -> the daemon has taken the descriptor and checked it
    scheduler       taken -> its first chunk handed to the engine
    GPU and word    handed to the engine -> the client sees its landed word (the engine's calls,
                    the copy, the store of the word, the client's next look)
    reply           landed word seen -> copy() returns

Beside the steps, the daemon's CPU over each row's copies (the bulk rows: with the bulk
client's copies too). The floors, measured in the same run: a bare wake-up of a process blocked on an eventfd, 5 ms
after its last one; and the same copy made in one process after 5 ms asleep, its landed word
stored and spun for the same way (`cudaMemcpyAsync` and `cuStreamWriteValue64` on a stream).
Each ``--set`` item (``--set tuning__beat_spin_us=0``) runs its own daemon; rows say which.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod
from priod.client.copy_ring import ClientRing
from priod.testing import daemon_process, percentile, process_cpu_seconds, settings_env

KiB, GiB = 1 << 10, 1 << 30
SIZE = 64 * KiB
GAP_S = 0.005
STEPS = ("client", "wake-up", "scheduler", "GPU and word", "reply", "whole")


def urgent_steps(path: str, count: int) -> list[dict[str, float]]:
    """``count`` urgent copies, each timed step by step (the module's docstring)."""
    marks: dict[str, float] = {}
    ring_bell, landed_reply = ClientRing.ring, ClientRing.landed_reply

    def bell(self: ClientRing) -> None:
        marks["bell"] = time.perf_counter()
        ring_bell(self)

    def reply(self: ClientRing, seq: int, req_id: int, req: Any) -> dict[str, object] | None:
        marks["seen"] = time.perf_counter()
        return landed_reply(self, seq, req_id, req)

    ClientRing.ring, ClientRing.landed_reply = bell, reply  # type: ignore[method-assign]
    try:
        return _timed_copies(path, count, marks)
    finally:
        ClientRing.ring, ClientRing.landed_reply = ring_bell, landed_reply  # type: ignore[method-assign]


def _timed_copies(path: str, count: int, marks: dict[str, float]) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    with priod.SyncClient(path, copy_path="daemon", name="steps") as c:
        h, d = c.alloc_host(SIZE), c.alloc_device(SIZE)
        for i in range(count + 10):  # the first ten warm the path up
            time.sleep(GAP_S)
            marks.clear()
            t0 = time.perf_counter()
            r = c.copy(d, h, SIZE, priority="urgent")
            t_end = time.perf_counter()
            if i < 10 or "seen" not in marks or "bell" not in marks:
                continue  # answered from a completion, not its landed word: no daemon stamps
            first = marks["seen"] - r.transfer_us / 1e6  # the daemon's first submission
            taken = first - r.queued_us / 1e6
            out.append(
                {
                    "client": marks["bell"] - t0,
                    "wake-up": taken - marks["bell"],
                    "scheduler": first - taken,
                    "GPU and word": marks["seen"] - first,
                    "reply": t_end - marks["seen"],
                    "whole": t_end - t0,
                }
            )
    return [{k: v * 1e6 for k, v in row.items()} for row in out]


def bulk_loop(path: str, stop: Any) -> None:
    with priod.SyncClient(path, copy_path="daemon", name="bulk") as c:
        h, d = c.alloc_host(2 * GiB), c.alloc_device(2 * GiB)
        while not stop.is_set():
            c.copy(d, h, priority="bulk")


def wake_floor(count: int) -> list[float]:
    """A process blocked on an eventfd, written 5 ms after its last wake-up: us to wake."""
    bell = os.eventfd(0)
    shared = mmap.mmap(-1, 8 * (count + 1))
    stamps = np.frombuffer(shared, dtype=np.float64)
    pid = os.fork()
    if pid == 0:
        for i in range(count):
            os.eventfd_read(bell)
            stamps[i] = time.perf_counter() - stamps[i]
        os._exit(0)
    for i in range(count):
        time.sleep(GAP_S)
        stamps[i] = time.perf_counter()
        os.eventfd_write(bell, 1)
        while stamps[i] > 1.0:  # the child writes the difference back
            time.sleep(0.0005)
    os.waitpid(pid, 0)
    return [float(x) * 1e6 for x in stamps[:count]]


def copy_floor(count: int, q: Any) -> None:
    """The same copy in one process after 5 ms asleep: issue, and issue to its landed word seen."""
    import cupy as cp
    from cuda.bindings import driver

    src = cp.cuda.alloc_pinned_memory(SIZE)
    word = cp.cuda.alloc_pinned_memory(8)
    seen = np.frombuffer(word, dtype=np.uint64, count=1)
    dst = cp.empty(SIZE, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True, priority=-5)
    rows = []
    for i in range(1, count + 11):
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.ptr, SIZE, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        (err,) = driver.cuStreamWriteValue64(stream.ptr, word.ptr, i, 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        t1 = time.perf_counter()
        while int(seen[0]) != i:
            pass
        t2 = time.perf_counter()
        if i > 10:
            rows.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t2 - t0) * 1e6))
    stream.synchronize()
    q.put(rows)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} / {percentile(values, 99):7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench_gpu_steps")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--backend", default="cuda", help="cuda, or sim (the steps without a GPU; no copy floor)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="a daemon setting; each one given runs a daemon of its own beside the defaults' (e.g. tuning__beat_spin_us=0)",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    spawn = mp.get_context("spawn")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "rows": {}}
    lines = [f"{'row':44} {'step':13} {'p50 / p99 us':>17}"]

    def put(row: str, step: str, values: list[float]) -> None:
        results["rows"].setdefault(row, {})[step] = values
        lines.append(f"{row:44} {step:13} {summary(values)}")

    put("floor: bare wake-up", "wake-up", wake_floor(args.count))
    if args.backend == "cuda":
        q = spawn.Queue()
        p = spawn.Process(target=copy_floor, args=(args.count, q))
        p.start()
        rows = q.get(timeout=120)
        p.join()
        put("floor: in-process copy and word", "issue", [r[0] for r in rows])
        put("floor: in-process copy and word", "GPU and word", [r[1] for r in rows])
        put("floor: in-process copy and word", "whole", [r[2] for r in rows])
    for setting in ["", *args.set]:
        env = settings_env([setting]) if setting else {}
        with daemon_process(env, backend=args.backend, start_timeout=120) as dmn:
            for load in ("idle", "bulk"):
                stop = spawn.Event()
                bulk = None
                if load == "bulk":
                    bulk = spawn.Process(target=bulk_loop, args=(dmn.socket_path, stop))
                    bulk.start()
                    time.sleep(3.0)  # the bulk copies under way, their pinned memory warm
                cpu0, t0 = process_cpu_seconds(dmn.proc.pid), time.perf_counter()
                steps = urgent_steps(dmn.socket_path, args.count)
                cpu_s_per_s = (process_cpu_seconds(dmn.proc.pid) - cpu0) / (time.perf_counter() - t0)
                if bulk is not None:
                    stop.set()
                    bulk.join(120)
                row = f"priod {load}{', ' + setting if setting else ''}"
                for step in STEPS:
                    put(row, step, [s[step] for s in steps])
                results["rows"][row]["daemon_cpu_s_per_s"] = cpu_s_per_s
                lines.append(f"{row:44} {'daemon CPU':13} {cpu_s_per_s:9.3f} s/s")
    with open(os.path.join(args.out, "results.json"), "w") as fp:
        json.dump(results, fp)
    table = "\n".join(lines)
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
