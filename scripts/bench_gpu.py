#!/usr/bin/env python3
"""GPU benchmark: urgent copies under a saturating bulk stream, side by side in one run.

Rows, per direction set (h2d, d2h, both at once):
  idle        each urgent size alone on an idle GPU, in-process cudaMemcpyAsync (the reference)
  idle-5ms    the same with 5 ms between copies, as every row below has (an idle link's wake-up)
  floor       idle-5ms plus a bare wake-up of another process asleep in a uvloop loop (an
              eventfd it watches, seen when it bumps a word this process spins on), copy by
              copy: what any round trip through a sleeping daemon costs at least (priod-idle's floor)
  naive       in-process: bulk 2 GiB copies on a low-priority stream, urgent copies on a
              high-priority stream (what priority streams promise, and do not give for copies)
  anchor      other-process bulk, no daemon: the measuring process issues the urgent
              cudaMemcpyAsync while a second process copies 2 GiB back to back in the set's
              directions. Copy engines time-slice between CUDA contexts, so this is the cheapest
              thing a user can do instead of running priod: the row priod has to beat.
  priod-idle  through priod with its defaults (express lane on), no bulk at all
  dma         through priod, express lane off: chunked bulk, urgent submitted first
  express     through priod, express lane on
  direct      the urgent copies are the measuring process's own DMA (priod.client.direct: its own
              buffers, its own context, each copy announced on its hold page), while priod runs
              bulk and holds it back during each one; direct-idle: the same, no bulk
  front       the front door: `copy(priority="urgent")` between daemon regions opened in the
              measuring process, which takes the direct path by itself (priod.client.route)
  ahead       as direct, each copy announced AHEAD_US before it is issued (`DirectPair.held`),
              as a client that knows its next blocks a little ahead can; latency from the issue
The anchor and priod rows run once per co-tenant (--cotenant, default none,gemm): "gemm" is a
process of its own, with its own CUDA context as an inference job has, running bf16 GEMMs of
--gemm-n back to back for the whole row (for priod rows it starts once the daemon listens, as a
job would after a system service). The priod rows also run once per polling mode (--bulk-poll,
default timer,spin); rows of modes after the first are named e.g. express/spin.

Columns: co-tenant; urgent p50/p99 (client-observed, us), each as a ratio to idle and, for priod
rows, to the anchor row with the same co-tenant (xA: < 1 means priod wins); the daemon's own p50
(arrival to completion seen, so the rest is the process round trip); the daemon's CPU per urgent
copy (priod-idle: all its CPU while the copies ran; dma/express: beyond what bulk alone costs, an
estimate); bulk GB/s and its ratio to raw cudaMemcpyAsync (the set's directions at once) measured
in the same run; link: bulk plus urgent bytes over raw (the urgent copies share the link, so bulk
alone cannot keep all of it); target: met or not met against the bound the row is held to
(`verdict`: the direct path, the daemon path under bulk, an idle daemon at 64 KiB).

    python scripts/bench_gpu.py --out out/bench_gpu          # about 6 minutes on an H200
    python scripts/bench_gpu.py --sets h2d --count 20 --bulk-poll timer   # a quick look

Needs a GPU, cuda-bindings and CuPy (in-process and anchor rows), PyTorch for the gemm co-tenant.
Writes results.json (after every row) and latency.png under --out and prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import mmap
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod
from priod.testing import daemon_process, percentile, process_cpu_seconds, settings_env

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (64 * KiB, 1 * MiB, 16 * MiB)
URGENT_INTERVAL_S = 0.005
"""Pause after each urgent copy of the anchor and priod rows (the same for both, so they compare)."""
AHEAD_US = 300.0
"""The "ahead" row: how long before issuing each copy its hold begins (a chunk of the short
bound lasts ~75 us on the H200, and the daemon sees the hold within a loop turn or two)."""
GAP_ENV = "BENCH_GPU_GAP"
"""--gap, as the environment the spawned rows inherit: "busy" spends each pause running Python."""


def pause(seconds: float) -> None:
    """The pause between urgent copies: asleep, or with --gap busy running Python, as the thread
    of an inference step is between its copies (on the H200's host, code that has not run for a
    few milliseconds runs several times slower after a sleep)."""
    if os.environ.get(GAP_ENV) != "busy":
        time.sleep(seconds)
        return
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


COTENANTS = ("none", "gemm")
SPAWN = mp.get_context("spawn")
URGENT_WINDOW_S = 0.25
"""Longer than the daemon's default ``urgent_window_ms`` (100): bulk alone is measured after it."""
DAEMON_ENV: dict[str, str] = {}
"""Settings of --set, for every priod row's daemon."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _dump_stacks_later() -> None:
    """With PRIOD_BENCH_DUMP_S set, print every thread's stack after that many seconds (a hang's where)."""
    import faulthandler

    if os.environ.get("PRIOD_BENCH_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["PRIOD_BENCH_DUMP_S"]), exit=False)


@dataclasses.dataclass(frozen=True)
class Load:
    """What one row runs: the set's directions, its bulk, how many urgent copies, and the co-tenant."""

    directions: tuple[str, ...]
    bulk_bytes: int
    count: int
    warm_s: float
    cotenant: str = "none"
    gemm_n: int = 8192


# -- child processes ---------------------------------------------------------------------------------
@contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[BaseProcess]:
    """``target(*args)`` in a spawned process: joined on the way out, killed at once if the caller failed.

    Take its result off its queue inside the block: a child that has put something waits for it to be read.
    """
    p = SPAWN.Process(target=target, args=args)
    p.start()
    try:
        yield p
    except BaseException:
        p.kill()
        raise
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()


