#!/usr/bin/env python3
"""GPU benchmark of batched copies: scattered 64 KiB blocks, through priod and without it.

Rows (one direction, --direction, default h2d):
  in-process   no daemon, a CUDA context of this benchmark's own, idle GPU, back to back: the
               blocks as one ``cuMemcpyBatchAsync`` (priod's own `BatchedDma`, so the same call),
               as a loop of ``cudaMemcpyAsync`` per block, and the same bytes as one contiguous
               copy; client-observed (enqueue to stream synchronised), p50/p99.
  anchor       the same forms, 5 ms apart, while another process of the user's own streams
               --bulk-mib copies back to back, no daemon: copy engines time-slice between CUDA
               contexts, so this is the cheapest thing a user can do instead of running priod.
  priod-idle   through a cuda daemon (defaults, express on): the blocks as one urgent
               ``copy_batch`` and the same bytes as one contiguous urgent ``copy``, alternating.
  priod-bulk   the same while another process streams --bulk-mib bulk copies (2 outstanding)
               through the daemon. Target: batch p99 <= contiguous p99 + 100 us.
  direct       with --direct: the same forms as the measuring process's own copies
               (priod.client.direct), idle and under priod's bulk: a batch as DirectCopies chooses (the
               copy kernel or batched DMA, the faster of late; how often each is shown), and by
               the kernel alone and batched DMA alone (``batch_path``).
  bulk rates   raw (one in-process contiguous copy of --bulk-mib), the in-process batch of
               64 KiB blocks over the same bytes, the anchor's bulk process, priod's bulk stream of
               contiguous copies (beside the priod-bulk and direct rows), and priod's bulk stream
               of batches of 64 KiB blocks (2 outstanding, --bulk-s seconds, no co-tenant), each
               as GB/s and a fraction of raw. Target: priod's batches >= 0.9 of raw.
The anchor and priod rows run once per co-tenant (--cotenant, default none,gemm): "gemm" is a
process of its own running bf16 GEMMs back to back (bench_gpu.py's co-tenant), as the inference
server beside priod always is. xA: a row's ratio to the anchor's same form (a batch to the
anchor's cuMemcpyBatchAsync) with the same co-tenant; < 1 means priod wins.

    python scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3    # about 3 minutes
    python scripts/bench_gpu_batch.py --count 50 --bulk-s 3              # a quick look
    python scripts/bench_gpu_batch.py --backend sim --skip-inprocess --skip-anchor --cotenant none --count 5 --bulk-mib 64 --bulk-s 1   # dry run, no GPU

Needs a GPU, cuda-bindings and CuPy; PyTorch for the gemm co-tenant. Every copy has a timeout (--timeout) and every child
process a deadline, so a stuck GPU or daemon ends the run with an error instead of holding the
machine. Writes results.json under --out after each stage and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p
)

# scripts/ is this script's directory
from bench_gpu import (
    COTENANTS,
    GAP_ENV,
    SPAWN,
    child,
    cotenant,
    csv_choices,
    dma_bulk_process,
    get_result,
    log,
    pause,
    wait_ready,
    window_gbps,
)

import priod
from priod.testing import BulkProcess, daemon_process, percentile, throughput_between

KiB, MiB = 1 << 10, 1 << 20
INTERVAL_S = 0.005
"""Pause after each urgent copy or batch (as bench_gpu.py's rows)."""


def scattered(n: int, block: int, seed: int) -> npt.NDArray[np.int64]:
    """``n`` blocks between random distinct slots of two regions of ``2 n`` blocks."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [rng.choice(2 * n, n, replace=False) * block, rng.choice(2 * n, n, replace=False) * block, np.full(n, block)],
        axis=1,
    ).astype(np.int64)


def release(c: priod.SyncClient, *regions: Any) -> None:
    """Free regions on the way out without hiding the error that got us there (a region whose
    copy failed may still be busy: the daemon frees it with the connection)."""
    for region in regions:
        try:
            c.free(region)
        except priod.PriodError as exc:
            log(f"could not free {region!r}: {exc}")


def summary(us: list[float]) -> dict[str, float]:
    return {"p50": percentile(us, 50), "p99": percentile(us, 99), "n": len(us)}


# -- in-process: no daemon ------------------------------------------------------------------------------
class OwnBatch:
    """The blocks copied in a CUDA context of this process's own (CuPy buffers, a high-priority
    non-blocking stream): as one contiguous ``cudaMemcpyAsync``, as one ``cuMemcpyBatchAsync``
    (priod's own `BatchedDma`, so the same call), and as a loop of ``cudaMemcpyAsync`` per block."""

    FORMS = ("contiguous", "batch", "loop")

    def __init__(self, direction: str, blocks: int, block: int) -> None:
        import cupy as cp

        from priod.common.cuda.batched import BatchedDma
        from priod.common.cuda.driver import bindings, check

        self.cp, self.check = cp, check
        self.rt, _ = bindings()
        self.kind = (
            self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            if direction == "h2d"
            else self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        )
        _, high = check(self.rt.cudaDeviceGetStreamPriorityRange())
        self.stream = cp.cuda.Stream(non_blocking=True, priority=high)
        self.rt_stream = self.rt.cudaStream_t(self.stream.ptr)
        self.batched = BatchedDma()
        self.direction, self.blocks, self.block = direction, blocks, block
        size = 2 * blocks * block
        self._keep = cp.cuda.alloc_pinned_memory(size), cp.cuda.alloc(size)
        self.dst, self.src = self.ends(*self._keep)
        segs = scattered(blocks, block, seed=1).astype(np.uint64)
        self.d_offs, self.s_offs, self.sizes = segs[:, 0].copy(), segs[:, 1].copy(), segs[:, 2].copy()

    def ends(self, host: Any, dev: Any) -> tuple[int, int]:
        """(dst, src) pointers of a pinned host and a device allocation, in this direction."""
        return (dev.ptr, host.ptr) if self.direction == "h2d" else (host.ptr, dev.ptr)

    def enqueue(self, form: str) -> None:
        if form == "contiguous":
            self.check(self.rt.cudaMemcpyAsync(self.dst, self.src, self.blocks * self.block, self.kind, self.rt_stream))
        elif form == "batch":
            self.batched.copy(self.dst, self.src, self.d_offs, self.s_offs, self.sizes, self.kind, self.rt_stream)
        else:
            for d, s, n in zip(
                (self.d_offs + np.uint64(self.dst)).tolist(),
                (self.s_offs + np.uint64(self.src)).tolist(),
                self.sizes.tolist(),
                strict=True,
            ):
                self.check(self.rt.cudaMemcpyAsync(d, s, n, self.kind, self.rt_stream))

    def series(self, count: int, interval_s: float = 0.0) -> dict[str, dict[str, float]]:
        """The forms in turn, five unmeasured rounds then ``count``, ``interval_s`` after each
        copy; client-observed microseconds (enqueue to stream synchronised), p50/p99 per form."""
        lat: dict[str, list[float]] = {form: [] for form in self.FORMS}
        for i in range(5 + count):
            for form in self.FORMS:
                t0 = time.perf_counter()
                self.enqueue(form)
                self.stream.synchronize()
                if i >= 5:
                    lat[form].append((time.perf_counter() - t0) * 1e6)
                if interval_s:
                    pause(interval_s)
        return {k: summary(v) for k, v in lat.items()}


def inprocess(direction: str, blocks: int, block: int, count: int, bulk_mib: int, q: Any) -> None:
    """The in-process rows, in a spawned child with its own CUDA context; puts a dict on ``q``."""
    out: dict[str, Any] = {}
    try:
        own = OwnBatch(direction, blocks, block)
        cp, stream = own.cp, own.stream
        out["batch_dma_error"] = own.batched.error
        out["latency_us"] = own.series(count)

        # Bulk rates: one contiguous copy of bulk_mib (raw), and the same bytes as 64 KiB blocks
        # in one batched call, timed with events on the stream.
        nbytes = bulk_mib * MiB
        bdst, bsrc = own.ends(cp.cuda.alloc_pinned_memory(nbytes), cp.cuda.alloc(nbytes))
        nblk = nbytes // (64 * KiB)
        perm = np.random.default_rng(2).permutation(nblk).astype(np.uint64) * np.uint64(64 * KiB)
        order = np.arange(nblk, dtype=np.uint64) * np.uint64(64 * KiB)
        full = np.full(nblk, 64 * KiB, dtype=np.uint64)

        def gbps(enqueue: Any) -> float:
            best = 0.0
            for _ in range(3):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                enqueue()
                end.record(stream)
                end.synchronize()
                best = max(best, nbytes / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9)
            return best

        out["raw_gbps"] = gbps(lambda: own.check(own.rt.cudaMemcpyAsync(bdst, bsrc, nbytes, own.kind, own.rt_stream)))
        out["batch_bulk_gbps"] = gbps(lambda: own.batched.copy(bdst, bsrc, perm, order, full, own.kind, own.rt_stream))
        out["batch_dma_error_after"] = own.batched.error
    except Exception as exc:  # report it rather than leave the parent waiting
        out["error"] = f"{type(exc).__name__}: {exc}"
    q.put(out)


# -- the anchor: bulk in another process, no daemon ------------------------------------------------------
def anchor_measure(direction: str, blocks: int, block: int, count: int, q: Any) -> None:
    """The anchor's measuring process: the in-process forms with the daemon rows' pause after each."""
    out: dict[str, Any] = {}
    try:
        out["latency_us"] = OwnBatch(direction, blocks, block).series(count, INTERVAL_S)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    q.put(out)


def anchor_row(args: argparse.Namespace, cot: str) -> dict[str, Any]:
    """What a user can do without priod: its own batches while another process of its own streams
    --bulk-mib copies back to back (copy engines time-slice between contexts); the co-tenant
    ``cot`` runs throughout. Bulk GB/s over the measuring window."""
    log(f"anchor row, co-tenant {cot}")
    ready, stop, bulk_q, q = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue(), SPAWN.Queue()
    with child(dma_bulk_process, (args.direction,), args.bulk_mib * MiB, ready, stop, bulk_q) as bulk:
        wait_ready(ready, [bulk], "the bulk process")
        with (
            cotenant(cot, args.gemm_n) as ct,
            child(anchor_measure, args.direction, args.blocks, args.block_kib * KiB, args.count, q) as p,
        ):
            t0 = time.monotonic()
            out: dict[str, Any] = get_result(q, [p])
            t1 = time.monotonic()
        stop.set()
        done = get_result(bulk_q, [bulk], 120)
    out["cotenant"] = ct
    out["bulk_gbps"] = window_gbps(done[args.direction], t0, t1)
    return out


# -- through the daemon ---------------------------------------------------------------------------------
def urgent_rows(
    c: priod.SyncClient, direction: str, blocks: int, block: int, count: int, timeout: float
) -> dict[str, Any]:
    """Alternating: one urgent copy_batch of the blocks, one urgent contiguous copy of the same
    bytes; client-observed microseconds, and which path each took."""
    size = 2 * blocks * block
    h, d = c.alloc_host(size), c.alloc_device(size)
    try:
        assert h.array is not None
        h.array[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
        dst, src = (d, h) if direction == "h2d" else (h, d)
        segs = scattered(blocks, block, seed=4)
        lat: dict[str, list[float]] = {"batch": [], "contiguous": []}
        paths: dict[str, set[str]] = {"batch": set(), "contiguous": set()}
        daemon_us: dict[str, list[float]] = {"batch": [], "contiguous": []}
        queued_us: dict[str, list[float]] = {"batch": [], "contiguous": []}
        transfer_us: dict[str, list[float]] = {"batch": [], "contiguous": []}
        for i in range(5 + count):
            for name in ("batch", "contiguous"):
                t0 = time.perf_counter()
                if name == "batch":
                    r: Any = c.copy_batch(dst, src, segs, priority="urgent", timeout=timeout)
                else:
                    r = c.copy(dst, src, blocks * block, priority="urgent", timeout=timeout)
                took = (time.perf_counter() - t0) * 1e6
                if i >= 5:
                    lat[name].append(took)
                    paths[name].add(r.path)
                    daemon_us[name].append(r.total_us)
                    queued_us[name].append(r.queued_us)
                    transfer_us[name].append(r.transfer_us)
                pause(INTERVAL_S)
        return {
            "latency_us": {k: summary(v) for k, v in lat.items()},
            "daemon_total_us": {k: summary(v) for k, v in daemon_us.items()},
            "daemon_queued_us": {k: summary(v) for k, v in queued_us.items()},
            "daemon_transfer_us": {k: summary(v) for k, v in transfer_us.items()},
            "paths": {k: sorted(v) for k, v in paths.items()},
        }
    finally:
        release(c, h, d)


def direct_rows(c: priod.SyncClient, direction: str, blocks: int, block: int, count: int) -> dict[str, Any]:
    """The same alternation with direct copies (priod.client.direct): this process's own copies between
    its own CuPy buffers, one hold per batch or copy; a batch as `DirectCopies` chooses (the copy
    kernel or batched DMA, whichever was faster of late), by the kernel alone and by batched DMA
    alone; the last batches' bytes checked."""
    import cupy as cp

    from priod.client.direct import DirectCopies

    size = 2 * blocks * block
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8)
    page = c.hold_page()
    # a batch as DirectCopies chooses ("batch"), by the copy kernel alone, by batched DMA alone
    copies = {
        "batch": DirectCopies(page),
        "batch_kernel": DirectCopies(page, batch_path="kernel"),
        "batch_dma": DirectCopies(page, batch_path="dma"),
    }
    pairs = {k: d.pair(dev, host) if direction == "h2d" else d.pair(host, dev) for k, d in copies.items()}
    segs = scattered(blocks, block, seed=6)
    lat: dict[str, list[float]] = {"batch": [], "batch_kernel": [], "batch_dma": [], "contiguous": []}
    for i in range(5 + count):
        for name in lat:
            t0 = time.perf_counter()
            if name == "contiguous":
                pairs["batch"].copy(blocks * block)
            else:
                pairs[name].copy_batch(segs)
            if i >= 5:
                lat[name].append((time.perf_counter() - t0) * 1e6)
            pause(INTERVAL_S)
    if direction == "h2d":  # check the blocks landed where the table says, every way of copying
        for p in pairs.values():
            dev[:] = 0
            cp.cuda.Device().synchronize()  # the zeros go on CuPy's stream, not ordered before a direct copy's
            p.copy_batch(segs)
            got = cp.asnumpy(dev)
            for d_off, s_off, n in segs.tolist():
                assert np.array_equal(got[d_off : d_off + n], host[s_off : s_off + n]), "a direct batch's block differs"
    chosen = [dataclasses.asdict(e) for e in copies["batch"].path_estimates()]
    for d in copies.values():
        d.close()
    return {"latency_us": {k: summary(v) for k, v in lat.items()}, "chosen": chosen}


def batch_bulk(c: priod.SyncClient, direction: str, bulk_mib: int, seconds: float, timeout: float) -> dict[str, Any]:
    """Bulk batches of 64 KiB blocks (each --bulk-mib of them), two outstanding, for ``seconds``;
    GB/s between the first and the last completion (bytes after the first)."""
    nbytes = bulk_mib * MiB
    nblk = nbytes // (64 * KiB)
    h, d = c.alloc_host(nbytes), c.alloc_device(nbytes)
    try:
        dst, src = (d, h) if direction == "h2d" else (h, d)
        rng = np.random.default_rng(5)
        segs = np.stack([rng.permutation(nblk) * 64 * KiB, np.arange(nblk) * 64 * KiB, np.full(nblk, 64 * KiB)], axis=1)
        c.copy_batch(dst, src, segs, priority="bulk", timeout=timeout)  # warm
        pending = [c.start_copy_batch(dst, src, segs, priority="bulk") for _ in range(2)]
        done: list[tuple[float, int]] = []
        end = time.perf_counter() + seconds
        while pending:
            r = pending.pop(0).wait(timeout)
            done.append((time.perf_counter(), r.nbytes))
            if time.perf_counter() < end:
                pending.append(c.start_copy_batch(dst, src, segs, priority="bulk"))
        return throughput_between(done, done[0][0], done[-1][0])
    finally:
        release(c, h, d)


def priod_rows(args: argparse.Namespace, cotenants: list[str], save: Any, results: dict[str, Any]) -> None:
    """One daemon; per co-tenant (started once the daemon listens, as a job would after a system
    service): the idle rows, then the same under a bulk client's stream; then priod's bulk
    batches once, with no co-tenant."""
    # The singles row sends thousands of copies a second from one uid: the per-uid request cap
    # ([limits] max_requests_per_s_per_uid) would measure the cap, not the daemon, so it is off.
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    for item in args.set:
        key, _, value = item.partition("=")
        env[f"PRIOD_{key.upper()}"] = value
    blocks, block = args.blocks, args.block_kib * KiB
    with (
        daemon_process(env, backend=args.backend, start_timeout=180) as d,
        priod.SyncClient(d.socket_path, copy_path="daemon", name="urgent", spin_us=2000) as c,
    ):
        for cot in cotenants:
            part = results["cotenants"].setdefault(cot, {})
            with cotenant(cot, args.gemm_n) as ct:
                log(f"priod-idle, co-tenant {cot}")
                part["priod_idle"] = urgent_rows(c, args.direction, blocks, block, args.count, args.timeout)
                if args.direct:
                    with priod.SyncClient(d.socket_path, copy_path="daemon", name="direct") as dc:
                        part["direct_idle"] = direct_rows(dc, args.direction, blocks, block, args.count)
                save()
                log(f"priod-bulk, co-tenant {cot}: a bulk client streams {args.bulk_mib} MiB copies")
                bulk = BulkProcess(d.socket_path, args.bulk_mib * MiB, 2, args.direction)
                try:
                    bulk.wait_ready(timeout=120)
                    time.sleep(0.5)
                    t0 = time.perf_counter()
                    part["priod_bulk"] = urgent_rows(c, args.direction, blocks, block, args.count, args.timeout)
                    t1 = time.perf_counter()
                    if args.direct:
                        with priod.SyncClient(d.socket_path, copy_path="daemon", name="direct") as dc:
                            part["direct_bulk"] = direct_rows(dc, args.direction, blocks, block, args.count)
                    t2 = time.perf_counter()
                    res = bulk.stop(timeout=args.timeout + 60)
                finally:
                    bulk.kill()
                if res.get("errors"):
                    raise RuntimeError(f"the bulk client had errors: {res['errors'][:3]}")
                part["priod_bulk"]["bulk_contiguous"] = throughput_between(res["done"], t0, t1)
                if args.direct:
                    part["direct_bulk"]["bulk_contiguous"] = throughput_between(res["done"], t1, t2)
            part["cotenant"] = ct
            save()
        log(f"priod batch bulk: batches of 64 KiB blocks, {args.bulk_s} s")
        results["priod_batch_bulk"] = batch_bulk(c, args.direction, args.bulk_mib, args.bulk_s, args.timeout)
        results["status"] = c.status()
        save()


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    """Per co-tenant: the anchor's forms, then priod's and the direct rows, each with its ratio
    to the anchor's same form (xA: < 1 means priod wins); the targets; the bulk rates."""
    blocks, kib = args.blocks, args.block_kib
    lines = [
        f"{blocks} scattered {kib} KiB blocks ({blocks * kib // 1024} MiB), {args.direction}, client-observed us, {args.gap} 5 ms between copies (in-process: none)",
        f"{'row':<52} {'p50':>8} {'p99':>8} {'xA p50':>7} {'xA p99':>7}",
    ]

    def row(name: str, s: dict[str, float] | None, anchor: dict[str, float] | None = None) -> None:
        if s:
            xa = f"{s['p50'] / anchor['p50']:>7.2f} {s['p99'] / anchor['p99']:>7.2f}" if anchor else ""
            lines.append(f"{name:<52} {s['p50']:>8.1f} {s['p99']:>8.1f} {xa}")

    inp = r.get("inprocess", {})
    lat = inp.get("latency_us", {})
    row("in-process, idle GPU: contiguous", lat.get("contiguous"))
    row(
        "in-process, idle GPU: cuMemcpyBatchAsync" + (" (FALLBACK: loop)" if inp.get("batch_dma_error") else ""),
        lat.get("batch"),
    )
    row("in-process, idle GPU: loop of cudaMemcpyAsync", lat.get("loop"))
    targets: list[str] = []
    for cot, part in r.get("cotenants", {}).items():
        lines.append(
            f"-- co-tenant {cot}"
            + (
                f" ({part['cotenant']['tflops']:.0f} TFLOP/s of GEMMs beside priod's rows)"
                if "tflops" in part.get("cotenant", {})
                else ""
            )
        )
        alat = part.get("anchor", {}).get("latency_us", {})
        row("anchor (bulk in another process): contiguous", alat.get("contiguous"))
        row("anchor: cuMemcpyBatchAsync", alat.get("batch"))
        row("anchor: loop of cudaMemcpyAsync", alat.get("loop"))
        for key, label in (("priod_idle", "priod idle"), ("priod_bulk", "priod under bulk")):
            paths = part.get(key, {}).get("paths", {})
            plat = part.get(key, {}).get("latency_us", {})
            row(
                f"{label}: contiguous urgent {'/'.join(paths.get('contiguous', []))}",
                plat.get("contiguous"),
                alat.get("contiguous") if key == "priod_bulk" else None,
            )
            row(
                f"{label}: copy_batch urgent {'/'.join(paths.get('batch', []))}",
                plat.get("batch"),
                alat.get("batch") if key == "priod_bulk" else None,
            )
        for key, label in (("direct_idle", "direct idle"), ("direct_bulk", "direct under priod bulk")):
            dlat = part.get(key, {}).get("latency_us", {})
            loaded = key == "direct_bulk"
            row(f"{label}: contiguous", dlat.get("contiguous"), alat.get("contiguous") if loaded else None)
            chosen = part.get(key, {}).get("chosen", [])
            times = ", ".join(f"kernel {e['express_chosen']}x, dma {e['dma_chosen']}x" for e in chosen)
            row(
                f"{label}: copy_batch ({times or 'kernel or DMA'})",
                dlat.get("batch"),
                alat.get("batch") if loaded else None,
            )
            row(
                f"{label}: copy_batch (copy kernel only)",
                dlat.get("batch_kernel"),
                alat.get("batch") if loaded else None,
            )
            row(f"{label}: copy_batch (batched DMA only)", dlat.get("batch_dma"), alat.get("batch") if loaded else None)
        for key, label in (("priod_bulk", "through the daemon"), ("direct_bulk", "direct")):
            loaded = part.get(key, {}).get("latency_us", {})
            if loaded:
                ok = loaded["batch"]["p99"] <= loaded["contiguous"]["p99"] + 100
                batch99, contiguous99 = loaded["batch"]["p99"], loaded["contiguous"]["p99"]
                targets.append(
                    f"co-tenant {cot}, {label}: batch p99 {batch99:.0f} <= contiguous p99 {contiguous99:.0f} + 100 us: {'met' if ok else 'NOT met'}"
                )
                if alat.get("batch"):
                    wins = all(loaded["batch"][p] < alat["batch"][p] for p in ("p50", "p99"))
                    targets.append(
                        f"co-tenant {cot}, {label}: batch beats the anchor's cuMemcpyBatchAsync at p50 and p99: {'yes' if wins else 'NO'}"
                    )
    lines += ["targets:"] + [f"  {t}" for t in targets]
    raw = inp.get("raw_gbps")
    lines.append(f"{'bulk rates':<52} {'GB/s':>8} {'x raw':>8}")
    rates: list[tuple[str, Any]] = [
        ("raw: in-process contiguous", raw),
        ("in-process cuMemcpyBatchAsync, 64 KiB blocks", inp.get("batch_bulk_gbps")),
    ]
    for cot, part in r.get("cotenants", {}).items():
        rates.append((f"anchor's bulk process beside its urgent ({cot})", part.get("anchor", {}).get("bulk_gbps")))
        rates.append(
            (
                f"priod bulk contiguous beside urgent batches ({cot})",
                part.get("priod_bulk", {}).get("bulk_contiguous", {}).get("gbps"),
            )
        )
        rates.append(
            (
                f"priod bulk contiguous beside direct ({cot})",
                part.get("direct_bulk", {}).get("bulk_contiguous", {}).get("gbps"),
            )
        )
    rates.append(("priod bulk copy_batch, 64 KiB blocks", r.get("priod_batch_bulk", {}).get("gbps")))
    for name, v in rates:
        if v is not None:
            lines.append(f"{name:<52} {v:>8.2f} {(v / raw if raw else float('nan')):>8.3f}")
    bb = r.get("priod_batch_bulk", {}).get("gbps")
    if bb is not None and raw:
        lines.append(f"target: priod batch bulk >= 0.9 of raw: {'met' if bb / raw >= 0.9 else 'NOT met'}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description="batched copies on a GPU: priod's copy_batch against contiguous copies and in-process cuMemcpyBatchAsync"
    )
    ap.add_argument("--direction", choices=["h2d", "d2h"], default="h2d")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--count", type=int, default=200, help="measured copies per row and form (default 200)")
    ap.add_argument("--bulk-mib", type=int, default=256, help="bytes of each bulk copy or batch (default 256 MiB)")
    ap.add_argument("--bulk-s", type=float, default=5.0, help="seconds of priod's batch bulk stream")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds any one copy may take before the run fails")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION__KEY=VALUE", help="daemon setting")
    ap.add_argument("--out", default="out/bench_gpu_batch")
    ap.add_argument(
        "--inprocess-timeout", type=float, default=180.0, help="seconds the in-process rows may take in all"
    )
    ap.add_argument(
        "--gap",
        choices=["sleep", "busy"],
        default="sleep",
        help="the 5 ms after each urgent copy: asleep (default) or running Python",
    )
    ap.add_argument(
        "--direct",
        action="store_true",
        help="also direct rows (priod.client.direct: this process's own DMA, bulk held back; needs CuPy)",
    )
    ap.add_argument("--skip-inprocess", action="store_true", help="no in-process rows (they need CuPy)")
    ap.add_argument(
        "--cotenant",
        default="none,gemm",
        help="what else runs on the GPU beside the anchor and priod rows, comma-separated: none, gemm (bf16 GEMMs, own process)",
    )
    ap.add_argument("--gemm-n", type=int, default=8192, help="the gemm co-tenant's matrices are n x n")
    ap.add_argument("--skip-anchor", action="store_true", help="no anchor rows (they need CuPy)")
    ap.add_argument(
        "--backend",
        choices=["cuda", "sim"],
        default="cuda",
        help="sim: a dry run of the daemon rows on any machine (with --skip-inprocess)",
    )
    args = ap.parse_args()
    os.environ[GAP_ENV] = args.gap  # bench_gpu.pause: asleep, or running Python
    cotenants = csv_choices(ap, args.cotenant, COTENANTS, "--cotenant")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {
        "args": vars(args),
        "priod": priod.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cotenants": {},
    }

    def save() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    if not args.skip_inprocess:
        log("in-process rows (no daemon)")
        q = SPAWN.Queue()
        with child(inprocess, args.direction, args.blocks, args.block_kib * KiB, args.count, args.bulk_mib, q) as p:
            results["inprocess"] = get_result(q, [p], timeout=args.inprocess_timeout)
        save()
        if "error" in results["inprocess"]:
            log(f"in-process rows failed: {results['inprocess']['error']} (going on with the priod rows)")
    if not args.skip_anchor:
        for cot in cotenants:
            results["cotenants"].setdefault(cot, {})["anchor"] = anchor_row(args, cot)
            save()
    priod_rows(args, cotenants, save, results)
    table = render(results, args)
    results["table"] = table
    save()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
