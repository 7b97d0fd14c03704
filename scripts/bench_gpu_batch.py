#!/usr/bin/env python3
"""GPU benchmark of batched copies (issue 12): scattered 64 KiB blocks, through priod and without it.

Rows (one direction, --direction, default h2d):
  in-process   no daemon, a CUDA context of this benchmark's own, idle GPU: the blocks as one
               ``cuMemcpyBatchAsync`` (priod's own `BatchedDma`, so the same call), as a loop of
               ``cudaMemcpyAsync`` per block, and the same bytes as one contiguous copy;
               client-observed (enqueue to stream synchronised), p50/p99.
  priod-idle   through a cuda daemon (defaults, express on): the blocks as one urgent
               ``copy_batch`` and the same bytes as one contiguous urgent ``copy``, alternating.
  priod-bulk   the same while another process streams --bulk-mib bulk copies (2 outstanding)
               through the daemon. Target: batch p99 <= contiguous p99 + 100 us.
  bulk rates   raw (one in-process contiguous copy of --bulk-mib), the in-process batch of
               64 KiB blocks over the same bytes, priod's bulk stream of contiguous copies (from
               the priod-bulk row), and priod's bulk stream of batches of 64 KiB blocks
               (2 outstanding, --bulk-s seconds), each as GB/s and a fraction of raw.
               Target: priod's batches >= 0.9 of raw.

    python scripts/bench_gpu_batch.py --out out/bench_gpu_batch          # about 2 minutes
    python scripts/bench_gpu_batch.py --count 50 --bulk-s 3              # a quick look
    python scripts/bench_gpu_batch.py --backend sim --skip-inprocess --count 5 --bulk-mib 64 --bulk-s 1   # dry run, no GPU

Needs a GPU, cuda-bindings and CuPy. Every copy has a timeout (--timeout) and every child
process a deadline, so a stuck GPU or daemon ends the run with an error instead of holding the
machine. Writes results.json under --out after each stage and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p)

import priod
from priod.testing import BulkProcess, daemon_process, percentile, throughput_between

from bench_gpu import GAP_ENV, SPAWN, child, get_result, log, pause  # scripts/ is this script's directory

KiB, MiB = 1 << 10, 1 << 20
INTERVAL_S = 0.005
"""Pause after each urgent copy or batch (as bench_gpu.py's rows)."""


def scattered(n: int, block: int, seed: int) -> npt.NDArray[np.int64]:
    """``n`` blocks between random distinct slots of two regions of ``2 n`` blocks."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(2 * n, n, replace=False) * block, rng.choice(2 * n, n, replace=False) * block, np.full(n, block)], axis=1).astype(np.int64)


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
def inprocess(direction: str, blocks: int, block: int, count: int, bulk_mib: int, q: Any) -> None:
    """The in-process rows, in a spawned child with its own CUDA context; puts a dict on ``q``."""
    import cupy as cp

    from priod.engines.cuda._driver import bindings, check
    from priod.engines.cuda.batched import BatchedDma

    rt, _ = bindings()
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice if direction == "h2d" else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    out: dict[str, Any] = {}
    try:
        stream = cp.cuda.Stream(non_blocking=True)
        rt_stream = rt.cudaStream_t(stream.ptr)
        batched = BatchedDma()
        out["batch_dma_error"] = batched.error

        def ends(host: Any, dev: Any) -> tuple[int, int]:
            return (dev.ptr, host.ptr) if direction == "h2d" else (host.ptr, dev.ptr)

        size = 2 * blocks * block
        host, dev = cp.cuda.alloc_pinned_memory(size), cp.cuda.alloc(size)
        dst, src = ends(host, dev)
        segs = scattered(blocks, block, seed=1).astype(np.uint64)
        d_offs, s_offs, sizes = segs[:, 0].copy(), segs[:, 1].copy(), segs[:, 2].copy()

        def timed(enqueue: Any) -> float:
            t0 = time.perf_counter()
            enqueue()
            stream.synchronize()
            return (time.perf_counter() - t0) * 1e6

        def contiguous() -> None:
            check(rt.cudaMemcpyAsync(dst, src, blocks * block, kind, rt_stream))

        def batch() -> None:
            batched.copy(dst, src, d_offs, s_offs, sizes, kind, rt_stream)

        def loop() -> None:
            for d, s, n in zip((d_offs + np.uint64(dst)).tolist(), (s_offs + np.uint64(src)).tolist(), sizes.tolist(), strict=True):
                check(rt.cudaMemcpyAsync(d, s, n, kind, rt_stream))

        lat: dict[str, list[float]] = {"contiguous": [], "batch": [], "loop": []}
        for i in range(5 + count):  # five unmeasured rounds first
            for name, fn in (("contiguous", contiguous), ("batch", batch), ("loop", loop)):
                t = timed(fn)
                if i >= 5:
                    lat[name].append(t)
        out["latency_us"] = {k: summary(v) for k, v in lat.items()}

        # Bulk rates: one contiguous copy of bulk_mib (raw), and the same bytes as 64 KiB blocks
        # in one batched call, timed with events on the stream.
        nbytes = bulk_mib * MiB
        bh, bd = cp.cuda.alloc_pinned_memory(nbytes), cp.cuda.alloc(nbytes)
        bdst, bsrc = ends(bh, bd)
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

        out["raw_gbps"] = gbps(lambda: check(rt.cudaMemcpyAsync(bdst, bsrc, nbytes, kind, rt_stream)))
        out["batch_bulk_gbps"] = gbps(lambda: batched.copy(bdst, bsrc, perm, order, full, kind, rt_stream))
        out["batch_dma_error_after"] = batched.error
    except Exception as exc:  # report it rather than leave the parent waiting
        out["error"] = f"{type(exc).__name__}: {exc}"
    q.put(out)


# -- through the daemon ---------------------------------------------------------------------------------
def urgent_rows(c: priod.SyncClient, direction: str, blocks: int, block: int, count: int, timeout: float) -> dict[str, Any]:
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
    """The same alternation with direct copies (priod.direct): this process's own copies between
    its own CuPy buffers, one hold per batch or copy; a batch by the copy kernel (the default for
    blocks this small) and by batched DMA (``batch_kernel=False``); the last batches' bytes checked."""
    import cupy as cp

    from priod.direct import DirectCopies

    size = 2 * blocks * block
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8)
    page = c.hold_page()
    direct, by_dma = DirectCopies(page), DirectCopies(page, batch_kernel=False)
    pair = direct.pair(dev, host) if direction == "h2d" else direct.pair(host, dev)
    dma_pair = by_dma.pair(dev, host) if direction == "h2d" else by_dma.pair(host, dev)
    segs = scattered(blocks, block, seed=6)
    lat: dict[str, list[float]] = {"batch": [], "batch_dma": [], "contiguous": []}
    for i in range(5 + count):
        for name in ("batch", "batch_dma", "contiguous"):
            t0 = time.perf_counter()
            if name == "batch":
                pair.copy_batch(segs)
            elif name == "batch_dma":
                dma_pair.copy_batch(segs)
            else:
                pair.copy(blocks * block)
            if i >= 5:
                lat[name].append((time.perf_counter() - t0) * 1e6)
            pause(INTERVAL_S)
    if direction == "h2d":  # check the blocks landed where the table says, both ways of copying
        for p in (pair, dma_pair):
            dev[:] = 0
            p.copy_batch(segs)
            got = cp.asnumpy(dev)
            for d_off, s_off, n in segs.tolist():
                assert np.array_equal(got[d_off : d_off + n], host[s_off : s_off + n]), "a direct batch's block differs"
    direct.close()
    by_dma.close()
    return {"latency_us": {k: summary(v) for k, v in lat.items()}}


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