def get_result(q: Any, procs: list[BaseProcess], timeout: float = 600) -> Any:
    """The next result on ``q``, or an error as soon as every child has died without one."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise RuntimeError(f"children exited ({[p.exitcode for p in procs]}) before reporting") from None
    raise TimeoutError(f"no result in {timeout} s")


def wait_ready(ready: Any, procs: list[BaseProcess], what: str, timeout: float = 180) -> None:
    """Return once ``ready`` (an Event) is set; an error as soon as a child in ``procs`` has died."""
    deadline = time.monotonic() + timeout
    while not ready.wait(0.5):
        if not all(p.is_alive() for p in procs):
            raise RuntimeError(f"{what} exited ({[p.exitcode for p in procs]}) before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout} s")


# -- copies in a CUDA context of this process's own (CuPy) ------------------------------------------------
class CudaCopies:
    """cudaMemcpyAsync between pinned host memory and device memory in this process's CUDA context.

    CuPy allocates; the copies go through cuda-bindings' runtime API, as the daemon's do. Holds one
    pinned host buffer and one device buffer for urgent copies, and a high-priority stream for them.
    """

    def __init__(self) -> None:
        import cupy as cp

        from priod.common.cuda.driver import bindings, check

        self.cp, self.check = cp, check
        self.rt, _ = bindings()
        self.low_priority, high = check(self.rt.cudaDeviceGetStreamPriorityRange())
        self.kinds = {
            "h2d": self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            "d2h": self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
        }
        self.urgent_stream = cp.cuda.Stream(non_blocking=True, priority=high)
        self.urgent_host = cp.cuda.alloc_pinned_memory(max(SIZES))
        self.urgent_dev = cp.cuda.alloc(max(SIZES))

    def stream(self) -> Any:
        """A new low-priority stream (for bulk)."""
        return self.cp.cuda.Stream(non_blocking=True, priority=self.low_priority)

    def buffers(self, nbytes: int) -> tuple[Any, Any]:
        """(pinned host, device) allocations of ``nbytes``."""
        return self.cp.cuda.alloc_pinned_memory(nbytes), self.cp.cuda.alloc(nbytes)

    def copy(self, direction: str, host: int, dev: int, n: int, stream: Any) -> None:
        dst, src = (dev, host) if direction == "h2d" else (host, dev)
        self.check(self.rt.cudaMemcpyAsync(dst, src, n, self.kinds[direction], stream.ptr))

    def urgent_once(self, direction: str, n: int) -> float:
        """One urgent copy of ``n`` bytes on the high-priority stream, waited for; microseconds."""
        t0 = time.perf_counter()
        self.copy(direction, self.urgent_host.ptr, self.urgent_dev.ptr, n, self.urgent_stream)
        self.urgent_stream.synchronize()
        return (time.perf_counter() - t0) * 1e6

    def urgent_series(self, direction: str, n: int, count: int, interval_s: float = 0.0, warm: int = 5) -> list[float]:
        """``warm`` unmeasured copies, then ``count`` measured ones, all ``interval_s`` apart.

        The warm-up copies keep the interval too: against bulk in another context, a copy right
        after back-to-back ones waits out a whole time slice (~1 ms), which is the warm-up's doing.
        """
        lat = []
        for i in range(warm + count):
            t = self.urgent_once(direction, n)
            if i >= warm:
                lat.append(t)
            if interval_s:
                pause(interval_s)
        return lat


# -- the wake-up floor -------------------------------------------------------------------------------------------
def _waker(efd: int, word_path: str) -> None:
    """The other side of `wake_floor`: a uvloop loop asleep until its eventfd is written; then it
    adds one to word 0 of a shared page (and stops once word 1 is set)."""
    import uvloop

    with open(word_path, "r+b") as f:
        page = mmap.mmap(f.fileno(), mmap.PAGESIZE)
    words = memoryview(page).cast("Q")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()

        def woken() -> None:
            os.eventfd_read(efd)
            words[0] += 1
            if words[1] and not stop.done():
                stop.set_result(None)

        loop.add_reader(efd, woken)
        await stop

    uvloop.run(serve())
    words.release()
    page.close()


def wake_floor(count: int, interval_s: float = URGENT_INTERVAL_S, warm: int = 5) -> list[float]:
    """Microseconds from writing the eventfd of another process asleep in a uvloop loop to
    seeing the word it bumps, ``count`` times with ``interval_s`` between (as the urgent copies
    have): the wake-up any round trip through a sleeping daemon pays on this host, on top of the
    copy. The other process is forked: call this before this process has a CUDA context."""
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    fd, word_path = tempfile.mkstemp(prefix="priod-wake-")
    os.ftruncate(fd, mmap.PAGESIZE)
    page = mmap.mmap(fd, mmap.PAGESIZE)
    words = memoryview(page).cast("Q")
    waker = mp.get_context("fork").Process(target=_waker, args=(efd, word_path), daemon=True)
    waker.start()
    lat: list[float] = []
    try:
        deadline = time.monotonic() + 30
        while words[0] == 0 and time.monotonic() < deadline:  # until its loop is up and answers
            os.eventfd_write(efd, 1)
            time.sleep(0.01)
        for i in range(warm + count):
            seen = words[0]
            t0 = time.perf_counter()
            os.eventfd_write(efd, 1)
            while words[0] == seen:
                if time.perf_counter() - t0 > 5.0:
                    raise RuntimeError("the wake-up floor's other process stopped answering")
            if i >= warm:
                lat.append((time.perf_counter() - t0) * 1e6)
            pause(interval_s)
    finally:
        words[1] = 1
        os.eventfd_write(efd, 1)
        waker.join(10)
        words.release()
        page.close()
        os.close(fd)
        os.close(efd)
        os.unlink(word_path)
    return lat


# -- in-process rows: idle, naive, and the raw bandwidth ------------------------------------------------------
def inprocess(directions: tuple[str, ...], bulk_bytes: int, count: int, q: Any) -> None:
    """idle and naive rows, and raw bandwidth, in a child process of its own."""
    _dump_stacks_later()
    log("in-process: the wake-up floor")
    wake = wake_floor(count)  # first: it forks, and this process has no CUDA context yet
    cc = CudaCopies()
    low = [cc.stream() for _ in directions]
    bulk = {d: cc.buffers(bulk_bytes) for d in directions}

    def bulk_copy(i: int, d: str) -> None:
        host, dev = bulk[d]
        cc.copy(d, host.ptr, dev.ptr, bulk_bytes, low[i])

    out: dict[str, Any] = {"idle": {}, "naive": {}, "raw_gbps": {}}
    log("in-process: idle")
    for d in ("h2d", "d2h"):
        for n in SIZES:
            out["idle"][f"{d}/{n}"] = sorted(cc.urgent_series(d, n, count))
    # the same with the other rows' pause after each copy: what an idle link costs a copy that
    # comes after 5 ms of nothing, in-process (the floor for priod-idle and direct-idle)
    out["idle_gap"] = {f"{d}/{n}": cc.urgent_series(d, n, count, URGENT_INTERVAL_S) for d in directions for n in SIZES}
    out["wake_us"] = wake
    # raw: whole bulk copies in every direction of the set at once (for "both", the two
    # directions share the host's PCIe and memory, so each alone would overstate the reference)
    for i, d in enumerate(directions):
        bulk_copy(i, d)
    for s in low:
        s.synchronize()
    marks = []
    for i, d in enumerate(directions):
        start, end = cc.cp.cuda.Event(), cc.cp.cuda.Event()
        start.record(low[i])
        for _ in range(3):
            bulk_copy(i, d)
        end.record(low[i])
        marks.append((d, start, end))
    for d, start, end in marks:
        end.synchronize()
        out["raw_gbps"][d] = 3 * bulk_bytes / (cc.cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9
    log(f"in-process: raw {out['raw_gbps']}; naive")
    # naive: keep the low-priority streams busy with whole bulk copies, urgent on the high one
    for d in directions:
        for n in SIZES:
            lat: list[float] = []
            moved, t0 = 0, time.perf_counter()
            for k in range(count):
                if k % 2 == 0:  # keep at least one whole bulk copy queued per direction
                    for i, bd in enumerate(directions):
                        bulk_copy(i, bd)
                        moved += bulk_bytes
                time.sleep(0.002)
                lat.append(cc.urgent_once(d, n))
            for s in low:
                s.synchronize()
            elapsed = time.perf_counter() - t0
            out["naive"][f"{d}/{n}"] = {
                "lat": lat,
                "bulk_gbps": moved / elapsed / 1e9 / len(directions),
                "urgent_gbps": count * n / elapsed / 1e9 / len(directions),
            }
    q.put(out)


# -- the co-tenant: another process computing on the GPU -----------------------------------------------------
def gemm_cotenant(n: int, ready: Any, stop: Any, q: Any) -> None:
    """bf16 ``n`` x ``n`` GEMMs back to back in this process's own CUDA context until ``stop``.

    One batch always waits queued behind the one running, so the SMs never idle between
    synchronizations; reports how many ran and the TFLOP/s they made.
    """
    _dump_stacks_later()
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)  # cuBLAS set-up, outside the figures
    torch.cuda.synchronize()
    ready.set()
    per_batch, gemms, prev = 4, 0, None
    t0 = time.perf_counter()
    while not stop.is_set():
        for _ in range(per_batch):
            torch.matmul(a, b, out=c)
        gemms += per_batch
        ev = torch.cuda.Event()
        ev.record()
        if prev is not None:
            prev.synchronize()
        prev = ev
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    q.put({"gemms": gemms, "seconds": seconds, "tflops": 2 * n**3 * gemms / seconds / 1e12})


@contextmanager
def cotenant(kind: str, gemm_n: int) -> Iterator[dict[str, Any]]:
    """Run the co-tenant ``kind`` (none or gemm) for the block; yields a dict that gets its figures on the way out."""
    info: dict[str, Any] = {"kind": kind}
    if kind == "none":
        yield info
        return
    info["gemm_n"] = gemm_n
    ready, stop, q = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    with child(gemm_cotenant, gemm_n, ready, stop, q) as p:
        wait_ready(ready, [p], "the GEMM co-tenant")
        log(f"co-tenant: {gemm_n}^3 bf16 GEMMs running")
        yield info
        stop.set()
        info.update(get_result(q, [p], 120))


# -- the anchor row: bulk in another process, no daemon ------------------------------------------------
def dma_bulk_process(directions: tuple[str, ...], nbytes: int, ready: Any, stop: Any, q: Any) -> None:
    """The anchor's bulk: ``nbytes`` cudaMemcpyAsync copies back to back in every direction, two
    queued at a time, in this process's own CUDA context until ``stop``; reports when each one
    finished (CLOCK_MONOTONIC, comparable across processes) per direction."""
    _dump_stacks_later()
    cc = CudaCopies()
    streams = {d: cc.stream() for d in directions}
    bufs = {d: cc.buffers(nbytes) for d in directions}

    def submit(d: str) -> Any:
        host, dev = bufs[d]
        cc.copy(d, host.ptr, dev.ptr, nbytes, streams[d])
        ev = cc.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(streams[d])
        return ev

    for d in directions:  # the first pass over fresh memory is slow: keep it out of the figures
        submit(d).synchronize()
    ready.set()
    pending: dict[str, list[Any]] = {d: [] for d in directions}
    done: dict[str, list[tuple[float, int]]] = {d: [] for d in directions}
    while True:
        stopping = stop.is_set()
        for d in directions:
            while pending[d] and pending[d][0].done:
                pending[d].pop(0)
                done[d].append((time.monotonic(), nbytes))
            while not stopping and len(pending[d]) < 2:
                pending[d].append(submit(d))
        if stopping and not any(pending.values()):
            break
        time.sleep(0.0005)  # a copy takes ~40 ms: this only blurs when one ended
    q.put(done)


def anchor_urgent(directions: tuple[str, ...], count: int, q: Any) -> None:
    """The anchor's measuring process: urgent copies per direction and size, as the idle row makes them."""
    _dump_stacks_later()
    cc = CudaCopies()
    t0 = time.monotonic()
    lat = {f"{d}/{n}": cc.urgent_series(d, n, count, URGENT_INTERVAL_S) for d in directions for n in SIZES}
    q.put({"lat": lat, "window": (t0, time.monotonic())})


