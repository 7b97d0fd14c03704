#!/usr/bin/env python3
"""Serving benchmark: a decode loop's urgent KV-block reloads beside bulk both ways and GEMMs.

Every step (--interval-ms, default 5) a decode loop reloads K scattered KV blocks from a pinned
host pool into a GPU pool (h2d) and waits for them, as a decode step waits for its blocks; the
whole time a bulk offload (d2h) and a prefetch (h2d) of --bulk-mib copies run both ways, and
bf16 GEMMs (--gemm-n) run back to back. Shapes: --shapes, K x block (default 32x64K,128x128K).
Each step's latency is client-observed: from issuing the step's copies to all of them landed.

Rows, per shape:
  idle            in-process, nothing else running: one cudaMemcpyAsync per block on a
                  high-priority stream of the decode process's own, 5 ms apart as every row
  idle-batched    the same blocks as one cuMemcpyBatchAsync (priod's `BatchedDma`, the same call)
  idle-contig     the same bytes as one contiguous cudaMemcpyAsync (128x128K: one 16 MiB copy,
                  the reference of that shape's target)
  anchor          no daemon: the decode process issues one cudaMemcpyAsync per block on its
                  high-priority stream while another process of its own copies bulk both ways
                  (cudaMemcpyAsync back to back, two outstanding each way): the cheapest thing a
                  user can do instead of running priod
  anchor-batched  the same with one cuMemcpyBatchAsync per step
  priod           the front door: the daemon runs the bulk (a bulk client process per direction,
                  ``copy(..., priority="bulk")`` on daemon regions) and the decode process calls
                  ``copy_batch(gpu_pool, host_pool, segments, priority="urgent")`` each step, the
                  GPU pool a torch tensor given to ``register_device``, the host pool ``alloc_host``
                  (priod takes the direct path by itself where this process can: `paths` counts)
The anchor and priod rows run once per GEMM variant (--gemm, default other,same): "other", a
process of its own running GEMMs (as an inference job beside priod); "same", a thread of the
decode process on a stream of its own. A GEMM-only phase comes first (each variant alone).

Columns: p50 / p99 step (us); paths (which path each measured step took); bulk GB/s each way
over the measured steps (priod: the daemon's lane counters, urgent bytes it made taken out) and
both ways as a ratio of raw cudaMemcpyAsync both ways at once, measured in-process in the same
run (x raw); link: (bulk + urgent bytes) / raw; the GEMMs' TFLOP/s over the measured steps, as
a ratio of the GEMM-only phase (x alone) and, for priod rows, of the anchor row of the same
shape and variant (x anch); blocks checked / wrong. Every step of every row, warm-up steps too,
is checked: each host block holds a pattern of its slot with the step's number stamped every
4 KiB, and after the copies land the GPU pool's destination blocks are compared with what they
must hold on the GPU (a few small torch kernels on a stream of their own; numpy on sim). Those
kernels are the decode process's, as a decode step's own kernels would be: beside GEMMs in
another process they make the GPU switch contexts every step, in the anchor rows as in priod's,
so x anch is the ratio that leaves them out.

    python scripts/bench_serving.py --out out/bench_serving        # about 2.5 minutes on an H200
    python scripts/bench_serving.py --shapes 32x64K --gemm other --steps 300   # a quick look
    python scripts/bench_serving.py --backend sim --steps 20 --shapes 8x64K    # no GPU: the priod rows on sim

Needs a GPU, PyTorch with CUDA and cuda-bindings (``--backend sim`` needs neither: host and
device regions are then shared memfds, blocks are checked with numpy, no GEMMs, and "raw" is
the sim's bulk alone through the daemon). Writes results.json under --out after every row and
prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p
)

# scripts/ is this script's directory
from bench_gpu import SPAWN, child, get_result, log, wait_ready

import priod
from priod.testing import BulkProcess, daemon_process, percentile, settings_env, throughput_between

KiB, MiB = 1 << 10, 1 << 20
DIRECTIONS = ("h2d", "d2h")
FORMS = ("loop", "batched", "contig", "priod")
"""How a step's blocks are copied: a cudaMemcpyAsync per block, one cuMemcpyBatchAsync, one
contiguous cudaMemcpyAsync of the same bytes, priod's ``copy_batch``."""
ROWS = {
    "idle": "loop",
    "idle-batched": "batched",
    "idle-contig": "contig",
    "anchor": "loop",
    "anchor-batched": "batched",
    "priod": "priod",
}
"""Each row's form."""
LOADED_ROWS = ("anchor", "anchor-batched", "priod")
GEMMS = ("other", "same")
POOL_FACTOR = 4
"""Each pool holds this many times a step's blocks: a step's slots are scattered over it, and a
step rarely reloads into the slots of the step before."""
STAMP_WORDS = 512
"""A step's number is stamped into a host block once per this many 8-byte words (4 KiB)."""
STAMP_TAG = 1 << 62
"""Sets stamps apart from the pattern words (slot << 40 | word), which never reach bit 62."""
P99_US_32X64K = 300.0
LINK_TARGET = 0.97
GEMM_TARGET = 0.99


