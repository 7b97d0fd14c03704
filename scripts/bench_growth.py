#!/usr/bin/env python3
"""Growth benchmark: urgent p99 and the daemon's CPU per copy as client processes multiply.

The target: "urgent p99 and daemon CPU per copy with 1, 8 and 64 client
processes (half bulk, half urgent); the 64-client p99 within 1.5x of the 1-client figure."

For each N in ``--clients`` (default 1,8,64) a fresh daemon (``python -m priod serve``, child
process) serves N client processes, all started together:

- N/2 bulk processes: an asyncio client keeping 2 bulk h2d copies of ``--bulk-bytes``
  outstanding (256 MiB on cuda, 16 MiB on sim) from the start to the end;
- N/2 urgent processes: a blocking `SyncClient` sends one urgent h2d copy of ``--size``
  (64 KiB), sleeps ``--interval-ms`` (5), and so on: ``--warm`` unmeasured copies, then
  ``--count`` measured ones (200 on cuda, 100 on sim). They start ``--lead-s`` after the bulk
  (3 s cuda, 2 s sim). On cuda the client spins 2 ms for each reply (``--spin-us``), as a
  latency-critical caller would and as bench_gpu.py's urgent client does; on sim it does not
  by default: on a 2-core machine a spinning client takes the core the sim engine's copies
  and the daemon need (64 KiB p50 2.3 ms spinning against 0.4 ms not, at N=1 here).

N = 1 cannot be halved: it means 1 urgent + 1 bulk process (the reference every other N is
compared with). An odd N > 1 gets one urgent process more than bulk ones.

Figures per N:
- urgent latency, client-observed, all urgent processes' measured copies pooled: p50, p99, max,
  and p99 / p99(N=1) (the target: <= 1.5 at N=64);
- the daemon's CPU (all threads, schedstat's nanoseconds where readable) in CPU s/s over the
  urgent window (first urgent copy to the last urgent process's result) and over the second of
  bulk alone just before it; its CPU microseconds per urgent copy: CPU over the window / urgent
  copies in it (warm-up and read-back copies included), and the same beyond bulk (less the
  bulk-alone rate times the window);
- bulk GB/s over the urgent window, from the daemon's per-lane byte counts (less the urgent bytes).

Every copy's bytes are checked: each urgent copy carries a new pattern, and after its last one
each urgent process reads the device region back (d2h into a second host region) and compares;
each bulk process does the same with its bulk region once the load stops (and once before it
starts). A mismatch fails the run.

All clients run as one uid, so the daemon's per-uid caps are set for the benchmark (printed, and
written to the JSON): the request-rate cap is off, the per-uid connection cap and max_clients
allow N + 1 connections, and the per-uid urgent budget is the lane's whole bandwidth
(``--shipped-budget`` keeps the shipped budget: 32 urgent processes of one uid overrun it, each
copy being charged at least a short-bound chunk of the lane, and their copies past it are
served as "high", which measures the policy, not the growth).

    .venv/bin/python scripts/bench_growth.py --backend sim --clients 1,8 --out /tmp/g     # here (2 cores): about 10 s
    .venv/bin/python scripts/bench_growth.py --backend sim --clients 1,8,16                 # a quick look on a small machine
    python3 scripts/bench_growth.py --backend cuda --out $OUT/growth                       # GPU host, 1/8/64 clients, ~2-4 minutes

(On sim the defaults, 1,8,64, run too: about 25 s on 2 cores, where 64 client processes and the
daemon share two cores and the latencies say so.)

Full numbers go to ``<out>/growth.json`` (after every N) and the table to ``<out>/table.txt``;
the table is printed last. Exit status 1 if any copy's bytes were wrong or a copy failed.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

# Runnable from a checkout without `pip install -e .`: the daemon (python -m priod) and the
# spawned clients find the same priod as this script.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

import priod
from priod.testing import (
    DaemonProcess,
    machine,
    process_cpu_seconds,
    settings_env,
    summarize,
    wait_for_socket,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SPAWN = mp.get_context("spawn")
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent dies (no orphan daemons or clients)."""
TARGET_RATIO = 1.5
"""The target: urgent p99 at N=64 within this factor of the N=1 figure."""
LAT_KEYS = ("n", "p50", "p90", "p99", "p99.9", "max", "mean")