def window_gbps(done: list[tuple[float, int]], t0: float, t1: float) -> float:
    """GB/s of the copies that ended within [t0, t1], from the first such end to the last (NaN with fewer than two)."""
    inside = [(t, n) for t, n in done if t0 <= t <= t1]
    if len(inside) < 2:
        return math.nan
    return sum(n for _, n in inside[1:]) / (inside[-1][0] - inside[0][0]) / 1e9


def urgent_bytes(lat: dict[str, Any], direction: str) -> int:
    """Bytes the urgent copies of ``lat`` (``"<direction>/<size>"``: latencies) moved in ``direction``."""
    return sum(int(k.split("/")[1]) * len(v) for k, v in lat.items() if k.startswith(direction + "/"))


def anchor_row(load: Load) -> dict[str, Any]:
    """Urgent cudaMemcpyAsync in one process while another copies bulk, no daemon; the co-tenant runs throughout."""
    log(f"anchor row {load.directions} co-tenant {load.cotenant}")
    ready, stop, bulk_q, urgent_q = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue(), SPAWN.Queue()
    with child(dma_bulk_process, load.directions, load.bulk_bytes, ready, stop, bulk_q) as bulk:
        wait_ready(ready, [bulk], "the bulk process")
        with (
            cotenant(load.cotenant, load.gemm_n) as ct,
            child(anchor_urgent, load.directions, load.count, urgent_q) as urgent,
        ):
            measured = get_result(urgent_q, [urgent])
        stop.set()
        done = get_result(bulk_q, [bulk], 120)
    t0, t1 = measured["window"]
    return {
        "row": "anchor",
        "label": "anchor",
        "cotenant": ct,
        "loaded": measured["lat"],
        "loaded_s": t1 - t0,
        "bulk_gbps": {d: window_gbps(done[d], t0, t1) for d in load.directions},
        "urgent_gbps": {d: urgent_bytes(measured["lat"], d) / (t1 - t0) / 1e9 for d in load.directions},
        "bulk_process_gbps": {d: window_gbps(done[d], 0.0, math.inf) for d in load.directions},
    }


