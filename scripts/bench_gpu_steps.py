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

``--by-function`` adds a row that splits the idle daemon's part finer, from the stamps of a
daemon this script starts with its hot-path functions wrapped (each stamp costs about a
microsecond, so the row's whole is a little longer than the others'):

    doorbell -> read          the loop reads the doorbell (`CopyRing._rung`)
    read -> checks            to the copy's checks (`take_copy`): the turn's accounting, the
                              descriptor decoded
    checks -> queued          regions, bounds and limits checked, the request queued
    queued -> to the pump     the turn ends, the scheduler hands the chunk out (`Pump._submit`)
    to the pump -> engine     the chunk's job and landed word made, the lane's gate shut
    engine -> copy issued     the engine's checks and its copy call (`cudaMemcpyAsync`)
    copy issued -> word queued  the landed word's store (`cuStreamWriteValue64`)
    word queued -> seen       the GPU's copy and store, the client's next look
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod
from priod.client.copy_ring import ClientRing
from priod.testing import daemon_process, percentile, process_cpu_seconds, settings_env, wait_for_socket

KiB, GiB = 1 << 10, 1 << 30
SIZE = 64 * KiB
GAP_S = 0.005
STEPS = ("client", "wake-up", "scheduler", "GPU and word", "reply", "whole")


@contextmanager
def client_marks() -> Iterator[dict[str, float]]:
    """Marks the client's ring leaves while the block runs: ``bell`` when it rings the doorbell,
    ``seen`` when it makes a reply from a landed word (cleared by the caller per copy)."""
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
        yield marks
    finally:
        ClientRing.ring, ClientRing.landed_reply = ring_bell, landed_reply  # type: ignore[method-assign]


def urgent_steps(path: str, count: int, gap_s: float = GAP_S) -> list[dict[str, float]]:
    """``count`` urgent copies, each timed step by step (the module's docstring)."""
    with client_marks() as marks:
        return _timed_copies(path, count, marks, gap_s)


def _timed_copies(path: str, count: int, marks: dict[str, float], gap_s: float) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    with priod.SyncClient(path, copy_path="daemon", name="steps") as c:
        h, d = c.alloc_host(SIZE), c.alloc_device(SIZE)
        for i in range(count + 10):  # the first ten warm the path up
            time.sleep(gap_s)
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


HOOKED = (
    ("priod.daemon.rings", "CopyRing", "_rung", "read", None),
    ("priod.daemon.session", None, "take_copy", "checks", "queued"),
    ("priod.daemon.pump", "Pump", "_submit", "to the pump", None),
    ("priod.daemon.engines.cuda.engine", "CudaEngine", "submit_range", "engine", None),
    ("priod.daemon.engines.cuda.engine", "CudaEngine", "_store_landed", "copy issued", "word queued"),
    ("priod.daemon.engines.sim", "SimEngine", "submit_range", "engine", None),
)
"""(module, class or None, function, the stamp at its entry, the stamp at its return or None)."""
FINE = ("doorbell", "read", "checks", "queued", "to the pump", "engine", "copy issued", "word queued", "seen")


def hooked_daemon(stamps_path: str, argv: list[str]) -> int:
    """Run ``priod`` (``argv``) with `HOOKED` stamping CLOCK_MONOTONIC into a list, written to
    ``stamps_path`` as JSON when the daemon exits."""
    import atexit
    import importlib

    stamps: list[tuple[str, float]] = []
    clock = time.perf_counter

    def wrap(owner: Any, name: str, enter: str, leave: str | None) -> None:
        inner = getattr(owner, name)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            stamps.append((enter, clock()))
            try:
                return inner(*args, **kwargs)
            finally:
                if leave is not None:
                    stamps.append((leave, clock()))

        setattr(owner, name, stamped)

    for module, cls, name, enter, leave in HOOKED:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # no CUDA here: the sim's functions only
        if not (mod.__file__ or "").endswith(".py"):
            # Compiled code calls its functions directly: a wrapper set here would never run.
            raise SystemExit(f"--by-function stamps the pure-Python build; {module} is compiled (PRIOD_COMPILE=1)")
        wrap(getattr(mod, cls) if cls else mod, name, enter, leave)

    def dump() -> None:
        with open(stamps_path, "w") as fp:
            json.dump(stamps, fp)

    atexit.register(dump)
    from priod.cli import main as priod_main

    return priod_main(argv)