def priod_rows(args: argparse.Namespace, save: Any, results: dict[str, Any]) -> None:
    # The singles row sends thousands of copies a second from one uid: the per-uid request cap
    # ([limits] max_requests_per_s_per_uid) would measure the cap, not the daemon, so it is off.
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    for item in args.set:
        key, _, value = item.partition("=")
        env[f"PRIOD_{key.upper()}"] = value
    with daemon_process(env, backend=args.backend, start_timeout=180) as d, priod.SyncClient(d.socket_path, name="urgent", spin_us=2000) as c:
        log("priod-idle")
        results["priod_idle"] = urgent_rows(c, args.direction, args.blocks, args.block_kib * KiB, args.count, args.timeout)
        save()
        if args.direct:
            with priod.SyncClient(d.socket_path, name="direct") as dc:
                results["direct_idle"] = direct_rows(dc, args.direction, args.blocks, args.block_kib * KiB, args.count)
            save()
        log(f"priod-bulk: a bulk client streams {args.bulk_mib} MiB copies")
        bulk = BulkProcess(d.socket_path, args.bulk_mib * MiB, 2, args.direction)
        try:
            bulk.wait_ready(timeout=120)
            time.sleep(0.5)
            t0 = time.perf_counter()
            results["priod_bulk"] = urgent_rows(c, args.direction, args.blocks, args.block_kib * KiB, args.count, args.timeout)
            t1 = time.perf_counter()
            if args.direct:
                with priod.SyncClient(d.socket_path, name="direct") as dc:
                    results["direct_bulk"] = direct_rows(dc, args.direction, args.blocks, args.block_kib * KiB, args.count)
            res = bulk.stop(timeout=args.timeout + 60)
        finally:
            bulk.kill()
        if res.get("errors"):
            raise RuntimeError(f"the bulk client had errors: {res['errors'][:3]}")
        results["priod_bulk"]["bulk_contiguous"] = throughput_between(res["done"], t0, t1)
        save()
        log(f"priod batch bulk: batches of 64 KiB blocks, {args.bulk_s} s")
        results["priod_batch_bulk"] = batch_bulk(c, args.direction, args.bulk_mib, args.bulk_s, args.timeout)
        results["status"] = c.status()
        save()


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    blocks, kib = args.blocks, args.block_kib
    lines = [
        f"{blocks} scattered {kib} KiB blocks ({blocks * kib // 1024} MiB), {args.direction}, client-observed us, {args.gap} 5 ms between copies",
        f"{'row':<44} {'p50':>9} {'p99':>9}",
    ]
    inp = r.get("inprocess", {})

    def row(name: str, s: dict[str, float] | None) -> None:
        if s:
            lines.append(f"{name:<44} {s['p50']:>9.1f} {s['p99']:>9.1f}")

    lat = inp.get("latency_us", {})
    row("in-process contiguous cudaMemcpyAsync", lat.get("contiguous"))
    row("in-process cuMemcpyBatchAsync" + (" (FALLBACK: loop)" if inp.get("batch_dma_error") else ""), lat.get("batch"))
    row("in-process loop of cudaMemcpyAsync", lat.get("loop"))
    for key, label in (("priod_idle", "priod idle"), ("priod_bulk", "priod under bulk")):
        part = r.get(key, {})
        paths = part.get("paths", {})
        row(f"{label}: contiguous urgent {'/'.join(paths.get('contiguous', []))}", part.get("latency_us", {}).get("contiguous"))
        row(f"{label}: copy_batch urgent {'/'.join(paths.get('batch', []))}", part.get("latency_us", {}).get("batch"))
    for key, label in (("direct_idle", "direct idle"), ("direct_bulk", "direct under priod bulk")):
        part = r.get(key, {})
        row(f"{label}: contiguous", part.get("latency_us", {}).get("contiguous"))
        row(f"{label}: copy_batch (copy kernel)", part.get("latency_us", {}).get("batch"))
        row(f"{label}: copy_batch (batched DMA)", part.get("latency_us", {}).get("batch_dma"))
    for key, label in (("priod_bulk", "through the daemon"), ("direct_bulk", "direct")):
        loaded = r.get(key, {}).get("latency_us", {})
        if loaded:
            ok = loaded["batch"]["p99"] <= loaded["contiguous"]["p99"] + 100
            lines.append(f"target under bulk ({label}): batch p99 <= contiguous p99 + 100 us: {'met' if ok else 'NOT met'}")
    raw = inp.get("raw_gbps")
    lines.append(f"{'bulk rates':<44} {'GB/s':>9} {'x raw':>9}")
    for name, v in (
        ("raw: in-process contiguous", raw),
        ("in-process cuMemcpyBatchAsync, 64 KiB blocks", inp.get("batch_bulk_gbps")),
        ("priod bulk contiguous (under urgent)", r.get("priod_bulk", {}).get("bulk_contiguous", {}).get("gbps")),
        ("priod bulk copy_batch, 64 KiB blocks", r.get("priod_batch_bulk", {}).get("gbps")),
    ):
        if v is not None:
            lines.append(f"{name:<44} {v:>9.2f} {(v / raw if raw else float('nan')):>9.3f}")
    bb = r.get("priod_batch_bulk", {}).get("gbps")
    if bb is not None and raw:
        lines.append(f"target: priod batch bulk >= 0.9 of raw: {'met' if bb / raw >= 0.9 else 'NOT met'}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description="batched copies on a GPU: priod's copy_batch against contiguous copies and in-process cuMemcpyBatchAsync")
    ap.add_argument("--direction", choices=["h2d", "d2h"], default="h2d")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--count", type=int, default=200, help="measured copies per row and form (default 200)")
    ap.add_argument("--bulk-mib", type=int, default=256, help="bytes of each bulk copy or batch (default 256 MiB)")
    ap.add_argument("--bulk-s", type=float, default=5.0, help="seconds of priod's batch bulk stream")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds any one copy may take before the run fails")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION__KEY=VALUE", help="daemon setting")
    ap.add_argument("--out", default="out/bench_gpu_batch")
    ap.add_argument("--inprocess-timeout", type=float, default=180.0, help="seconds the in-process rows may take in all")
    ap.add_argument("--gap", choices=["sleep", "busy"], default="sleep", help="the 5 ms after each urgent copy: asleep (default) or running Python")
    ap.add_argument("--direct", action="store_true", help="also direct rows (priod.direct: this process's own DMA, bulk held back; needs CuPy)")
    ap.add_argument("--skip-inprocess", action="store_true", help="no in-process rows (they need CuPy)")
    ap.add_argument("--backend", choices=["cuda", "sim"], default="cuda", help="sim: a dry run of the daemon rows on any machine (with --skip-inprocess)")
    args = ap.parse_args()
    os.environ[GAP_ENV] = args.gap  # bench_gpu.pause: asleep, or running Python
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "priod": priod.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

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
    priod_rows(args, save, results)
    table = render(results, args)
    results["table"] = table
    save()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