# -- priod rows ------------------------------------------------------------------------------------
def bulk_client(path: str, direction: str, nbytes: int, stop: Any, q: Any) -> None:
    _dump_stacks_later()

    async def run() -> None:
        c = await priod.connect(path, copy_path="daemon", name=f"bulk-{direction}")
        h, d = await c.alloc_host(nbytes), await c.alloc_device(nbytes)
        dst, src = (d, h) if direction == "h2d" else (h, d)
        pending = [c.start_copy(dst, src, priority="bulk") for _ in range(2)]
        samples: list[tuple[float, int]] = []
        while pending:
            r = await pending.pop(0)
            samples.append((time.perf_counter(), r.nbytes))
            if not stop.is_set():
                pending.append(c.start_copy(dst, src, priority="bulk"))
        q.put((direction, samples))
        await c.close()

    run_async(run())


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def urgent_client(
    path: str,
    directions: tuple[str, ...],
    count: int,
    cpu_pid: int,
    interval_s: float = URGENT_INTERVAL_S,
    warm: int = 5,
    direct: Any = None,
    ahead_us: float = 0.0,
    front: bool = False,
) -> dict[str, Any]:
    """Urgent copies one at a time from a blocking client with its defaults (it busy-polls for an
    urgent copy's reply, `DEFAULT_URGENT_SPIN_US`); client-observed latency per copy, and the
    daemon's (``cpu_pid``) CPU seconds and the wall seconds over each size's copies. ``warm``
    unmeasured copies per size go first, as in the in-process and anchor rows (the first copy of a
    size after the daemon starts, or after the size changes, is slower than the rest).

    ``direct`` (a `CudaCopies`): the urgent copies are direct ones instead (`priod.client.direct`), this
    process's own DMA between its own buffers, announced on its hold page; the daemon only holds
    bulk back. ``ahead_us`` (direct only): each copy's hold begins that long before the copy is
    issued, and its latency counts from the issue."""
    out: dict[str, Any] = {}
    paths: dict[str, set[str]] = {}
    daemon: dict[str, list[tuple[float, float, float]]] = {}  # the daemon's own queued/transfer/total
    cpu: dict[str, tuple[float, float]] = {}
    lane_bytes: dict[
        str, tuple[dict[str, int], dict[str, int], float]
    ] = {}  # per size: lane bytes before, after, wall s
    with priod.SyncClient(path, copy_path="auto" if front else "daemon", name="urgent") as c:
        one: Callable[[str, int], Any]
        if direct is not None:
            from priod.client.direct import DirectCopies

            copier = DirectCopies(c.hold_page())
            host, dev = (direct.urgent_host.ptr, max(SIZES)), (direct.urgent_dev.ptr, max(SIZES))
            pairs = {"h2d": copier.pair(dev, host), "d2h": copier.pair(host, dev)}  # resolved once, as a KV cache would

            def one(direction: str, n: int) -> Any:
                if not ahead_us:
                    return pairs[direction].copy(n)
                with pairs[direction].held():
                    until = time.perf_counter() + ahead_us / 1e6
                    while time.perf_counter() < until:
                        pass
                    issued = time.perf_counter()
                    pairs[direction].copy(n)
                return issued
        else:
            h, d = c.alloc_host(max(SIZES)), c.alloc_device(max(SIZES))
            assert h.array is not None
            h.array[:] = np.arange(max(SIZES), dtype=np.uint64).view(np.uint8)[: max(SIZES)]

            def one(direction: str, n: int) -> Any:
                dst, src = (d, h) if direction == "h2d" else (h, d)
                return c.copy(dst, src, n, priority="urgent")

            if front:
                # The front door: `copy(priority="urgent")` as any user calls it, with the device
                # region open in this process; the host region is pinned here on first need (off
                # the copy's path), and from then on the copies take the direct path by themselves.
                d.device_view()
                for direction in directions:
                    deadline = time.monotonic() + 30
                    while one(direction, 4096).path != "direct" and time.monotonic() < deadline:
                        time.sleep(0.001)

        for direction in directions:
            for n in SIZES:
                key = f"{direction}/{n}"
                lat = []
                for _ in range(warm):
                    one(direction, n)
                    pause(interval_s)
                b0 = c.status()["lane_bytes"]
                c0, w0 = process_cpu_seconds(cpu_pid), time.perf_counter()
                for _ in range(count):
                    t0 = time.perf_counter()
                    r = one(direction, n)
                    if ahead_us:
                        t0 = r  # when the copy was issued, its hold having begun ahead_us before
                    lat.append((time.perf_counter() - t0) * 1e6)
                    if direct is None:
                        paths.setdefault(key, set()).add(r.path)
                        if r.path != "direct":  # the daemon made it: its own timings
                            daemon.setdefault(key, []).append((r.queued_us, r.transfer_us, r.total_us))
                    pause(interval_s)
                cpu[key] = (process_cpu_seconds(cpu_pid) - c0, time.perf_counter() - w0)
                lane_bytes[key] = (b0, c.status()["lane_bytes"], cpu[key][1])
                out[key] = lat
    out["_paths"] = {k: sorted(v) for k, v in paths.items()}
    out["_daemon_us"] = daemon
    out["_cpu_s"] = cpu
    out["_lane_bytes"] = lane_bytes
    return out