def _dump_stacks_later() -> None:
    """With PRIOD_BENCH_DUMP_S set, print every thread's stack after that many seconds (a hang's where)."""
    import faulthandler

    if os.environ.get("PRIOD_BENCH_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["PRIOD_BENCH_DUMP_S"]), exit=False)


# -- shapes, plans and the pattern -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    """K blocks of ``block`` bytes reloaded each step."""

    blocks: int
    block: int

    @property
    def label(self) -> str:
        return f"{self.blocks}x{self.block // KiB}K"

    @property
    def slots(self) -> int:
        """Blocks in each pool."""
        return POOL_FACTOR * self.blocks

    @property
    def words(self) -> int:
        """8-byte words in a block."""
        return self.block // 8

    @property
    def step_bytes(self) -> int:
        return self.blocks * self.block


def parse_shape(text: str) -> Shape:
    """``KxSIZE`` with SIZE in bytes or with a K or M suffix: ``32x64K``, ``128x128K``, ``4x1M``."""
    m = re.fullmatch(r"(\d+)x(\d+)([KkMm]?)", text.strip())
    if not m:
        raise ValueError(f"shape {text!r}: write BLOCKSxSIZE, e.g. 32x64K or 128x128K")
    blocks, size = int(m.group(1)), int(m.group(2)) * {"": 1, "k": KiB, "m": MiB}[m.group(3).lower()]
    if blocks < 1 or size < 4 * KiB or size % (4 * KiB):
        raise ValueError(f"shape {text!r}: at least one block, each a multiple of 4 KiB")
    return Shape(blocks, size)


@dataclasses.dataclass
class Plan:
    """Which host slots go to which GPU slots at each step: (steps, K) arrays of slot numbers."""

    shape: Shape
    host: npt.NDArray[np.int64]
    gpu: npt.NDArray[np.int64]

    def segments(self, step: int) -> npt.NDArray[np.int64]:
        """Step ``step``'s (K, 3) rows of (dst offset, src offset, bytes), as ``copy_batch`` takes them."""
        b = self.shape.block
        return np.stack([self.gpu[step] * b, self.host[step] * b, np.full(self.shape.blocks, b, np.int64)], axis=1)


def make_plan(shape: Shape, steps: int, seed: int, contiguous: bool = False) -> Plan:
    """``steps`` steps of K distinct slots in each pool, drawn at random (``contiguous``: K
    consecutive slots from a random start in each, for one contiguous copy)."""
    rng = np.random.default_rng(seed)
    k, n = shape.blocks, shape.slots
    if contiguous:
        host = rng.integers(0, n - k + 1, steps)[:, None] + np.arange(k)
        gpu = rng.integers(0, n - k + 1, steps)[:, None] + np.arange(k)
    else:
        host = np.stack([rng.choice(n, k, replace=False) for _ in range(steps)])
        gpu = np.stack([rng.choice(n, k, replace=False) for _ in range(steps)])
    return Plan(shape, host.astype(np.int64), gpu.astype(np.int64))


def fill_pattern(host64: npt.NDArray[np.int64]) -> None:
    """Every word of a (slots, words) host pool as ``slot << 40 | word``: a block copied from
    another slot, or shifted, differs everywhere."""
    slots, words = host64.shape
    np.add(np.arange(slots, dtype=np.int64)[:, None] << 40, np.arange(words, dtype=np.int64)[None, :], out=host64)


def stamps(step: int, host_slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """What step ``step`` stamps into each of its host blocks: a block left from an earlier step,
    or copied from another slot, does not hold it."""
    return STAMP_TAG | (np.int64(step) << 24) | host_slots


def stamp_host(host64: npt.NDArray[np.int64], step: int, host_slots: npt.NDArray[np.int64]) -> None:
    """Stamp step ``step``'s number into its host blocks, once per 4 KiB (before its copies)."""
    host64[host_slots[:, None], np.arange(0, host64.shape[1], STAMP_WORDS)[None, :]] = stamps(step, host_slots)[:, None]


def expected_blocks(shape: Shape, step: int, host_slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """What step ``step``'s destination blocks must hold, as (K, words) int64 (numpy)."""
    exp = (host_slots[:, None] << 40) + np.arange(shape.words, dtype=np.int64)[None, :]
    exp[:, ::STAMP_WORDS] = stamps(step, host_slots)[:, None]
    return exp


class NumpyCheck:
    """Checks each step's destination blocks in a GPU pool mapped here (the sim's device
    regions are shared memfds), right after they landed."""

    def __init__(self, shape: Shape, gpu64: npt.NDArray[np.int64]) -> None:
        self.shape, self.gpu64 = shape, gpu64
        self.checked = self.wrong = 0

    def wait(self) -> None:
        """Nothing to wait for: `check` is done when it returns."""

    def check(self, step: int, plan: Plan) -> None:
        got = self.gpu64[plan.gpu[step]]
        bad = np.any(got != expected_blocks(self.shape, step, plan.host[step]), axis=1)
        self.checked += len(bad)
        self.wrong += int(np.count_nonzero(bad))

    def result(self) -> tuple[int, int]:
        return self.checked, self.wrong


class TorchCheck:
    """Checks each step's destination blocks on the GPU: a few elementwise kernels over the K
    blocks on a high-priority stream of their own, the count of wrong blocks kept on the GPU
    (read once, at the end), so a check costs the loop no synchronisation. The next step's
    copies wait for it (`wait`, before their clock starts), so they cannot overwrite blocks it
    has yet to read."""

    def __init__(self, shape: Shape, gpu_pool: Any, plan: Plan) -> None:
        import torch

        self.torch, self.shape = torch, shape
        self.gpu64 = gpu_pool.view(torch.int64).view(shape.slots, shape.words)
        self.stream = torch.cuda.Stream(priority=-100)  # the highest this GPU has
        self.words = torch.arange(shape.words, dtype=torch.int64, device=gpu_pool.device)
        # every step's slots on the GPU once, so a check uploads nothing
        self.host = torch.from_numpy(plan.host).to(gpu_pool.device)
        self.gpu = torch.from_numpy(plan.gpu).to(gpu_pool.device)
        self.wrong = torch.zeros((), dtype=torch.int64, device=gpu_pool.device)
        self.done: Any = None
        self.checked = 0
        torch.cuda.synchronize()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def check(self, step: int, plan: Plan) -> None:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            hs = self.host[step]
            got = self.gpu64.index_select(0, self.gpu[step])
            exp = (hs.unsqueeze(1) << 40) + self.words.unsqueeze(0)
            exp[:, ::STAMP_WORDS] = (hs | (STAMP_TAG | (step << 24))).unsqueeze(1)
            self.wrong += (got != exp).any(dim=1).sum()
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        self.checked += self.shape.blocks

    def result(self) -> tuple[int, int]:
        self.stream.synchronize()
        return self.checked, int(self.wrong.item())


# -- the decode loop ---------------------------------------------------------------------------------
def decode_loop(
    issue: Callable[[int], str],
    checker: NumpyCheck | TorchCheck,
    host64: npt.NDArray[np.int64],
    plan: Plan,
    warm: int,
    steps: int,
    interval_s: float,
    on_measure: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``warm`` unmeasured steps, then ``steps`` measured ones, one every ``interval_s``.

    Each step stamps its host blocks, waits for the last step's check, then (clock running)
    ``issue(step)``, which returns once every block has landed and names the path it took; then
    its blocks are checked. ``on_measure`` runs just before the first measured step (the lane
    counters' first reading)."""
    lat: list[float] = []
    paths: dict[str, int] = {}
    t_start = t_end = 0.0
    tick = time.perf_counter()
    for step in range(warm + steps):
        stamp_host(host64, step, plan.host[step])
        if step == warm:
            if on_measure is not None:
                on_measure()
            t_start = time.monotonic()
        tick += interval_s
        gap = tick - time.perf_counter()
        if gap > 0:
            time.sleep(gap)
        else:
            tick -= gap  # late (a slow step): the cadence starts again from now, with no catching up
        checker.wait()
        t0 = time.perf_counter()
        path = issue(step)
        took = (time.perf_counter() - t0) * 1e6
        checker.check(step, plan)
        if step >= warm:
            lat.append(took)
            paths[path] = paths.get(path, 0) + 1
    t_end = time.monotonic()
    checked, wrong = checker.result()
    return {
        "lat_us": lat,
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "paths": paths,
        "checked": checked,
        "wrong": wrong,
        "window": (t_start, t_end),
        "steps": steps,
        "warm_steps": warm,
    }


def lane_reading(c: priod.SyncClient) -> dict[str, int]:
    """The daemon's bytes so far on GPU 0's lanes, per direction."""
    lanes = c.status()["lane_bytes"]
    return {d: int(lanes.get(f"gpu0/{d}", 0)) for d in DIRECTIONS}


def priod_steps(
    c: priod.SyncClient,
    gpu: priod.Region,
    host: priod.Region,
    checker: NumpyCheck | TorchCheck,
    plan: Plan,
    warm: int,
    steps: int,
    interval_s: float,
    copy_path: str,
    timeout: float,
) -> dict[str, Any]:
    """The priod row's decode loop: one urgent ``copy_batch`` per step through the public API,
    and the daemon's lane counters over the measured steps (its bulk, and any urgent step it made)."""
    assert host.array is not None
    host64 = host.array.view(np.int64).reshape(plan.shape.slots, plan.shape.words)
    fill_pattern(host64)
    segments = [plan.segments(i) for i in range(warm + steps)]
    path: Any = None if copy_path == "auto" else copy_path
    daemon_bytes = 0

    def issue(step: int) -> str:
        nonlocal daemon_bytes
        r = c.copy_batch(gpu, host, segments[step], priority="urgent", path=path, timeout=timeout)
        if step >= warm and r.path != "direct":
            daemon_bytes += r.nbytes  # the daemon counted these on its h2d lane beside the bulk
        return str(r.path)

    before: dict[str, int] = {}
    out = decode_loop(issue, checker, host64, plan, warm, steps, interval_s, lambda: before.update(lane_reading(c)))
    out["lane_bytes"] = (before, lane_reading(c))
    out["daemon_urgent_bytes"] = daemon_bytes
    return out


# -- GEMMs ------------------------------------------------------------------------------------------
class GemmLoop:
    """bf16 n x n GEMMs back to back on a stream of their own, on a thread, while resumed.

    One batch always waits queued behind the one running, so the SMs never idle between
    synchronisations; each batch's end is recorded (CLOCK_MONOTONIC, comparable across
    processes), so the rate over any window can be read afterwards (`rate`)."""

    PER_BATCH = 4

    def __init__(self, n: int) -> None:
        import torch

        self.torch, self.n = torch, n
        self.stream = torch.cuda.Stream()  # default priority: below the copies' and the checks'
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
            self.b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
            self.c = torch.empty_like(self.a)
            torch.matmul(self.a, self.b, out=self.c)  # cuBLAS set-up, outside the figures
        self.stream.synchronize()
        self.records: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._run, self._idle = threading.Event(), threading.Event()
        self._idle.set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="gemm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch, done, prev = self.torch, 0, None
        torch.cuda.set_device(self.stream.device)  # a new thread has no current context: cuBLAS would warn
        with torch.cuda.stream(self.stream):  # this thread's current stream
            while not self._stop:
                with self._lock:
                    running = self._run.is_set()
                    if running:
                        self._idle.clear()
                if not running:
                    if prev is not None:
                        prev.synchronize()
                        done += self.PER_BATCH
                        self.records.append((time.monotonic(), done))
                        prev = None
                    self._idle.set()
                    self._run.wait(0.1)
                    continue
                for _ in range(self.PER_BATCH):
                    torch.matmul(self.a, self.b, out=self.c)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                if prev is not None:
                    prev.synchronize()
                    done += self.PER_BATCH
                    self.records.append((time.monotonic(), done))
                prev = ev
            if prev is not None:
                prev.synchronize()
        self._idle.set()

    def resume(self) -> None:
        self._run.set()

    def pause(self) -> None:
        """Stop issuing GEMMs; returns once the last batch has ended."""
        with self._lock:
            self._run.clear()
        self._idle.wait()

    def rate(self, t0: float, t1: float) -> dict[str, float]:
        """TFLOP/s of the batches that ended within [t0, t1], from the first such end to the last."""
        inside = [(t, g) for t, g in list(self.records) if t0 <= t <= t1]
        if len(inside) < 2:
            return {"tflops": math.nan, "gemms": 0, "seconds": 0.0}
        seconds, gemms = inside[-1][0] - inside[0][0], inside[-1][1] - inside[0][1]
        return {"tflops": 2 * self.n**3 * gemms / seconds / 1e12, "gemms": gemms, "seconds": seconds}

    def alone(self, seconds: float) -> dict[str, float]:
        """The rate with nothing else running (the GEMM-only phase), after a short settle."""
        self.resume()
        time.sleep(0.5)  # clocks up, the first batches out of the figure
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
        self.pause()
        return self.rate(t0, t1)

    def close(self) -> None:
        self._stop = True
        self._run.set()
        self._thread.join(timeout=30)


def gemm_process(n: int, cmd_q: Any, res_q: Any) -> None:
    """The "other" GEMM variant: a `GemmLoop` in a process (a CUDA context) of its own, as an
    inference job beside priod; paused until told, answering ``(command, args)`` on its queues."""
    _dump_stacks_later()
    try:
        loop = GemmLoop(n)
    except Exception as exc:
        res_q.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    res_q.put({"ready": True})
    while True:
        cmd, args = cmd_q.get()
        if cmd == "stop":
            loop.close()
            res_q.put({"stopped": True})
            return
        res_q.put(getattr(loop, cmd)(*args))


class RemoteGemm:
    """The GEMM process seen from the main process: the `GemmLoop` calls, over its queues."""

    def __init__(self, proc: BaseProcess, cmd_q: Any, res_q: Any) -> None:
        self.proc, self.cmd_q, self.res_q = proc, cmd_q, res_q

    def call(self, cmd: str, *args: Any) -> Any:
        self.cmd_q.put((cmd, args))
        return get_result(self.res_q, [self.proc], 300)


@contextmanager
def other_gemms(n: int) -> Iterator[RemoteGemm]:
    """The GEMM process for the block, started, ready (its cuBLAS set up) and paused."""
    cmd_q, res_q = SPAWN.Queue(), SPAWN.Queue()
    with child(gemm_process, n, cmd_q, res_q) as p:
        first = get_result(res_q, [p], 300)
        if "error" in first:
            raise RuntimeError(f"the GEMM process failed: {first['error']}")
        g = RemoteGemm(p, cmd_q, res_q)
        log(f"GEMM process: {n}^3 bf16, ready")
        yield g
        g.call("stop")


# -- the decode process (cuda) ---------------------------------------------------------------------------
class CudaDecode:
    """The decode process's side of every cuda row: its pools, its high-priority copy stream, its
    GEMM thread (the "same" variant), the in-process raw bandwidth."""

    def __init__(self, shapes: list[Shape], gemm_n: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch sees no CUDA GPU here; --backend sim runs without one")
        from priod.common.cuda.batched import BatchedDma
        from priod.common.cuda.driver import bindings, check

        torch.cuda.set_device(0)
        self.torch, self.check_rc = torch, check
        self.rt, _ = bindings()
        self.kinds = {
            "h2d": self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            "d2h": self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
        }
        self.stream = torch.cuda.Stream(priority=-100)  # the highest this GPU has
        self.stream_t = self.rt.cudaStream_t(self.stream.cuda_stream)
        # one batched call per step, as a user's own cuMemcpyBatchAsync would be
        self.batched = BatchedDma(call_segments=max(s.blocks for s in shapes))
        self.gemm_n = gemm_n
        self._gemm: GemmLoop | None = None
        # per shape: the GPU pool (a tensor of PyTorch's allocator, as a KV cache is) and a pinned host pool
        self.pools: dict[Shape, tuple[Any, Any]] = {}
        for s in shapes:
            gpu = torch.zeros(s.slots * s.block, dtype=torch.uint8, device="cuda")
            host = torch.empty(s.slots * s.block, dtype=torch.uint8, pin_memory=True)
            fill_pattern(host.numpy().view(np.int64).reshape(s.slots, s.words))
            self.pools[s] = (gpu, host)
        torch.cuda.synchronize()

    def hello(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "batched_dma_error": self.batched.error,
        }

    def gemm(self) -> GemmLoop:
        if self._gemm is None:
            self._gemm = GemmLoop(self.gemm_n)
        return self._gemm

    def gemm_alone(self, seconds: float) -> dict[str, float]:
        return self.gemm().alone(seconds)

    def raw_bulk(self, nbytes: int) -> dict[str, float]:
        """Raw cudaMemcpyAsync GB/s, both directions at once (they share the host's PCIe and
        memory, so each alone would overstate what bulk can have), each on a low-priority stream:
        three copies of ``nbytes`` each way after a pass over the fresh memory, timed by events."""
        torch = self.torch
        streams = {d: torch.cuda.Stream() for d in DIRECTIONS}
        bufs = {
            d: (
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
            )
            for d in DIRECTIONS
        }

        def submit(d: str) -> None:
            host, dev = bufs[d]
            dst, src = (dev, host) if d == "h2d" else (host, dev)
            t = self.rt.cudaStream_t(streams[d].cuda_stream)
            self.check_rc(self.rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, self.kinds[d], t))

        for _ in range(2):
            for d in DIRECTIONS:
                submit(d)
        torch.cuda.synchronize()
        marks = {}
        for d in DIRECTIONS:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(streams[d])
            for _ in range(3):
                submit(d)
            end.record(streams[d])
            marks[d] = (start, end)
        out = {}
        for d, (start, end) in marks.items():
            end.synchronize()
            out[d] = 3 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9
        return out

    def row(
        self,
        shape: Shape,
        form: str,
        gemm_same: bool,
        steps: int,
        warm: int,
        interval_s: float,
        seed: int,
        socket: str | None = None,
        copy_path: str = "auto",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """One row's decode loop; with ``gemm_same`` the GEMM thread runs throughout (its rate
        over the measured steps comes back under ``gemm_rate``)."""
        torch = self.torch
        plan = make_plan(shape, warm + steps, seed, contiguous=form == "contig")
        gpu, host = self.pools[shape]
        gpu.zero_()  # no block of an earlier row can pass for this one's
        checker = TorchCheck(shape, gpu, plan)
        gemm = self.gemm() if gemm_same else None
        if gemm is not None:
            gemm.resume()
        try:
            if form == "priod":
                assert socket is not None
                with priod.SyncClient(socket, name="decode") as c:
                    hregion = c.alloc_host(shape.slots * shape.block)
                    gregion = c.register_device(gpu)
                    try:
                        out = priod_steps(
                            c, gregion, hregion, checker, plan, warm, steps, interval_s, copy_path, timeout
                        )
                    finally:
                        c.free(gregion)
                        c.free(hregion)
            else:
                host64 = host.numpy().view(np.int64).reshape(shape.slots, shape.words)
                fill_pattern(host64)
                out = decode_loop(
                    self._issuer(shape, form, plan, gpu, host), checker, host64, plan, warm, steps, interval_s
                )
        finally:
            if gemm is not None:
                gemm.pause()
        if gemm is not None:
            out["gemm_rate"] = gemm.rate(*out["window"])
        torch.cuda.synchronize()
        return out

    def _issuer(self, shape: Shape, form: str, plan: Plan, gpu: Any, host: Any) -> Callable[[int], str]:
        """The step's copies in this process's own context, on its high-priority stream, then a
        wait for the stream: per block, as one batched call, or one contiguous copy. What each
        call needs is worked out before the clock starts, as a decode loop's block table is."""
        rt, check, kind, stream_t, stream = self.rt, self.check_rc, self.kinds["h2d"], self.stream_t, self.stream
        gbase, hbase, b = gpu.data_ptr(), host.data_ptr(), shape.block
        if form == "loop":
            pointers = [
                list(zip((plan.gpu[i] * b + gbase).tolist(), (plan.host[i] * b + hbase).tolist(), strict=True))
                for i in range(len(plan.host))
            ]

            def loop(step: int) -> str:
                for d, s in pointers[step]:
                    check(rt.cudaMemcpyAsync(d, s, b, kind, stream_t))
                stream.synchronize()
                return "cudaMemcpyAsync"

            return loop
        if form == "batched":
            offsets = [
                ((plan.gpu[i] * b).astype(np.uint64), (plan.host[i] * b).astype(np.uint64))
                for i in range(len(plan.host))
            ]
            sizes = np.full(shape.blocks, b, dtype=np.uint64)
            batched = self.batched

            def batch(step: int) -> str:
                d_offs, s_offs = offsets[step]
                batched.copy(gbase, hbase, d_offs, s_offs, sizes, kind, stream_t)
                stream.synchronize()
                return "cuMemcpyBatchAsync" if batched.error is None else "loop (no batched call)"

            return batch
        starts = [(int(plan.gpu[i, 0]) * b + gbase, int(plan.host[i, 0]) * b + hbase) for i in range(len(plan.host))]
        n = shape.step_bytes

        def contig(step: int) -> str:
            d, s = starts[step]
            check(rt.cudaMemcpyAsync(d, s, n, kind, stream_t))
            stream.synchronize()
            return "cudaMemcpyAsync"

        return contig

    def close(self) -> None:
        if self._gemm is not None:
            self._gemm.close()


def decode_process(shapes: list[Shape], gemm_n: int, cmd_q: Any, res_q: Any) -> None:
    """The decode process: a `CudaDecode`, answering ``(method, kwargs)`` on its queues; an
    error comes back as ``{"error": traceback}`` rather than leaving the parent waiting."""
    _dump_stacks_later()
    try:
        dec = CudaDecode(shapes, gemm_n)
    except Exception as exc:
        res_q.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    res_q.put({"ready": True})
    while True:
        cmd, kwargs = cmd_q.get()
        if cmd == "stop":
            dec.close()
            res_q.put({"stopped": True})
            return
        try:
            res_q.put(getattr(dec, cmd)(**kwargs))
        except Exception:
            res_q.put({"error": traceback.format_exc()})


class RemoteDecode:
    """The decode process seen from the main process."""

    def __init__(self, proc: BaseProcess, cmd_q: Any, res_q: Any) -> None:
        self.proc, self.cmd_q, self.res_q = proc, cmd_q, res_q

    def call(self, cmd: str, **kwargs: Any) -> Any:
        self.cmd_q.put((cmd, kwargs))
        out = get_result(self.res_q, [self.proc], 600)
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(f"the decode process failed in {cmd}: {out['error']}")
        return out


# -- the anchor's bulk process -------------------------------------------------------------------------
def anchor_bulk_process(nbytes: int, ready: Any, stop: Any, q: Any) -> None:
    """The anchor's bulk: ``nbytes`` cudaMemcpyAsync copies back to back both ways, two queued
    each way on low-priority streams, in this process's own CUDA context until ``stop``; reports
    when each one ended (CLOCK_MONOTONIC) per direction."""
    _dump_stacks_later()
    import torch

    from priod.common.cuda.driver import bindings, check

    rt, _ = bindings()
    kinds = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost}
    streams = {d: torch.cuda.Stream() for d in DIRECTIONS}
    bufs = {
        d: (
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        )
        for d in DIRECTIONS
    }

    def submit(d: str) -> Any:
        host, dev = bufs[d]
        dst, src = (dev, host) if d == "h2d" else (host, dev)
        check(
            rt.cudaMemcpyAsync(
                dst.data_ptr(), src.data_ptr(), nbytes, kinds[d], rt.cudaStream_t(streams[d].cuda_stream)
            )
        )
        ev = torch.cuda.Event()
        ev.record(streams[d])
        return ev

    for _ in range(2):  # the first passes over fresh memory are slow: keep them out of the figures
        for d in DIRECTIONS:
            submit(d).synchronize()
    ready.set()
    pending: dict[str, list[Any]] = {d: [] for d in DIRECTIONS}
    done: dict[str, list[tuple[float, int]]] = {d: [] for d in DIRECTIONS}
    while True:
        stopping = stop.is_set()
        for d in DIRECTIONS:
            while pending[d] and pending[d][0].query():
                pending[d].pop(0)
                done[d].append((time.monotonic(), nbytes))
            while not stopping and len(pending[d]) < 2:
                pending[d].append(submit(d))
        if stopping and not any(pending.values()):
            break
        time.sleep(0.0005)  # a copy takes milliseconds: this only blurs when one ended
    q.put(done)


# -- rows -------------------------------------------------------------------------------------------
def finish_row(r: dict[str, Any], shape: Shape, interval_s: float) -> dict[str, Any]:
    """The urgent rate over the measured steps, and the window's length."""
    t0, t1 = r["window"]
    r["window_s"] = t1 - t0
    r["urgent_gbps"] = r["steps"] * shape.step_bytes / (t1 - t0) / 1e9 if t1 > t0 else math.nan
    r["interval_s"] = interval_s
    return r


def priod_bulk_rates(r: dict[str, Any]) -> dict[str, float]:
    """Bulk GB/s per direction over the measured steps from the daemon's lane counters; urgent
    steps the daemon made are among its h2d bytes and come out (direct ones never were)."""
    before, after = r["lane_bytes"]
    seconds = r["window_s"]
    return {
        d: (after[d] - before[d] - (r["daemon_urgent_bytes"] if d == "h2d" else 0)) / seconds / 1e9 for d in DIRECTIONS
    }


def run_cuda(args: argparse.Namespace, shapes: list[Shape], results: dict[str, Any], save: Callable[[], None]) -> None:
    """GEMM-only, idle, the anchor rows (their bulk process running throughout), then the priod
    rows (one daemon, its bulk clients running throughout)."""
    rows: list[dict[str, Any]] = results["rows"]
    interval = args.interval_ms / 1e3
    warm = max(1, round(args.warm_s / interval))
    bulk = args.bulk_mib * MiB
    gemms = [g for g in args.gemm.split(",") if g != "none"]
    seeds = iter(range(1, 1_000_000))

    def new_row(name: str, shape: Shape, gemm: str) -> dict[str, Any]:
        r: dict[str, Any] = {"row": name, "form": ROWS[name], "shape": shape.label, "gemm": gemm}
        rows.append(r)
        return r

    def run_row(
        dec: RemoteDecode, name: str, shape: Shape, gemm: str, g: RemoteGemm | None, socket: str | None = None
    ) -> dict[str, Any]:
        log(f"{name} {shape.label} gemm {gemm}")
        if gemm == "other":
            assert g is not None
            g.call("resume")
        try:
            out = dec.call(
                "row",
                shape=shape,
                form=ROWS[name],
                gemm_same=gemm == "same",
                steps=args.steps if name in LOADED_ROWS else args.idle_steps,
                warm=warm if name in LOADED_ROWS else min(warm, 20),
                interval_s=interval,
                seed=next(seeds),
                socket=socket,
                copy_path=args.copy_path,
                timeout=args.timeout,
            )
        finally:
            if gemm == "other":
                assert g is not None
                g.call("pause")
        if gemm == "other":
            assert g is not None
            out["gemm_rate"] = g.call("rate", *out["window"])
        r = new_row(name, shape, gemm)
        r.update(finish_row(out, shape, interval))
        log(
            f"  p50 {r['p50']:.0f} p99 {r['p99']:.0f} us, paths {r['paths']}, checked {r['checked']} wrong {r['wrong']}"
        )
        save()
        return r

    cmd_q, res_q = SPAWN.Queue(), SPAWN.Queue()
    with child(decode_process, shapes, args.gemm_n, cmd_q, res_q) as dp:
        first = get_result(res_q, [dp], 300)
        if "error" in first:
            # what is missing (no GPU, no CUDA in PyTorch), said plainly rather than as a traceback
            print(f"bench_serving.py: the decode process could not start: {first['error']}", file=sys.stderr)
            raise SystemExit(2)
        dec = RemoteDecode(dp, cmd_q, res_q)
        results["device"] = dec.call("hello")
        log(f"decode process ready: {results['device']}")
        with ExitStack() as stack:
            g = stack.enter_context(other_gemms(args.gemm_n)) if "other" in gemms else None
            # GEMM-only first: each variant with nothing else running
            if g is not None:
                log("GEMM-only: other process")
                results["gemm_alone"]["other"] = g.call("alone", args.gemm_s)
            if "same" in gemms:
                log("GEMM-only: decode process's thread")
                results["gemm_alone"]["same"] = dec.call("gemm_alone", seconds=args.gemm_s)
            log(f"GEMM alone: {results['gemm_alone']}")
            results["raw_gbps"] = dec.call("raw_bulk", nbytes=bulk)
            log(f"raw cudaMemcpyAsync both ways at once: {results['raw_gbps']}")
            save()
            if not args.skip_idle:
                for shape in shapes:
                    for name in ("idle", "idle-batched", "idle-contig"):
                        run_row(dec, name, shape, "none", None)
            anchors = [r for r in args.rows.split(",") if r in ("anchor", "anchor-batched")]
            if anchors:
                ready, stop, bq = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
                anchor_rows = []
                with child(anchor_bulk_process, bulk, ready, stop, bq) as bp:
                    wait_ready(ready, [bp], "the anchor's bulk process")
                    time.sleep(args.warm_s)
                    for shape in shapes:
                        for gemm in gemms or ["none"]:
                            for name in anchors:
                                anchor_rows.append(run_row(dec, name, shape, gemm, g))
                    stop.set()
                    done = get_result(bq, [bp], 120)
                for r in anchor_rows:
                    t0, t1 = r["window"]
                    r["bulk_gbps"] = {d: throughput_between(done[d], t0, t1)["gbps"] for d in DIRECTIONS}
                results["anchor_bulk_process_gbps"] = {
                    d: throughput_between(done[d], 0.0, math.inf)["gbps"] for d in DIRECTIONS
                }
                save()
        if "priod" in args.rows.split(","):
            priod_section(args, shapes, gemms, results, save, dec, run_row)
        dec.call("stop")


def priod_section(
    args: argparse.Namespace,
    shapes: list[Shape],
    gemms: list[str],
    results: dict[str, Any],
    save: Callable[[], None],
    dec: RemoteDecode | None,
    run_row: Callable[..., dict[str, Any]],
) -> None:
    """One daemon, a bulk client process per direction streaming --bulk-mib copies (two
    outstanding) through it for the whole section, then the priod rows (the GEMM process, where
    there is one, started once the daemon listens, as a job would after a system service)."""
    env = {"PRIOD_LOG__LEVEL": '"warning"', **settings_env(args.set)}
    log(f"priod: starting the daemon ({args.backend})")
    with daemon_process(env, backend=args.backend, start_timeout=180) as dmn, ExitStack() as stack:
        g = stack.enter_context(other_gemms(args.gemm_n)) if "other" in gemms else None
        sc = stack.enter_context(priod.SyncClient(dmn.socket_path, copy_path="daemon", name="bench"))
        bulks = {d: BulkProcess(dmn.socket_path, args.bulk_mib * MiB, 2, d, name=f"bulk-{d}") for d in DIRECTIONS}
        try:
            for b in bulks.values():
                b.wait_ready(timeout=180)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(lane_reading(sc).values()):
                time.sleep(0.05)
            time.sleep(args.warm_s)
            if args.backend == "sim":
                # No cudaMemcpyAsync here: the reference is the sim's bulk alone, through the daemon.
                b0, t0 = lane_reading(sc), time.monotonic()
                time.sleep(args.sim_raw_s)
                b1, t1 = lane_reading(sc), time.monotonic()
                results["raw_gbps"] = {d: (b1[d] - b0[d]) / (t1 - t0) / 1e9 for d in DIRECTIONS}
                results["raw_note"] = "sim: bulk alone through the daemon"
            priod_rows = []
            for shape in shapes:
                for gemm in gemms or ["none"]:
                    if dec is None:
                        priod_rows.append(sim_row(args, shape, dmn.socket_path, results, save))
                    else:
                        priod_rows.append(run_row(dec, "priod", shape, gemm, g, socket=dmn.socket_path))
            results["daemon_status"] = sc.status()
            outs = {d: b.stop(timeout=args.timeout + 60) for d, b in bulks.items()}
        finally:
            for b in bulks.values():
                b.kill()
    for d, out in outs.items():
        if out.get("errors"):
            raise RuntimeError(f"the {d} bulk client had errors: {out['errors'][:3]}")
    for r in priod_rows:
        r["bulk_gbps"] = priod_bulk_rates(r)
        t0, t1 = r["window"]
        r["bulk_client_gbps"] = {d: throughput_between(outs[d]["done"], t0, t1)["gbps"] for d in DIRECTIONS}
    save()


def sim_row(
    args: argparse.Namespace, shape: Shape, socket: str, results: dict[str, Any], save: Callable[[], None]
) -> dict[str, Any]:
    """The priod row on the sim engine, in this process: device regions are shared memfds, so
    the blocks are checked with numpy straight after they land."""
    interval = args.interval_ms / 1e3
    warm = max(1, round(args.warm_s / interval))
    log(f"priod {shape.label} (sim)")
    plan = make_plan(shape, warm + args.steps, seed=len(results["rows"]) + 1)
    with priod.SyncClient(socket, name="decode") as c:
        host = c.alloc_host(shape.slots * shape.block)
        gpu = c.alloc_device(shape.slots * shape.block)
        assert gpu.array is not None
        checker = NumpyCheck(shape, gpu.array.view(np.int64).reshape(shape.slots, shape.words))
        out = priod_steps(c, gpu, host, checker, plan, warm, args.steps, interval, args.copy_path, args.timeout)
    r: dict[str, Any] = {"row": "priod", "form": "priod", "shape": shape.label, "gemm": "none"}
    r.update(finish_row(out, shape, interval))
    results["rows"].append(r)
    log(f"  p50 {r['p50']:.0f} p99 {r['p99']:.0f} us, paths {r['paths']}, checked {r['checked']} wrong {r['wrong']}")
    save()
    return r


# -- the table ------------------------------------------------------------------------------------
def fmt(v: float | None, spec: str, width: int) -> str:
    """``v`` formatted, or blanks where there is no figure."""
    return f"{v:{width}{spec}}" if v is not None and math.isfinite(v) else " " * width


def paths_text(paths: dict[str, int]) -> str:
    short = {"cudaMemcpyAsync": "own", "cuMemcpyBatchAsync": "own-batch"}
    return " ".join(f"{short.get(p, p)}:{n}" for p, n in sorted(paths.items(), key=lambda kv: -kv[1]))


def idle_contig(results: dict[str, Any], shape: str) -> dict[str, Any] | None:
    return next((r for r in results["rows"] if r["row"] == "idle-contig" and r["shape"] == shape), None)


def p99_target(results: dict[str, Any], r: dict[str, Any]) -> tuple[float | None, str]:
    """A loaded row's p99 bound and how it was set: 300 us for 32x64K; for any other shape, 2 x
    the idle p50 of one contiguous copy of the step's bytes (128x128K: 16 MiB), measured in this run."""
    if r["shape"] == "32x64K":
        return P99_US_32X64K, f"{P99_US_32X64K:.0f} us"
    ref = idle_contig(results, r["shape"])
    if ref is None or not math.isfinite(ref["p50"]):
        return None, "no idle-contig row"
    return 2 * ref["p50"], f"2 x idle-contig p50 {ref['p50']:.0f} = {2 * ref['p50']:.0f} us"


def anchor_gemm(results: dict[str, Any], r: dict[str, Any]) -> float | None:
    """The GEMMs' TFLOP/s in the anchor row of ``r``'s shape and GEMM variant (the per-block
    one, else the batched one): the same decode loop, checks and bulk both ways, without priod."""
    for name in ("anchor", "anchor-batched"):
        for a in results["rows"]:
            if (a["row"], a["shape"], a["gemm"]) == (name, r["shape"], r["gemm"]) and "gemm_rate" in a:
                return float(a["gemm_rate"]["tflops"])
    return None


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def render(results: dict[str, Any]) -> str:
    """The table: the targets in its header line, a line per row, the references, each priod
    row's verdicts."""
    raw = results.get("raw_gbps") or {}
    raw_sum = sum(raw.values()) if raw else math.nan
    alone = results.get("gemm_alone", {})
    args = results.get("args", {})
    lines = [
        f"serving: K scattered blocks reloaded h2d every {args.get('interval_ms', 5):g} ms beside bulk both ways; "
        f"targets: step p99 <= {P99_US_32X64K:.0f} us for 32x64K beside GEMMs, other shapes p99 <= 2 x one contiguous copy of "
        f"the step's bytes idle (128x128K: 16 MiB); link (bulk + urgent) >= {LINK_TARGET} of raw; GEMM TFLOP/s with priod "
        f">= {GEMM_TARGET} of alone",
        f"{'shape':<9} {'row':<15} {'gemm':<5} {'steps':>5} {'p50 us':>8} {'p99 us':>8} {'paths':<22} {'h2d GB/s':>8} "
        f"{'d2h GB/s':>8} {'x raw':>6} {'link':>6} {'TFLOP/s':>7} {'x alone':>7} {'x anch':>6} {'checked':>8} {'wrong':>5}  p99 target",
    ]
    for r in results["rows"]:
        bulk = r.get("bulk_gbps")
        both = sum(bulk.values()) if bulk else None
        xraw = both / raw_sum if both is not None and raw_sum else None
        link = (both + r["urgent_gbps"]) / raw_sum if both is not None and raw_sum else None
        gemm = r.get("gemm_rate", {}).get("tflops")
        base = alone.get(r["gemm"], {}).get("tflops")
        xalone = gemm / base if gemm is not None and base else None
        anchor = anchor_gemm(results, r) if r["row"] == "priod" else None
        xanchor = gemm / anchor if gemm is not None and anchor else None
        target = ""
        if r["row"] in LOADED_ROWS:
            bound, _ = p99_target(results, r)
            target = "" if bound is None else verdict(r["p99"] <= bound)
        lines.append(
            f"{r['shape']:<9} {r['row']:<15} {r['gemm']:<5} {r['steps']:>5} {r['p50']:8.1f} {r['p99']:8.1f} "
            f"{paths_text(r['paths']):<22} {fmt(bulk and bulk['h2d'], '.1f', 8)} {fmt(bulk and bulk['d2h'], '.1f', 8)} "
            f"{fmt(xraw, '.3f', 6)} {fmt(link, '.3f', 6)} {fmt(gemm, '.0f', 7)} {fmt(xalone, '.3f', 7)} {fmt(xanchor, '.3f', 6)} "
            f"{r['checked']:>8} {r['wrong']:>5}  {target}"
        )
    if raw:
        what = results.get("raw_note", "raw cudaMemcpyAsync, both ways at once, in-process")
        lines.append(f"{what}: " + ", ".join(f"{d} {v:.1f} GB/s" for d, v in raw.items()))
    if alone:
        lines.append(
            "GEMMs alone (GEMM-only phase): "
            + ", ".join(f"{k} {v['tflops']:.0f} TFLOP/s" for k, v in alone.items() if "tflops" in v)
        )
    if results.get("anchor_bulk_process_gbps"):
        ab = results["anchor_bulk_process_gbps"]
        lines.append(
            "anchor's bulk process over its whole run: " + ", ".join(f"{d} {v:.1f} GB/s" for d, v in ab.items())
        )
    dev = results.get("device", {})
    if dev.get("gpu"):
        lines.append(
            f"device: {dev['gpu']}, torch {dev.get('torch')}, priod {results.get('priod')}, {results.get('date')}"
        )
    err = dev.get("batched_dma_error")
    if err:
        lines.append(f"NOTE: the batched rows ran one cudaMemcpyAsync per block: {err}")
    targets = []
    for r in results["rows"]:
        if r["row"] != "priod":
            continue
        head = f"{r['shape']} priod gemm {r['gemm']}:"
        bound, how = p99_target(results, r)
        if bound is not None:
            targets.append(f"{head} p99 {r['p99']:.0f} <= {how}: {verdict(r['p99'] <= bound)}")
        bulk = r.get("bulk_gbps")
        if bulk and raw_sum:
            link = (sum(bulk.values()) + r["urgent_gbps"]) / raw_sum
            targets.append(f"{head} link {link:.3f} >= {LINK_TARGET}: {verdict(link >= LINK_TARGET)}")
        gemm = r.get("gemm_rate", {}).get("tflops")
        base = alone.get(r["gemm"], {}).get("tflops")
        if gemm is not None and base:
            anchor = anchor_gemm(results, r)
            beside = f" (x anchor {gemm / anchor:.3f})" if anchor else ""
            targets.append(
                f"{head} GEMMs {gemm:.0f} / alone {base:.0f} TFLOP/s = {gemm / base:.3f} >= {GEMM_TARGET}: "
                f"{verdict(gemm / base >= GEMM_TARGET)}{beside}"
            )
        targets.append(
            f"{head} blocks checked {r['checked']:,}, wrong {r['wrong']}: {verdict(r['wrong'] == 0 and r['checked'] > 0)}"
        )
    lines += ["targets:"] + [f"  {t}" for t in targets]
    lines.append(
        "paths: own = the decode process's own cudaMemcpyAsync (own-batch: one cuMemcpyBatchAsync); otherwise the "
        "result's .path of priod's copy_batch (direct: this process's own DMA while the daemon held bulk back; "
        "dma / express: made by the daemon); x raw: bulk both ways / raw both ways; link: (bulk + urgent) / raw; "
        "x alone: the GEMMs' rate / the GEMM-only phase's (same variant); x anch: / the anchor row's (same shape and "
        "variant: the same decode loop, its checks and bulk, no priod)"
    )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------
def missing_for_cuda() -> str | None:
    """What the cuda backend needs and this Python lacks (found without importing it), or None."""
    missing = [
        what
        for module, what in (
            ("torch", "PyTorch with CUDA (pip install torch)"),
            ("cuda.bindings", "cuda-bindings (pip install 'priod[cuda13]')"),
        )
        if importlib.util.find_spec(module.split(".")[0]) is None
        or (module == "cuda.bindings" and importlib.util.find_spec(module) is None)
    ]
    return f"needs {' and '.join(missing)}; --backend sim runs without a GPU" if missing else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--backend", choices=["cuda", "sim"], default="cuda", help="sim: the priod rows on the sim engine, no GPU"
    )
    ap.add_argument(
        "--shapes", default="32x64K,128x128K", help="K x block per step, comma-separated (default 32x64K,128x128K)"
    )
    ap.add_argument("--steps", type=int, default=1500, help="measured decode steps per loaded row (default 1500)")
    ap.add_argument("--idle-steps", type=int, default=200, help="measured steps per idle row (default 200)")
    ap.add_argument(
        "--warm-s",
        type=float,
        default=1.0,
        help="seconds bulk runs before a section's first row, and of unmeasured (checked) steps at each row's start (default 1)",
    )
    ap.add_argument("--interval-ms", type=float, default=5.0, help="one decode step every this many ms (default 5)")
    ap.add_argument(
        "--gemm",
        default="other,same",
        help="GEMM variants, comma-separated: other (a process of its own), same (a thread of the decode process), or none",
    )
    ap.add_argument("--gemm-n", type=int, default=8192, help="the GEMMs' matrices are n x n bf16 (default 8192)")
    ap.add_argument("--gemm-s", type=float, default=3.0, help="seconds of each GEMM-only measurement (default 3)")
    ap.add_argument("--rows", default="anchor,anchor-batched,priod", help="loaded rows, comma-separated")
    ap.add_argument(
        "--skip-idle", action="store_true", help="no idle rows (the non-32x64K targets then have no reference)"
    )
    ap.add_argument("--bulk-mib", type=int, default=None, help="each bulk copy's size (default 256; sim 16)")
    ap.add_argument(
        "--copy-path",
        choices=["auto", "daemon", "direct"],
        default="auto",
        help="the priod row's copy_batch path: auto (as shipped: direct where this process can), or forced",
    )
    ap.add_argument("--set", action="append", default=[], metavar="SECTION__KEY=VALUE", help="a daemon setting")
    ap.add_argument(
        "--timeout", type=float, default=30.0, help="seconds any one priod copy may take before the run fails"
    )
    ap.add_argument("--sim-raw-s", type=float, default=0.5, help="sim: seconds of bulk alone measured as the reference")
    ap.add_argument("--out", default="out/bench_serving")
    args = ap.parse_args()
    _dump_stacks_later()
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
        settings_env(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    rows = args.rows.split(",")
    if not set(rows) <= set(LOADED_ROWS):
        ap.error(f"--rows takes {', '.join(LOADED_ROWS)} (comma-separated)")
    gemms = args.gemm.split(",")
    if not set(gemms) <= {*GEMMS, "none"}:
        ap.error("--gemm takes other, same or none (comma-separated)")
    if args.backend == "sim":
        args.gemm, args.rows = "none", "priod"  # no GPU: no GEMMs, no cudaMemcpyAsync rows
    elif (why := missing_for_cuda()) is not None:
        print(f"bench_serving.py: the cuda backend {why}", file=sys.stderr)
        return 2
    if args.bulk_mib is None:
        args.bulk_mib = 16 if args.backend == "sim" else 256
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "priod": priod.__version__,
        "args": vars(args),
        "backend": args.backend,
        "gemm_alone": {},
        "rows": [],
    }

    def save() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as fp:
            json.dump(results, fp, indent=1, default=str)

    t0 = time.monotonic()
    if args.backend == "sim":
        priod_section(args, shapes, [], results, save, None, lambda *a, **k: {})
    else:
        run_cuda(args, shapes, results, save)
    results["seconds"] = time.monotonic() - t0
    table = render(results)
    results["table"] = table
    save()
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    print(table)
    wrong = sum(r["wrong"] for r in results["rows"])
    if wrong:
        print(f"bench_serving.py: {wrong} blocks landed wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