def log(msg: str) -> None:
    print(f"[growth {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; nothing elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def parse_size(text: str) -> int:
    """``65536``, ``64K``, ``64KiB``, ``16M``, ``1G`` -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        n = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (write e.g. 65536, 64K, 16M, 1G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be > 0")
    return n


def human(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def split(n: int) -> tuple[int, int]:
    """(urgent, bulk) processes for N clients: half each; N = 1 is 1 urgent + 1 bulk."""
    if n == 1:
        return 1, 1
    return n - n // 2, n // 2


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- byte patterns -------------------------------------------------------------------------------
def fill_bulk(arr: npt.NDArray[np.uint8], seed: int) -> None:
    """A pattern that differs at every 8-byte word and per process (a shifted or partial copy shows)."""
    words = arr[: len(arr) // 8 * 8].view(np.uint64)
    np.multiply(np.arange(len(words), dtype=np.uint64), np.uint64(0x9E3779B97F4A7C15), out=words)
    words ^= np.uint64(seed * 0x1000193 + 1)
    arr[len(words) * 8 :] = seed & 0xFF


def urgent_base(size: int, seed: int) -> npt.NDArray[np.uint8]:
    """An urgent process's pattern; copy i carries it plus (i % 251 + 1), so consecutive copies differ."""
    return ((np.arange(size, dtype=np.uint64) * 31 + seed * 17) % 256).astype(np.uint8)


# -- the client processes -------------------------------------------------------------------------
def child_setup(parent: int) -> None:
    """In a spawned client: die with the benchmark, leave Ctrl-C to it (it kills what is left)."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def bulk_child(cfg: dict[str, Any], index: int, go: Any, stop: Any, q: Any) -> None:
    """A bulk client: says ready once its regions are pinned, warmed and checked; on ``go`` keeps
    ``pipeline`` bulk h2d copies outstanding until ``stop``; then reads its device region back and
    compares it with the source."""
    child_setup(cfg["parent"])
    try:
        q.put(("result", "bulk", index, run_async(bulk_load(cfg, index, go, stop, q))))
    except BaseException:
        q.put(("error", "bulk", index, traceback.format_exc()))


async def bulk_load(cfg: dict[str, Any], index: int, go: Any, stop: Any, q: Any) -> dict[str, Any]:
    n, pipeline = cfg["bulk_bytes"], cfg["pipeline"]
    c = await priod.connect(cfg["socket"], copy_path="daemon", name=f"growth-bulk{index}")
    try:
        src, chk, dev = await c.alloc_host(n), await c.alloc_host(n), await c.alloc_device(n)
        assert src.array is not None and chk.array is not None
        fill_bulk(src.array, index)
        # the first pass over fresh pinned pages is slow: outside the figures; and a first check
        await c.copy(dev, src, n, priority="bulk")
        await c.copy(chk, dev, n, priority="bulk")
        if not np.array_equal(chk.array, src.array):
            raise AssertionError(f"bulk client {index}: the warm-up copy's bytes differ at the destination")
        q.put(("ready", "bulk", index, None))
        if not go.wait(cfg["ready_timeout_s"]):
            return {"copies": 0, "errors": ["never told to go"], "verified": False}
        errors: list[str] = []
        copies = 0
        pending = [c.start_copy(dev, src, n, priority="bulk") for _ in range(pipeline)]
        while pending:
            handle = pending.pop(0)
            try:
                await handle
                copies += 1
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            if not stop.is_set():
                pending.append(c.start_copy(dev, src, n, priority="bulk"))
        chk.array[:] = 0
        await c.copy(chk, dev, n, priority="bulk")
        verified = bool(np.array_equal(chk.array, src.array))
        return {"copies": copies, "errors": errors, "verified": verified}
    finally:
        await c.close()


def urgent_child(cfg: dict[str, Any], index: int, go: Any, start_at: Any, q: Any) -> None:
    """An urgent client: one urgent h2d copy, then ``interval_s`` asleep, from ``start_at`` on;
    ``warm`` unmeasured copies, then ``count`` measured. Its last copy is read back and checked."""
    child_setup(cfg["parent"])
    try:
        q.put(("result", "urgent", index, urgent_series(cfg, index, go, start_at, q)))
    except BaseException:
        q.put(("error", "urgent", index, traceback.format_exc()))


def ready_then_start(cfg: dict[str, Any], index: int, go: Any, start_at: Any, q: Any) -> None:
    """Tell the parent this urgent client is ready, wait to be told to go, then for the shared start time."""
    q.put(("ready", "urgent", index, None))
    if not go.wait(cfg["ready_timeout_s"]):
        raise RuntimeError("never told to go")
    delay = start_at.value - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def direct_series(cfg: dict[str, Any], index: int, go: Any, start_at: Any, q: Any) -> dict[str, Any]:
    """`urgent_series` with direct copies (`priod.client.direct`): this process's own DMA between its
    own CuPy buffers, each copy announced on its hold page; read back and checked the same way."""
    import cupy as cp

    from priod.client.direct import DirectCopies

    size, warm, count, interval_s = cfg["size"], cfg["warm"], cfg["count"], cfg["interval_s"]
    with priod.SyncClient(cfg["socket"], copy_path="daemon", name=f"growth-direct{index}") as c:
        direct = DirectCopies(c.hold_page())
        pinned, pinned_chk = cp.cuda.alloc_pinned_memory(size), cp.cuda.alloc_pinned_memory(size)
        src = np.frombuffer(pinned, dtype=np.uint8, count=size)
        chk = np.frombuffer(pinned_chk, dtype=np.uint8, count=size)
        dev = cp.empty(size, dtype=cp.uint8)
        base = urgent_base(size, index)
        np.add(base, np.uint8(0), out=src)
        direct.copy(dev, src)
        direct.copy(chk, dev)
        if not np.array_equal(chk, src):
            raise AssertionError(f"direct client {index}: the warm-up copy's bytes differ at the destination")
        h2d = direct.pair(dev, src)  # resolved once, as a KV cache would
        ready_then_start(cfg, index, go, start_at, q)
        lat: list[float] = []
        t_first = time.monotonic()
        for i in range(warm + count):
            np.add(base, np.uint8(i % 251 + 1), out=src)
            t0 = time.perf_counter()
            h2d.copy()
            us = (time.perf_counter() - t0) * 1e6
            if i >= warm:
                lat.append(us)
            time.sleep(interval_s)
        t_last = time.monotonic()
        chk[:] = 0
        direct.copy(chk, dev)
        verified = bool(np.array_equal(chk, src))
        direct.close()
    return {
        "latency_us": lat,
        "daemon_total_us": [],
        "paths": {"direct": len(lat)},
        "t_first": t_first,
        "t_last": t_last,
        "verified": verified,
    }


def urgent_series(cfg: dict[str, Any], index: int, go: Any, start_at: Any, q: Any) -> dict[str, Any]:
    if cfg.get("direct"):
        return direct_series(cfg, index, go, start_at, q)
    size, warm, count, interval_s = cfg["size"], cfg["warm"], cfg["count"], cfg["interval_s"]
    with priod.SyncClient(cfg["socket"], copy_path="daemon", name=f"growth-urgent{index}", spin_us=cfg["spin_us"]) as c:
        src, chk, dev = c.alloc_host(size), c.alloc_host(size), c.alloc_device(size)
        assert src.array is not None and chk.array is not None
        base = urgent_base(size, index)
        np.add(base, np.uint8(0), out=src.array)
        c.copy(dev, src, size, priority="urgent")  # first touch of the regions, and a first check
        c.copy(chk, dev, size, priority="urgent")
        if not np.array_equal(chk.array, src.array):
            raise AssertionError(f"urgent client {index}: the warm-up copy's bytes differ at the destination")
        ready_then_start(cfg, index, go, start_at, q)
        lat: list[float] = []
        daemon_total: list[float] = []
        paths: dict[str, int] = {}
        t_first = time.monotonic()
        for i in range(warm + count):
            np.add(base, np.uint8(i % 251 + 1), out=src.array)
            t0 = time.perf_counter()
            r = c.copy(dev, src, size, priority="urgent")
            us = (time.perf_counter() - t0) * 1e6
            if i >= warm:
                lat.append(us)
                daemon_total.append(r.total_us)
                paths[r.path] = paths.get(r.path, 0) + 1
            time.sleep(interval_s)
        t_last = time.monotonic()
        chk.array[:] = 0
        c.copy(chk, dev, size, priority="urgent")
        verified = bool(np.array_equal(chk.array, src.array))
    return {
        "latency_us": lat,
        "daemon_total_us": daemon_total,
        "paths": paths,
        "t_first": t_first,
        "t_last": t_last,
        "verified": verified,
    }


# -- the daemon ----------------------------------------------------------------------------------
def _daemon_preexec() -> None:
    die_with_parent()


@contextmanager
def start_daemon(env: dict[str, str], backend: str, timeout: float) -> Iterator[DaemonProcess]:
    """``priod serve`` on a private socket (as `priod.testing.daemon_process`, which it mirrors),
    told to exit with the benchmark should the benchmark die; stopped (SIGTERM) on the way out,
    its directory removed unless something failed (then its log is kept, and named)."""
    tmp = tempfile.mkdtemp(prefix="priod-growth-")
    path = os.path.join(tmp, "priod.sock")
    log_path = os.path.join(tmp, "daemon.log")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIOD_")}
    full_env.update(env)
    cmd = [sys.executable, "-m", "priod", "serve", "--socket", path, "--backend", backend]
    with open(log_path, "wb") as logf:
        # a session of its own: a Ctrl-C at the terminal reaches this script, which stops the daemon last
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env, preexec_fn=_daemon_preexec, start_new_session=True
        )
    d = DaemonProcess(proc, path, log_path)
    try:
        wait_for_socket(path, timeout, proc)
        yield d
    except BaseException:
        d.stop()
        log(f"the daemon's log is kept: {log_path}")
        raise
    d.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def daemon_env(args: argparse.Namespace, n_procs: int) -> dict[str, str]:
    """The daemon's settings for one N (``PRIOD_SECTION__KEY`` variables, TOML values)."""
    env = {
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_SERVICE__SHUTDOWN": '"cancel"',
        # one uid runs every client: its request rate is N clients' together, and it holds N + 1 connections
        "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0",
        "PRIOD_LIMITS__MAX_CONNECTIONS_PER_UID": str(max(64, n_procs + 8)),
        "PRIOD_SERVER__MAX_CLIENTS": str(max(256, n_procs + 16)),
    }
    if not args.shipped_budget:
        # the urgent budget is per uid and lane: N/2 urgent processes of one uid would share one
        # bucket (each copy charged at least a short-bound chunk); give it the lane's whole bandwidth
        env.update(
            {
                "PRIOD_SCHEDULER__URGENT_BUDGET_SHARE": "1.0",
                "PRIOD_SCHEDULER__URGENT_BUDGET_BYTES_PER_S": str(1 << 50),
                "PRIOD_TUNING__URGENT_INFLIGHT_BYTES": str(16 * GiB),
            }
        )
    env.update(args.env)
    return env


# -- one N ---------------------------------------------------------------------------------------
def collect(
    q: Any, procs: list[BaseProcess], daemon: DaemonProcess, what: str, count: int, timeout: float, client: str = ""
) -> list[tuple[str, int, Any]]:
    """The next ``count`` messages of kind ``what`` (ready or result) from the clients (of kind
    ``client``, bulk or urgent, if given): (client, index, payload).

    An error as soon as a client reports one, a client dies, or the daemon exits.
    """
    got: list[tuple[str, int, Any]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            bad = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
            if bad:
                raise RuntimeError(f"client processes died before saying {what}: {bad}") from None
            if daemon.proc.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited ({daemon.proc.returncode}); its log ends:\n{daemon.log()[-3000:]}"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{count - len(got)} of {count} clients did not say {what} in {timeout:.0f} s"
                ) from None
            continue
        kind, who, index, payload = msg
        if kind == "error":
            raise RuntimeError(f"{who} client {index} failed:\n{payload}")
        if kind != what or (client and who != client):
            raise RuntimeError(
                f"{who} client {index} said {kind} while waiting for {client or 'every'} client to say {what}"
            )
        got.append((who, index, payload))
    return got


def h2d_lane(lane_bytes: dict[str, int]) -> str:
    """The first GPU's h2d lane (every region here is on the daemon's device 0)."""
    if "gpu0/h2d" in lane_bytes:
        return "gpu0/h2d"
    return next(k for k in sorted(lane_bytes) if k.endswith("/h2d"))


def sample(sc: priod.SyncClient, pid: int) -> dict[str, Any]:
    """When (monotonic), the daemon's CPU seconds then, and its status counters just after."""
    t, cpu = time.monotonic(), process_cpu_seconds(pid)
    st = sc.status()
    return {
        "t": t,
        "cpu": cpu,
        "lane_bytes": st["lane_bytes"],
        "polls": st.get("polls", 0),
        "finished": st.get("finished", {}),
    }


def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def run_point(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One daemon, N clients (`split`): bulk alone for ``lead_s``, then the urgent series under it."""
    n_urgent, n_bulk = split(n)
    n_procs = n_urgent + n_bulk
    env = daemon_env(args, n_procs)
    log(f"N={n}: {n_urgent} urgent + {n_bulk} bulk processes; starting the daemon ({args.backend})")
    cfg: dict[str, Any] = {
        "parent": os.getpid(),
        "bulk_bytes": args.bulk_bytes,
        "pipeline": args.pipeline,
        "size": args.size,
        "warm": args.warm,
        "count": args.count,
        "interval_s": args.interval_ms / 1e3,
        "spin_us": args.spin_us,
        "direct": args.direct,
        "ready_timeout_s": args.ready_timeout_s,
    }
    procs: list[BaseProcess] = []
    with start_daemon(env, args.backend, args.start_timeout_s) as d:
        pid = d.proc.pid
        cfg["socket"] = d.socket_path
        go, stop, start_at, q = SPAWN.Event(), SPAWN.Event(), SPAWN.Value("d", 0.0), SPAWN.Queue()
        try:
            for i in range(n_bulk):
                procs.append(SPAWN.Process(target=bulk_child, args=(cfg, i, go, stop, q), name=f"bulk{i}", daemon=True))
            for i in range(n_urgent):
                procs.append(
                    SPAWN.Process(target=urgent_child, args=(cfg, i, go, start_at, q), name=f"urgent{i}", daemon=True)
                )
            for p in procs:
                p.start()
            collect(q, procs, d, "ready", n_procs, args.ready_timeout_s)
            log(
                f"N={n}: every client is ready; bulk for {args.lead_s:.1f} s, then {args.warm}+{args.count} urgent copies each"
            )
            with priod.SyncClient(d.socket_path, copy_path="daemon", name="growth-status") as sc:
                t_go = time.monotonic()
                start_at.value = t_go + args.lead_s
                go.set()
                sleep_until(start_at.value - 1.0)
                s0 = sample(sc, pid)  # bulk alone, the second before urgent copies start
                sleep_until(start_at.value)
                s1 = sample(sc, pid)
                series_s = (args.warm + args.count) * (args.interval_ms / 1e3 + 0.05)
                urgent = collect(q, procs, d, "result", n_urgent, series_s + 120, "urgent")
                s2 = sample(sc, pid)
                stop.set()
                bulk = collect(q, procs, d, "result", n_bulk, 300, "bulk")
                final = sc.status()
            for p in procs:
                p.join(30)
        finally:
            go.set()
            stop.set()
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)
    log(f"N={n}: done")
    return figures(n, n_urgent, n_bulk, args, s0, s1, s2, urgent, bulk, final, env)


def figures(
    n: int,
    n_urgent: int,
    n_bulk: int,
    args: argparse.Namespace,
    s0: dict[str, Any],
    s1: dict[str, Any],
    s2: dict[str, Any],
    urgent: list[tuple[str, int, Any]],
    bulk: list[tuple[str, int, Any]],
    final: dict[str, Any],
    env: dict[str, str],
) -> dict[str, Any]:
    """What one N measured, as growth.json keeps it."""
    lane = h2d_lane(s1["lane_bytes"])
    lat = [v for _, _, r in urgent for v in r["latency_us"]]
    daemon_total = [v for _, _, r in urgent for v in r["daemon_total_us"]]
    paths: dict[str, int] = {}
    for _, _, r in urgent:
        for k, v in r["paths"].items():
            paths[k] = paths.get(k, 0) + v
    # bulk alone: [s0, s1]; urgent window: [s1, s2] (urgent processes start at s1's instant)
    alone_s = s1["t"] - s0["t"]
    window_s = s2["t"] - s1["t"]
    alone_rate = (s1["cpu"] - s0["cpu"]) / alone_s
    window_cpu = s2["cpu"] - s1["cpu"]
    copies_in_window = n_urgent * (args.warm + args.count + 1)  # + 1: the read-back (d2h) of the last copy
    urgent_h2d_bytes = n_urgent * (args.warm + args.count) * args.size
    bulk_window_bytes = s2["lane_bytes"][lane] - s1["lane_bytes"][lane] - urgent_h2d_bytes
    per_client_p99 = [summarize(r["latency_us"], ("p99",))["p99"] for _, _, r in sorted(urgent, key=lambda m: m[1])]
    bulk_errors = [e for _, _, r in bulk for e in r["errors"]]
    return {
        "n": n,
        "urgent_clients": n_urgent,
        "bulk_clients": n_bulk,
        "urgent_latency_us": summarize(lat, LAT_KEYS),
        "urgent_daemon_total_us": summarize(daemon_total, LAT_KEYS),
        "urgent_p99_per_client_us": per_client_p99,
        "urgent_paths": paths,
        "urgent_window_s": window_s,
        "urgent_spread_s": max(r["t_last"] for _, _, r in urgent) - min(r["t_first"] for _, _, r in urgent),
        "urgent_copies_in_window": copies_in_window,
        "daemon_cpu_s_per_s": window_cpu / window_s,
        "daemon_cpu_us_per_urgent_copy": window_cpu / copies_in_window * 1e6,
        "daemon_cpu_us_per_urgent_copy_beyond_bulk": (window_cpu - alone_rate * window_s) / copies_in_window * 1e6,
        "bulk_alone": {
            "seconds": alone_s,
            "daemon_cpu_s_per_s": alone_rate,
            "gbps": (s1["lane_bytes"][lane] - s0["lane_bytes"][lane]) / alone_s / 1e9,
            "polls_per_s": (s1["polls"] - s0["polls"]) / alone_s,
        },
        "bulk_gbps": bulk_window_bytes / window_s / 1e9,
        "urgent_gbps": urgent_h2d_bytes / window_s / 1e9,
        "polls_per_s": (s2["polls"] - s1["polls"]) / window_s,
        "lane": lane,
        "verified": {
            "urgent_ok": sum(bool(r["verified"]) for _, _, r in urgent),
            "urgent_clients": n_urgent,
            "bulk_ok": sum(bool(r["verified"]) for _, _, r in bulk),
            "bulk_clients": n_bulk,
        },
        "bulk_copies": sum(r["copies"] for _, _, r in bulk),
        "bulk_errors": bulk_errors,
        "daemon_finished": final.get("finished", {}),
        "daemon_totals": final.get("totals", {}),
        "engine": final.get("engine", {}).get("engine"),
        "env": env,
        "raw_latency_us": lat,
    }


def all_good(r: dict[str, Any]) -> bool:
    """Every copy's bytes checked equal, no bulk copy failed, the daemon failed none."""
    v = r["verified"]
    return (
        v["urgent_ok"] == v["urgent_clients"]
        and v["bulk_ok"] == v["bulk_clients"]
        and not r["bulk_errors"]
        and not r["daemon_finished"].get("failed", 0)
    )


# -- the table -----------------------------------------------------------------------------------
def render(points: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = next((p for p in points if p["n"] == 1), points[0] if points else None)
    base_p99 = base["urgent_latency_us"]["p99"] if base else math.nan
    base_n = base["n"] if base else 1
    head = (
        f"{'N':>4} {'urgent+bulk':>11} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {f'p99/N={base_n}':>9} "
        f"{'CPU s/s':>7} {'(bulk)':>6} {'CPU us/cp':>9} {'(beyond)':>8} {'bulk GB/s':>9} {'bytes':>5}  target p99 <= {TARGET_RATIO}x N={base_n}"
    )
    lines = [head]
    for p in points:
        lat = p["urgent_latency_us"]
        ratio = lat["p99"] / base_p99 if base_p99 else math.nan
        verdict = "—" if p is base else ("met" if ratio <= TARGET_RATIO else "NOT met")
        lines.append(
            f"{p['n']:>4} {str(p['urgent_clients']) + '+' + str(p['bulk_clients']):>11} {lat['p50']:8.0f} {lat['p99']:8.0f} {lat['max']:8.0f} {ratio:9.2f} "
            f"{p['daemon_cpu_s_per_s']:7.2f} {p['bulk_alone']['daemon_cpu_s_per_s']:6.2f} {p['daemon_cpu_us_per_urgent_copy']:9.0f} "
            f"{p['daemon_cpu_us_per_urgent_copy_beyond_bulk']:8.0f} {p['bulk_gbps']:9.2f} {'ok' if all_good(p) else 'BAD':>5}  {verdict}"
        )
    top = max(points, key=lambda p: p["n"]) if points else None
    if top is not None and base is not None and top is not base:
        ratio = top["urgent_latency_us"]["p99"] / base_p99
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        if top["n"] == 64 and base_n == 1:
            lines.append(
                f"target: urgent p99 with 64 clients within {TARGET_RATIO}x of 1 client: {ratio:.2f}x, {verdict}"
            )
        else:
            lines.append(
                f"target names N=64 against N=1; this run's largest N={top['n']} against N={base_n}: {ratio:.2f}x ({verdict} at this N; the target is for N=64)"
            )
    lines.append(
        f"N=1 means 1 urgent + 1 bulk process; N>1: N/2 urgent + N/2 bulk. Urgent: {human(args.size)} h2d every {args.interval_ms:g} ms, "
        f"{args.count} measured per process (pooled), SyncClient spin {args.spin_us:g} us. Bulk: {human(args.bulk_bytes)} h2d, {args.pipeline} outstanding per process. "
        f"CPU s/s: the daemon over the urgent window ((bulk): over 1 s of bulk alone just before); CPU us/cp: window CPU / urgent copies in it "
        f"(warm-up and read-back included), (beyond): less the bulk-alone rate. bytes: every urgent and bulk client's read-back equal to its source."
    )
    budget = (
        "shipped per-uid urgent budget"
        if args.shipped_budget
        else "per-uid urgent budget raised to the lane's bandwidth (all clients are one uid)"
    )
    cores = os.cpu_count() or 0
    lines.append(f"backend {args.backend}; {cores} cores; request-rate cap off; {budget}.")
    if points and max(p["urgent_clients"] + p["bulk_clients"] for p in points) + 1 > cores:
        lines.append(
            f"note: more processes than this machine's {cores} cores at the largest N: the clients and the daemon compete for CPU, which the latencies include."
        )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sim", "cuda"], default="sim", help="the daemon's copy engine (default sim)")
    ap.add_argument(
        "--clients",
        default="1,8,64",
        help="client process counts N, comma-separated (default 1,8,64; 1,8,16 for a quick sim run)",
    )
    ap.add_argument("--out", default="out/growth", help="directory for growth.json and table.txt (default out/growth)")
    ap.add_argument("--size", type=parse_size, default=64 * KiB, help="urgent copy size (default 64K)")
    ap.add_argument(
        "--bulk-bytes", type=parse_size, default=None, help="bulk copy size (default 256M on cuda, 16M on sim)"
    )
    ap.add_argument("--pipeline", type=int, default=2, help="bulk copies outstanding per bulk process (default 2)")
    ap.add_argument(
        "--count",
        type=int,
        default=None,
        help="measured urgent copies per urgent process (default 200 on cuda, 100 on sim)",
    )
    ap.add_argument(
        "--warm", type=int, default=5, help="unmeasured urgent copies per process before the measured ones (default 5)"
    )
    ap.add_argument("--interval-ms", type=float, default=5.0, help="pause after each urgent copy (default 5)")
    ap.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="the urgent SyncClient's busy-poll for each reply (default 2000 on cuda, as bench_gpu.py; 0 on sim, whose copies need the small machine's cores)",
    )
    ap.add_argument(
        "--lead-s",
        type=float,
        default=None,
        help="bulk runs this long before urgent copies start (default 3 on cuda, 2 on sim; >= 1.5)",
    )
    ap.add_argument(
        "--direct",
        action="store_true",
        help="the urgent clients make direct copies (priod.client.direct: their own DMA, announced on a hold page; needs a GPU and CuPy)",
    )
    ap.add_argument(
        "--shipped-budget",
        action="store_true",
        help="keep the shipped per-uid urgent budget (default: raised to the lane's bandwidth, all clients being one uid)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="extra daemon setting, e.g. server__bulk_poll='\"spin\"' (repeatable)",
    )
    ap.add_argument(
        "--start-timeout-s", type=float, default=120.0, help="how long the daemon may take to listen (default 120)"
    )
    ap.add_argument(
        "--ready-timeout-s", type=float, default=300.0, help="how long the clients may take to get ready (default 300)"
    )
    args = ap.parse_args(argv)
    cuda = args.backend == "cuda"
    args.bulk_bytes = args.bulk_bytes or (256 * MiB if cuda else 16 * MiB)
    args.count = args.count if args.count is not None else (200 if cuda else 100)
    args.lead_s = args.lead_s if args.lead_s is not None else (3.0 if cuda else 2.0)
    args.spin_us = args.spin_us if args.spin_us is not None else (2000.0 if cuda else 0.0)
    try:
        args.ns = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--clients takes whole numbers, comma-separated, not {args.clients!r}")
    if not args.ns or min(args.ns) < 1:
        ap.error("--clients: every N must be >= 1")
    if args.count < 1 or args.warm < 0 or args.pipeline < 1 or args.interval_ms < 0:
        ap.error("--count and --pipeline must be >= 1, --warm and --interval-ms >= 0")
    if args.lead_s < 1.5:
        ap.error("--lead-s must be >= 1.5 (the second before urgent copies start measures bulk alone)")
    try:
        args.env = settings_env(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def _terminate(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: clients killed, daemon stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    os.makedirs(args.out, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("ns",)}
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": machine(),
        "settings": settings,
        "target": f"urgent p99 at N=64 within {TARGET_RATIO}x of N=1",
        "points": [],
    }

    def save() -> None:
        with open(os.path.join(args.out, "growth.json"), "w") as fp:
            json.dump(results, fp, indent=1)

    started = time.monotonic()
    for n in args.ns:
        results["points"].append(run_point(n, args))
        save()
    results["elapsed_s"] = time.monotonic() - started
    table = render(results["points"], args)
    results["table"] = table.splitlines()
    save()
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    log(f"{results['elapsed_s']:.0f} s; {os.path.join(args.out, 'growth.json')}")
    print(table)
    return 0 if all(all_good(p) for p in results["points"]) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the clients were killed and the daemon stopped on the way out
        log("interrupted")
        sys.exit(130)