def bulk_rate(lane_bytes: int, urgent_bytes: int, seconds: float, direct: bool) -> float:
    """Bulk GB/s from the bytes the daemon counted on a lane over ``seconds``. It counts the
    chunks it ran: urgent copies made through it are among them and come out; ``direct`` ones
    (the client's own DMA) never were, and taking them out read bulk ~0.02 of the link low."""
    return (lane_bytes - (0 if direct else urgent_bytes)) / seconds / 1e9


def bulk_per_size(
    loaded: dict[str, Any], directions: tuple[str, ...], count: int, direct: bool
) -> dict[str, dict[str, float]]:
    """Bulk GB/s on each loaded lane while the urgent copies of one size ran (``count`` of them,
    every 5 ms), their own bytes taken out. A 16 MiB urgent copy every 5 ms is itself ~6% of the
    H200's link, which bulk cannot have; 64 KiB copies are 0.02%. So the figure for the whole
    loaded phase (``bulk_gbps``) mixes the scheduler's cost with the urgent bytes' own share, and
    this one shows each apart."""
    out: dict[str, dict[str, float]] = {}
    for key, (before, after, wall) in loaded.get("_lane_bytes", {}).items():
        direction, n = key.split("/")
        lanes = {d: after[f"gpu0/{d}"] - before[f"gpu0/{d}"] for d in directions}
        out[key] = {
            d: bulk_rate(moved, int(n) * count if d == direction else 0, wall, direct) for d, moved in lanes.items()
        }
    return out


def cpu_per_copy_us(probe: dict[str, Any], count: int, baseline_cpu_s_per_s: float = 0.0) -> dict[str, float]:
    """The daemon's CPU microseconds per urgent copy, per size, beyond ``baseline_cpu_s_per_s`` (what it spends anyway)."""
    return {key: (cpu - baseline_cpu_s_per_s * wall) / count * 1e6 for key, (cpu, wall) in probe["_cpu_s"].items()}