def by_function(path_dir: str, backend: str, count: int, gap_s: float = GAP_S) -> dict[str, list[float]]:
    """The idle row again, through a daemon started by `hooked_daemon`: us per `FINE` stage."""
    import signal
    import subprocess

    sock, stamps_path = os.path.join(path_dir, "hooked.sock"), os.path.join(path_dir, "stamps.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--hooked-daemon", stamps_path]
    proc = subprocess.Popen([*cmd, "serve", "--socket", sock, "--backend", backend], stdout=subprocess.DEVNULL)
    copies: list[tuple[float, float]] = []
    try:
        wait_for_socket(sock, 120, proc)
        with client_marks() as marks, priod.SyncClient(sock, copy_path="daemon", name="steps") as c:
            h, d = c.alloc_host(SIZE), c.alloc_device(SIZE)
            for i in range(count + 10):
                time.sleep(gap_s)
                marks.clear()
                c.copy(d, h, SIZE, priority="urgent")
                if i >= 10 and "seen" in marks:
                    copies.append((marks["bell"], marks["seen"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    with open(stamps_path) as fp:
        stamps = sorted((t, n) for n, t in json.load(fp))
    out: dict[str, list[float]] = {}
    for doorbell, seen in copies:
        at = {"doorbell": doorbell, "seen": seen}
        for t, n in stamps:
            if doorbell <= t <= seen:
                at.setdefault(n, t)  # the first of each: the copy's own
        got = [stage for stage in FINE if stage in at]
        for a, b in itertools.pairwise(got):
            out.setdefault(f"{a} -> {b}", []).append((at[b] - at[a]) * 1e6)
    return out


def bulk_loop(path: str, stop: Any) -> None:
    with priod.SyncClient(path, copy_path="daemon", name="bulk") as c:
        h, d = c.alloc_host(2 * GiB), c.alloc_device(2 * GiB)
        while not stop.is_set():
            c.copy(d, h, priority="bulk")


def wake_floor(count: int, gap_s: float = GAP_S) -> list[float]:
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
        time.sleep(gap_s)
        stamps[i] = time.perf_counter()
        os.eventfd_write(bell, 1)
        while stamps[i] > 1.0:  # the child writes the difference back
            time.sleep(0.0005)
    os.waitpid(pid, 0)
    return [float(x) * 1e6 for x in stamps[:count]]


def copy_floor(count: int, q: Any, gap_s: float = GAP_S) -> None:
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
        time.sleep(gap_s)
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
    ap.add_argument("--by-function", action="store_true", help="add the idle daemon's part split by function")
    ap.add_argument(
        "--gap-us", type=float, default=GAP_S * 1e6, help="us between urgent copies, the client asleep (5000)"
    )
    if len(sys.argv) > 2 and sys.argv[1] == "--hooked-daemon":
        return hooked_daemon(sys.argv[2], sys.argv[3:])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    spawn = mp.get_context("spawn")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "rows": {}}
    lines = [f"{'row':44} {'step':24} {'p50 / p99 us':>17}"]

    def put(row: str, step: str, values: list[float]) -> None:
        results["rows"].setdefault(row, {})[step] = values
        lines.append(f"{row:44} {step:24} {summary(values)}")

    gap_s = args.gap_us / 1e6
    every = "" if args.gap_us == GAP_S * 1e6 else f", every {args.gap_us:g} us"
    put(f"floor: bare wake-up{every}", "wake-up", wake_floor(args.count, gap_s))
    if args.backend == "cuda":
        q = spawn.Queue()
        p = spawn.Process(target=copy_floor, args=(args.count, q, gap_s))
        p.start()
        rows = q.get(timeout=120)
        p.join()
        for i, step in enumerate(("issue", "GPU and word", "whole")):
            put(f"floor: in-process copy and word{every}", step, [r[i] for r in rows])
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
                steps = urgent_steps(dmn.socket_path, args.count, gap_s)
                cpu_s_per_s = (process_cpu_seconds(dmn.proc.pid) - cpu0) / (time.perf_counter() - t0)
                if bulk is not None:
                    stop.set()
                    bulk.join(120)
                row = f"priod {load}{', ' + setting if setting else ''}{every}"
                for step in STEPS:
                    put(row, step, [s[step] for s in steps])
                results["rows"][row]["daemon_cpu_s_per_s"] = cpu_s_per_s
                lines.append(f"{row:44} {'daemon CPU':24} {cpu_s_per_s:9.3f} s/s")
    if args.by_function:
        for stage, values in by_function(args.out, args.backend, args.count, gap_s).items():
            if len(values) >= args.count // 2:  # stages every copy went through
                put(f"priod idle, by function{every}", stage, values)
    with open(os.path.join(args.out, "results.json"), "w") as fp:
        json.dump(results, fp)
    table = "\n".join(lines)
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