def priod_row(
    load: Load,
    express: bool,
    bulk_poll: str = "spin",
    backend: str = "cuda",
    direct: bool = False,
    ahead_us: float = 0.0,
    front: bool = False,
) -> dict[str, Any]:
    """priod-idle (urgent copies only), then urgent copies under bulk from one client process per
    direction. ``direct``: the urgent copies are direct ones (this process's own DMA, `priod.client.direct`);
    ``ahead_us``: each announced that long before it is issued; ``front``: `copy(priority="urgent")`
    between daemon regions opened here, which takes the direct path by itself."""
    urgent = functools.partial(urgent_client, direct=CudaCopies() if direct else None, ahead_us=ahead_us, front=front)
    env = {
        "PRIOD_SCHEDULER__EXPRESS": "true" if express else "false",
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_SERVER__BULK_POLL": f'"{bulk_poll}"',
        **DAEMON_ENV,
    }
    log(
        f"priod row {load.directions} express={express} bulk_poll={bulk_poll} co-tenant {load.cotenant}: starting daemon ({backend})"
    )
    with daemon_process(env, backend=backend, start_timeout=120) as dmn, cotenant(load.cotenant, load.gemm_n) as ct:
        pid = dmn.proc.pid
        idle = urgent(dmn.socket_path, load.directions, load.count, pid)
        stop, q = SPAWN.Event(), SPAWN.Queue()
        log("idle via priod done; starting bulk clients")
        with ExitStack() as stack, priod.SyncClient(dmn.socket_path, copy_path="daemon") as sc:
            procs = [
                stack.enter_context(child(bulk_client, dmn.socket_path, d, load.bulk_bytes, stop, q))
                for d in load.directions
            ]
            # warm: every bulk client has pinned its regions and its bytes are flowing
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                sc.status()["lane_bytes"][f"gpu0/{d}"] for d in load.directions
            ):
                time.sleep(0.05)
            time.sleep(load.warm_s)
            # bulk alone for a second, then under urgent load: bytes per lane from the daemon,
            # counted per chunk, so the figure does not depend on where 2 GiB copies end
            t1, b1, c1 = time.perf_counter(), sc.status()["lane_bytes"], process_cpu_seconds(pid)
            loaded = urgent(dmn.socket_path, load.directions, load.count, pid)
            t2, st, c2 = time.perf_counter(), sc.status(), process_cpu_seconds(pid)
            b2 = st["lane_bytes"]
            # then bulk alone, measured after the loaded phase (so both see a warmed pipeline),
            # once the last urgent copy's short-bound window (urgent_window_ms, 100 by default)
            # is over: inside it the loop turns every turn, which is the urgent load's cost
            time.sleep(URGENT_WINDOW_S)
            s3 = sc.status()
            t3, b3, c3 = time.perf_counter(), s3["lane_bytes"], process_cpu_seconds(pid)
            time.sleep(1.0)
            s4 = sc.status()
            t4, b4, c4 = time.perf_counter(), s4["lane_bytes"], process_cpu_seconds(pid)
            log("urgent under load done")
            stop.set()
            for _ in procs:
                get_result(q, procs, 120)
    alone, results, urgent_rate = {}, {}, {}
    for d in load.directions:
        lane = f"gpu0/{d}"
        moved_urgent = urgent_bytes(loaded, d)
        alone[d] = (b4[lane] - b3[lane]) / (t4 - t3) / 1e9
        results[d] = bulk_rate(b2[lane] - b1[lane], moved_urgent, t2 - t1, direct or front)
        urgent_rate[d] = moved_urgent / (t2 - t1) / 1e9
    moved_alone = sum(b4[f"gpu0/{d}"] - b3[f"gpu0/{d}"] for d in load.directions)
    cpu = {
        "loaded_cpu_s_per_s": (c2 - c1) / (t2 - t1),
        "bulk_alone_cpu_s_per_s": (c4 - c3) / (t4 - t3),
        "bulk_alone_cpu_s_per_gb": (c4 - c3) / max(moved_alone / 1e9, 1e-9),
        "bulk_alone_polls_per_s": (s4.get("polls", 0) - s3.get("polls", 0)) / (t4 - t3),
    }
    per_copy = {
        "idle": cpu_per_copy_us(idle, load.count),
        "loaded": cpu_per_copy_us(loaded, load.count, cpu["bulk_alone_cpu_s_per_s"]),
    }
    return {
        "row": ("ahead" if ahead_us else "direct") if direct else "front" if front else "express" if express else "dma",
        "bulk_poll": bulk_poll,
        "cotenant": ct,
        "idle_via_priod": idle,
        "loaded": loaded,
        "bulk_gbps": results,
        "bulk_gbps_per_size": bulk_per_size(loaded, load.directions, load.count, direct or front),
        "urgent_gbps": urgent_rate,
        "loaded_s": t2 - t1,
        "bulk_alone_gbps": alone,
        "daemon_cpu": cpu,
        "cpu_per_copy_us": per_copy,
        "lanes": st["lanes"],
        "engine": st["engine"],
        "direct": st.get("direct", {}),
    }


# -- main ------------------------------------------------------------------------------------
def csv_choices(ap: argparse.ArgumentParser, value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """``value`` split at commas; a usage error unless every item is in ``allowed``."""
    items = value.split(",")
    if not items or not set(items) <= set(allowed):
        ap.error(f"{flag} takes {', '.join(allowed)} (comma-separated)")
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench_gpu")
    ap.add_argument("--count", type=int, default=60, help="urgent copies per size and row")
    ap.add_argument("--bulk-gib", type=float, default=2.0)
    ap.add_argument("--sets", default="h2d,d2h,both")
    ap.add_argument(
        "--bulk-poll",
        default="timer,spin",
        help="the daemon's [server] bulk_poll modes, comma-separated: the priod rows run once per mode "
        "(rows of modes after the first are named e.g. express/spin); the default measures the shipped "
        "mode (timer) and spin side by side",
    )
    ap.add_argument(
        "--cotenant",
        default="none,gemm",
        help="what else runs on the GPU during the anchor and priod rows, comma-separated: none, or gemm "
        "(a process of its own running bf16 GEMMs back to back); each row runs once per item",
    )
    ap.add_argument(
        "--rows",
        default="dma,express,direct",
        help="the priod rows, comma-separated: dma (express lane off), express (as shipped), direct (the urgent "
        "copies are the client's own DMA, priod.client.direct, while the daemon runs bulk), ahead (direct, each copy "
        "announced AHEAD_US before it is issued)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="a daemon setting for every priod row, e.g. tuning__urgent_block_us=300",
    )
    ap.add_argument(
        "--gap",
        choices=["sleep", "busy"],
        default="sleep",
        help="the pause between urgent copies: asleep (default) or running Python",
    )
    ap.add_argument("--gemm-n", type=int, default=8192, help="the gemm co-tenant's matrices are n x n")
    ap.add_argument(
        "--warm-s",
        type=float,
        default=3.0,
        help="bulk runs this long before measuring (the first passes over fresh pinned memory are slow)",
    )
    args = ap.parse_args()
    os.environ[GAP_ENV] = args.gap  # the rows in spawned processes pause the same way
    _dump_stacks_later()
    os.makedirs(args.out, exist_ok=True)
    bulk = int(args.bulk_gib * GiB)
    modes = csv_choices(ap, args.bulk_poll, ("timer", "spin"), "--bulk-poll")
    cotenants = csv_choices(ap, args.cotenant, COTENANTS, "--cotenant")
    kinds = csv_choices(ap, args.rows, ("dma", "express", "direct", "ahead", "front"), "--rows")
    try:
        DAEMON_ENV.update(settings_env(args.set))
    except ValueError as exc:
        ap.error(str(exc))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "sets": {}}

    def save() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as fp:
            json.dump(results, fp, indent=1)

    for name in args.sets.split(","):
        base = Load(("h2d", "d2h") if name == "both" else (name,), bulk, args.count, args.warm_s, gemm_n=args.gemm_n)
        q: Any = SPAWN.Queue()
        with child(inprocess, base.directions, bulk, args.count, q) as p:
            inproc = get_result(q, [p])
        rows: list[dict[str, Any]] = []
        results["sets"][name] = {"inprocess": inproc, "rows": rows}
        # each row kind runs with every co-tenant in turn, so the pairs compared sit close in time
        for cot in cotenants:
            rows.append(anchor_row(dataclasses.replace(base, cotenant=cot)))
            save()
        for i, mode in enumerate(modes):
            for kind in kinds:
                for cot in cotenants:
                    r = priod_row(
                        dataclasses.replace(base, cotenant=cot),
                        kind != "dma",
                        bulk_poll=mode,
                        direct=kind in ("direct", "ahead"),
                        ahead_us=AHEAD_US if kind == "ahead" else 0.0,
                        front=kind == "front",
                    )
                    r["label"] = r["row"] if i == 0 else f"{r['row']}/{mode}"
                    rows.append(r)
                    save()
    table = render(results)
    plot(results, os.path.join(args.out, "latency.png"))
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    print(table)
    return 0


# -- the table ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Line:
    """One line of the table: a row's urgent latencies for one size, and what goes beside them."""

    row: str
    cotenant: str
    lat: list[float]
    bulk_gbps: float | None = None
    urgent_gbps: float | None = None
    daemon_us: float | None = None
    cpu_us: float | None = None
    anchor: list[float] | None = None
    """The anchor row's latencies with the same co-tenant (priod rows only)."""


def mean_of(per_direction: dict[str, float]) -> float | None:
    return float(np.mean(list(per_direction.values()))) if per_direction else None


def daemon_p50(probe: dict[str, Any], key: str) -> float | None:
    """The daemon's own p50 for the copies of ``key``; None for direct copies (the daemon makes none)."""
    totals = [total for _, _, total in probe["_daemon_us"].get(key, [])]
    return percentile(totals, 50) if totals else None


def table_lines(s: dict[str, Any], key: str) -> list[Line]:
    """idle, naive, then per co-tenant: anchor, priod-idle (from the express rows' daemons), the priod rows."""
    inproc = s["inprocess"]
    naive = inproc["naive"][key]
    lines = [Line("idle", "none", inproc["idle"][key])]
    if key in inproc.get("idle_gap", {}):
        lines.append(Line("idle-5ms", "none", inproc["idle_gap"][key]))
        if inproc.get("wake_us"):
            # copy by copy: each in-process copy after 5 ms asleep, plus one bare wake-up
            lines.append(
                Line("floor", "none", [a + b for a, b in zip(inproc["idle_gap"][key], inproc["wake_us"], strict=False)])
            )
    lines.append(Line("naive", "none", naive["lat"], naive["bulk_gbps"], naive.get("urgent_gbps")))
    for cot in dict.fromkeys(r["cotenant"]["kind"] for r in s["rows"]):
        rows = [r for r in s["rows"] if r["cotenant"]["kind"] == cot]
        anchor = next((r["loaded"][key] for r in rows if r["row"] == "anchor"), None)
        priod_rows = [r for r in rows if r["row"] != "anchor"]
        for r in rows:
            if r["row"] == "anchor":
                lines.append(Line("anchor", cot, r["loaded"][key], mean_of(r["bulk_gbps"]), mean_of(r["urgent_gbps"])))
        for r in priod_rows:
            if r["row"] in ("express", "direct", "ahead", "front"):
                idle = r["idle_via_priod"]
                label = (
                    r["label"]
                    .replace("express", "priod-idle")
                    .replace("direct", "direct-idle")
                    .replace("ahead", "ahead-idle")
                    .replace("front", "front-idle")
                )
                lines.append(
                    Line(
                        label,
                        cot,
                        idle[key],
                        daemon_us=daemon_p50(idle, key),
                        cpu_us=r["cpu_per_copy_us"]["idle"][key],
                        anchor=anchor,
                    )
                )
        for r in priod_rows:
            loaded = r["loaded"]
            bulk, urgent = r["bulk_gbps"], r["urgent_gbps"]
            if key in r.get(
                "bulk_gbps_per_size", {}
            ):  # bulk while this size's copies ran, where the results file has it
                bulk, wall = r["bulk_gbps_per_size"][key], loaded["_lane_bytes"][key][2]
                urgent = {
                    d: int(key.split("/")[1]) * len(loaded[key]) / wall / 1e9 if key.startswith(d + "/") else 0.0
                    for d in bulk
                }
            lines.append(
                Line(
                    r["label"],
                    cot,
                    loaded[key],
                    mean_of(bulk),
                    mean_of(urgent),
                    daemon_p50(loaded, key),
                    r["cpu_per_copy_us"]["loaded"][key],
                    anchor,
                )
            )
    return lines


def verdict(row: str, nbytes: int, p50: float, p99: float, idle_p50: float) -> str:
    """Whether a row's cell meets the target it is held to, "" where none applies (docs/benchmarks.md,
    "Where each target stands"). The direct path under bulk (front, direct, ahead): up to 1 MiB
    p50 <= 130 / p99 <= 200 us, larger p99 <= 1.5x the idle copy's p50. Through the daemon under
    bulk (dma, express): up to 1 MiB p50 <= 150 / p99 <= 250 us, larger p99 <= 2x idle + 100 us.
    Through an idle daemon (priod-idle), 64 KiB: p50 <= 100 / p99 <= 150 us."""
    base = row.split("/")[0]  # "express/spin": the same row in another polling mode
    if base in ("front", "direct", "ahead"):
        ok = p99 <= 1.5 * idle_p50 if nbytes > MiB else p50 <= 130 and p99 <= 200
    elif base in ("dma", "express"):
        ok = p99 <= 2 * idle_p50 + 100 if nbytes > MiB else p50 <= 150 and p99 <= 250
    elif base == "priod-idle" and nbytes <= 64 * KiB:
        ok = p50 <= 100 and p99 <= 150
    else:
        return ""
    return "met" if ok else "not met"


def fmt(v: float | None, spec: str, width: int) -> str:
    """``v`` formatted, or blanks where there is no figure."""
    return f"{v:{width}{spec}}" if v is not None and math.isfinite(v) else " " * width


def render(results: dict[str, Any]) -> str:
    """The table: per urgent size, each row's latency against idle and against the anchor, the
    daemon's own share of it and its CPU, and what bulk kept of the link."""
    out = [
        f"{'set':<5} {'urgent':<10} {'row':<16} {'cot':<4} {'p50 us':>9} {'x idle':>7} {'p99 us':>9} {'x idle':>7} {'p50 xA':>6} {'p99 xA':>6} "
        f"{'daemon':>7} {'cpu/cp':>6} {'bulk GB/s':>10} {'x raw':>6} {'link':>6}  target"
    ]
    for name, s in results["sets"].items():
        inproc = s["inprocess"]
        raw = float(np.mean(list(inproc["raw_gbps"].values())))
        for key in inproc["naive"]:
            direction, n = key.split("/")
            label = f"{direction} {int(n) // KiB} KiB" if int(n) < MiB else f"{direction} {int(n) // MiB} MiB"
            i50 = percentile(inproc["idle"][key], 50)
            for ln in table_lines(s, key):
                p50, p99 = percentile(ln.lat, 50), percentile(ln.lat, 99)
                xa50 = p50 / percentile(ln.anchor, 50) if ln.anchor else None
                xa99 = p99 / percentile(ln.anchor, 99) if ln.anchor else None
                gbps = ln.bulk_gbps
                link = (gbps + ln.urgent_gbps) / raw if gbps is not None and ln.urgent_gbps is not None else None
                met = verdict(ln.row, int(n), p50, p99, i50)
                out.append(
                    f"{name:<5} {label:<10} {ln.row:<16} {ln.cotenant:<4} {p50:9.1f} {p50 / i50:7.1f} {p99:9.1f} {p99 / i50:7.1f} "
                    f"{fmt(xa50, '.2f', 6)} {fmt(xa99, '.2f', 6)} {fmt(ln.daemon_us, '.0f', 7)} {fmt(ln.cpu_us, '.0f', 6)} "
                    f"{fmt(gbps, '.1f', 10)} {fmt(gbps / raw if gbps is not None else None, '.3f', 6)} {fmt(link, '.3f', 6)}  {met}"
                )
        out.append(
            f"{name:<5} raw cudaMemcpyAsync GB/s (the set's directions at once): "
            + ", ".join(f"{d} {v:.1f}" for d, v in inproc["raw_gbps"].items())
        )
        out += [f"{name:<5} {row_summary(r, inproc['raw_gbps'])}" for r in s["rows"]]
    out.append(
        "xA: ratio to the anchor row (other-process bulk, no daemon) with the same co-tenant, < 1: priod wins; daemon: the daemon's own p50 "
        "(arrival to completion seen); cpu/cp: daemon CPU us per urgent copy (under load: beyond bulk alone); bulk GB/s: priod rows, while "
        "that size's urgent copies ran (urgent bytes apart); link: (bulk + urgent bytes) / raw; target: `verdict` (direct path "
        "<= 1 MiB p50 <= 130 / p99 <= 200 us, 16 MiB p99 <= 1.5x idle; through the daemon 150 / 250, 16 MiB p99 <= 2x idle + 100; "
        "an idle daemon 64 KiB 100 / 150)"
    )
    return "\n".join(out)


def row_summary(r: dict[str, Any], raw_gbps: dict[str, float]) -> str:
    """One line per anchor or priod row: its bulk without urgent load, the daemon's CPU, the co-tenant's rate."""
    ct = r["cotenant"]
    tenant = f"; co-tenant {ct['gemm_n']}^3 GEMMs {ct['tflops']:.0f} TFLOP/s" if "tflops" in ct else ""
    head = f"{r['label']} ({ct['kind']}):"
    if r["row"] == "anchor":
        return (
            f"{head} bulk process GB/s over its whole run "
            + ", ".join(f"{d} {v:.1f}" for d, v in r["bulk_process_gbps"].items())
            + tenant
        )
    cpu = r["daemon_cpu"]
    alone = ", ".join(f"{d} {v:.1f} (x raw {v / raw_gbps[d]:.3f})" for d, v in r["bulk_alone_gbps"].items())
    loaded = ", ".join(f"{d} {v:.1f} (x raw {v / raw_gbps[d]:.3f})" for d, v in r["bulk_gbps"].items())
    holds = ""
    if r["row"] in ("direct", "ahead", "front"):
        # What the daemon saw of the client's hold page: copies counted should be what was
        # announced, and holds cut or counters stepping back mean copies that held nothing.
        d = r.get("direct", {})
        copies, cut, back = (sum(d.get(key, {}).values()) for key in ("copies", "cut", "stepped_back"))
        holds = f"; holds: copies {copies:,}, cut {cut}, counters stepped back {back}"
    return (
        f"{head} bulk_poll {r['bulk_poll']}; bulk GB/s over the whole urgent phase {loaded}; daemon CPU {cpu['loaded_cpu_s_per_s']:.2f} s/s under urgent load; with bulk alone "
        f"{cpu['bulk_alone_cpu_s_per_s']:.2f} s/s, {cpu['bulk_alone_cpu_s_per_gb']:.4f} s/GB, {cpu['bulk_alone_polls_per_s']:,.0f} polls/s, GB/s {alone}{tenant}{holds}"
    )


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sets = list(results["sets"].items())
    fig, axes = plt.subplots(len(sets), len(SIZES), figsize=(5 * len(SIZES), 3.6 * len(sets)), squeeze=False)
    for r, (name, s) in enumerate(sets):
        for c, n in enumerate(SIZES):
            ax = axes[r][c]
            direction = "d2h" if name == "d2h" else "h2d"
            key = f"{direction}/{n}"
            for ln in table_lines(s, key):
                v = sorted(ln.lat)
                ax.plot(
                    v,
                    np.linspace(0, 1, len(v)),
                    label=f"{ln.row} ({ln.cotenant})",
                    linestyle="--" if ln.cotenant == "gemm" else "-",
                )
            ax.set_xscale("log")
            ax.set_title(f"{name}: urgent {key}")
            ax.set_xlabel("latency (us)")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("CDF")
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
