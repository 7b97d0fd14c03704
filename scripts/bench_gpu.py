#!/usr/bin/env python3
"""GPU benchmark: urgent copies under a saturating bulk stream, side by side in one run.

Rows, per direction set (h2d, d2h, both at once):
  idle     each urgent size alone on an idle GPU, in-process cudaMemcpyAsync (the reference)
  naive    in-process: bulk 2 GiB copies on a low-priority stream, urgent copies on a
           high-priority stream (what priority streams promise, and do not give for copies)
  dma      through priod, express lane off: chunked bulk, urgent submitted first
  express  through priod, express lane on
Columns: urgent p50/p99 (client-observed, us) and each as a ratio to idle; the daemon's own p50
(arrival to completion seen, so the rest is the process round trip); bulk GB/s and its ratio to
raw cudaMemcpyAsync (the set's directions at once) measured in the same run; link: bulk plus urgent
bytes over raw (the urgent copies share the link, so bulk alone cannot keep all of it).
The priod rows run once per polling mode (--bulk-poll, default timer,spin), side by side.

    python scripts/bench_gpu.py --out out/bench_gpu          # about 3 minutes on an H200

Needs a GPU, cuda-bindings and CuPy (for the in-process rows). Writes results.json and
latency.png under --out and prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod  # noqa: E402
from priod.testing import daemon_process  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (64 * KiB, 1 * MiB, 16 * MiB)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(v: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(v), q)) if v else float("nan")


# -- in-process rows (CuPy) ----------------------------------------------------------------------
def _dump_stacks_later() -> None:
    """With PRIOD_BENCH_DUMP_S set, print every thread's stack after that many seconds (a hang's where)."""
    import faulthandler

    if os.environ.get("PRIOD_BENCH_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["PRIOD_BENCH_DUMP_S"]), exit=False)


def inprocess(directions: tuple[str, ...], bulk_bytes: int, count: int, q: Any) -> None:
    """idle and naive rows, and raw bandwidth, in a child process of its own."""
    _dump_stacks_later()
    import cupy as cp

    from priod.engines.cuda._driver import bindings

    rt, _ = bindings()

    def ck(r: Any) -> Any:
        if r[0] != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(r[0])
        return r[1] if len(r) == 2 else r[1:]

    lo, hi = ck(rt.cudaDeviceGetStreamPriorityRange())
    low = [cp.cuda.Stream(non_blocking=True, priority=lo) for _ in directions]
    high = cp.cuda.Stream(non_blocking=True, priority=hi)
    hbulk = {d: cp.cuda.alloc_pinned_memory(bulk_bytes) for d in directions}
    dbulk = {d: cp.cuda.alloc(bulk_bytes) for d in directions}
    hu = cp.cuda.alloc_pinned_memory(max(SIZES))
    du = cp.cuda.alloc(max(SIZES))
    kind = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost}

    def copy(direction: str, host: int, dev: int, n: int, stream: Any) -> None:
        dst, src = (dev, host) if direction == "h2d" else (host, dev)
        ck((rt.cudaMemcpyAsync(dst, src, n, kind[direction], stream.ptr)[0], None))

    def urgent_once(direction: str, n: int) -> float:
        t0 = time.perf_counter()
        copy(direction, hu.ptr, du.ptr, n, high)
        high.synchronize()
        return (time.perf_counter() - t0) * 1e6

    out: dict[str, Any] = {"idle": {}, "naive": {}, "raw_gbps": {}}
    log("in-process: idle")
    for d in ("h2d", "d2h"):
        for n in SIZES:
            [urgent_once(d, n) for _ in range(5)]
            out["idle"][f"{d}/{n}"] = sorted(urgent_once(d, n) for _ in range(count))
    # raw: whole bulk copies in every direction of the set at once (for "both", the two
    # directions share the host's PCIe and memory, so each alone would overstate the reference)
    for i, d in enumerate(directions):
        copy(d, hbulk[d].ptr, dbulk[d].ptr, bulk_bytes, low[i])
    for s in low:
        s.synchronize()
    marks = []
    for i, d in enumerate(directions):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(low[i])
        for _ in range(3):
            copy(d, hbulk[d].ptr, dbulk[d].ptr, bulk_bytes, low[i])
        end.record(low[i])
        marks.append((d, start, end))
    for d, start, end in marks:
        end.synchronize()
        out["raw_gbps"][d] = 3 * bulk_bytes / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9
    log(f"in-process: raw {out['raw_gbps']}; naive")
    # naive: keep the low-priority streams busy with whole bulk copies, urgent on the high one
    for d in directions:
        for n in SIZES:
            lat: list[float] = []
            moved, t0 = 0, time.perf_counter()
            for k in range(count):
                if k % 2 == 0:  # keep at least one whole bulk copy queued per direction
                    for i, bd in enumerate(directions):
                        copy(bd, hbulk[bd].ptr, dbulk[bd].ptr, bulk_bytes, low[i])
                        moved += bulk_bytes
                time.sleep(0.002)
                lat.append(urgent_once(d, n))
            for s in low:
                s.synchronize()
            elapsed = time.perf_counter() - t0
            out["naive"][f"{d}/{n}"] = {
                "lat": lat,
                "bulk_gbps": moved / elapsed / 1e9 / len(directions),
                "urgent_gbps": count * n / elapsed / 1e9 / len(directions),
            }
    q.put(out)


# -- priod rows ------------------------------------------------------------------------------------
def bulk_client(path: str, direction: str, nbytes: int, stop: Any, q: Any) -> None:
    _dump_stacks_later()
    async def run() -> None:
        c = await priod.connect(path, name=f"bulk-{direction}")
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


def urgent_client(path: str, directions: tuple[str, ...], count: int, interval_s: float = 0.005, spin_us: float = 2000) -> dict[str, Any]:
    """Urgent copies one at a time from a blocking client that busy-polls for its reply
    (``spin_us``), as a latency-critical caller would; client-observed latency per copy."""
    out: dict[str, Any] = {}
    paths: dict[str, set[str]] = {}
    daemon: dict[str, list[tuple[float, float, float]]] = {}  # the daemon's own queued/transfer/total
    with priod.SyncClient(path, name="urgent", spin_us=spin_us) as c:
        h, d = c.alloc_host(max(SIZES)), c.alloc_device(max(SIZES))
        assert h.array is not None
        h.array[:] = np.arange(max(SIZES), dtype=np.uint64).view(np.uint8)[: max(SIZES)]
        for direction in directions:
            dst, src = (d, h) if direction == "h2d" else (h, d)
            for n in SIZES:
                lat = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    r = c.copy(dst, src, n, priority="urgent")
                    lat.append((time.perf_counter() - t0) * 1e6)
                    key = f"{direction}/{n}"
                    paths.setdefault(key, set()).add(r.path)
                    daemon.setdefault(key, []).append((r.queued_us, r.transfer_us, r.total_us))
                    time.sleep(interval_s)
                out[f"{direction}/{n}"] = lat
    out["_paths"] = {k: sorted(v) for k, v in paths.items()}
    out["_daemon_us"] = daemon
    return out


def priod_row(
    directions: tuple[str, ...], express: bool, bulk_bytes: int, count: int, warm_s: float, backend: str = "cuda", bulk_poll: str = "spin"
) -> dict[str, Any]:
    env = {
        "PRIOD_SCHEDULER__EXPRESS": "true" if express else "false",
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_SERVER__BULK_POLL": f'"{bulk_poll}"',
    }
    ctx = mp.get_context("spawn")
    log(f"priod row {directions} express={express}: starting daemon ({backend})")
    with daemon_process(env, backend=backend, start_timeout=120) as dmn:
        q: Any = ctx.Queue()
        # idle through priod first (no bulk), then under load
        idle = urgent_client(dmn.socket_path, directions, max(10, count // 4))
        stop = ctx.Event()
        procs = [ctx.Process(target=bulk_client, args=(dmn.socket_path, d, bulk_bytes, stop, q)) for d in directions]
        log("idle via priod done; starting bulk clients")
        for p in procs:
            p.start()
        with priod.SyncClient(dmn.socket_path) as sc:
            # warm: every bulk client has pinned its regions and its bytes are flowing
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(sc.status()["lane_bytes"][f"gpu0/{d}"] for d in directions):
                time.sleep(0.05)
            time.sleep(warm_s)
            # bulk alone for a second, then under urgent load: bytes per lane from the daemon,
            # counted per chunk, so the figure does not depend on where 2 GiB copies end
            t1, b1, c1 = time.perf_counter(), sc.status()["lane_bytes"], daemon_cpu(dmn.proc.pid)
            loaded = urgent_client(dmn.socket_path, directions, count)
            t2, st, c2 = time.perf_counter(), sc.status(), daemon_cpu(dmn.proc.pid)
            b2 = st["lane_bytes"]
            # then bulk alone, measured after the loaded phase (so both see a warmed pipeline)
            s3 = sc.status()
            t3, b3, c3 = time.perf_counter(), s3["lane_bytes"], daemon_cpu(dmn.proc.pid)
            time.sleep(1.0)
            s4 = sc.status()
            t4, b4, c4 = time.perf_counter(), s4["lane_bytes"], daemon_cpu(dmn.proc.pid)
        log("urgent under load done")
        stop.set()
        alone, results, urgent_rate = {}, {}, {}
        for d in directions:
            lane = f"gpu0/{d}"
            urgent_bytes = sum(int(k.split("/")[1]) * len(v) for k, v in loaded.items() if k.startswith(d + "/"))
            alone[d] = (b4[lane] - b3[lane]) / (t4 - t3) / 1e9
            results[d] = (b2[lane] - b1[lane] - urgent_bytes) / (t2 - t1) / 1e9
            urgent_rate[d] = urgent_bytes / (t2 - t1) / 1e9
        for _ in procs:
            get_result(q, procs, 120)
        for p in procs:
            p.join(timeout=60)
        status = st
        moved_alone = sum(b4[f"gpu0/{d}"] - b3[f"gpu0/{d}"] for d in directions)
        cpu = {
            "loaded_cpu_s_per_s": (c2 - c1) / (t2 - t1),
            "bulk_alone_cpu_s_per_s": (c4 - c3) / (t4 - t3),
            "bulk_alone_cpu_s_per_gb": (c4 - c3) / max(moved_alone / 1e9, 1e-9),
            "bulk_alone_polls_per_s": (s4.get("polls", 0) - s3.get("polls", 0)) / (t4 - t3),
        }
    return {"idle_via_priod": idle, "loaded": loaded, "bulk_gbps": results, "urgent_gbps": urgent_rate, "loaded_s": t2 - t1, "bulk_alone_gbps": alone, "daemon_cpu": cpu, "lanes": status["lanes"], "engine": status["engine"]}


def daemon_cpu(pid: int) -> float:
    """The daemon's user + system CPU seconds so far (psutil if present, else /proc)."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except ImportError:
        with open(f"/proc/{pid}/stat") as fp:
            fields = fp.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get_result(q: Any, procs: list[Any], timeout: float = 600) -> Any:
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
    ap.add_argument("--warm-s", type=float, default=3.0, help="bulk runs this long before measuring (the first passes over fresh pinned memory are slow)")
    args = ap.parse_args()
    _dump_stacks_later()
    os.makedirs(args.out, exist_ok=True)
    bulk = int(args.bulk_gib * GiB)
    modes = args.bulk_poll.split(",")
    if not set(modes) <= {"spin", "timer"}:
        ap.error("--bulk-poll takes spin, timer or both (comma-separated)")
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "sets": {}}
    for name in args.sets.split(","):
        directions = ("h2d", "d2h") if name == "both" else (name,)
        q: Any = ctx.Queue()
        p = ctx.Process(target=inprocess, args=(directions, bulk, args.count, q))
        p.start()
        inproc = get_result(q, [p])
        p.join()
        entry: dict[str, Any] = {"inprocess": inproc}
        for i, mode in enumerate(modes):
            for row, express in (("dma", False), ("express", True)):
                label = row if i == 0 else f"{row}/{mode}"
                entry[label] = priod_row(directions, express, bulk, args.count, warm_s=args.warm_s, bulk_poll=mode)
                entry[label]["bulk_poll"] = mode
        results["sets"][name] = entry
        with open(os.path.join(args.out, "results.json"), "w") as fp:
            json.dump(results, fp, indent=1)
    table = render(results)
    plot(results, os.path.join(args.out, "latency.png"))
    with open(os.path.join(args.out, "table.txt"), "w") as fp:
        fp.write(table + "\n")
    print(table)
    return 0


def mean_of(per_direction: dict[str, float]) -> float | None:
    return float(np.mean(list(per_direction.values()))) if per_direction else None


def priod_rows(s: dict[str, Any]) -> list[str]:
    return [k for k in s if k != "inprocess"]


def render(results: dict[str, Any]) -> str:
    """The table: per urgent size, each row's latency against idle, the daemon's own share of
    it, and what bulk kept of the link (bulk alone, and bulk plus the urgent bytes)."""
    lines = []
    hdr = (
        f"{'set':<5} {'urgent':<10} {'row':<13} {'p50 us':>9} {'x idle':>7} {'p99 us':>9} {'x idle':>7} {'daemon':>7} "
        f"{'bulk GB/s':>10} {'x raw':>6} {'link':>6}  target p99<=2*idle+50us"
    )
    lines.append(hdr)
    for name, s in results["sets"].items():
        inproc = s["inprocess"]
        raw = float(np.mean([inproc["raw_gbps"][d] for d in inproc["raw_gbps"]]))
        for key in [k for k in s["express"]["loaded"] if not k.startswith("_")]:
            direction, n = key.split("/")
            idle = inproc["idle"][key]
            i50 = pct(idle, 50)
            label = f"{direction} {int(n) // KiB} KiB" if int(n) < MiB else f"{direction} {int(n) // MiB} MiB"
            naive = inproc["naive"][key]
            rows = [("idle", idle, None, None, None), ("naive", naive["lat"], naive["bulk_gbps"], naive.get("urgent_gbps"), None)]
            for row in priod_rows(s):
                r = s[row]
                daemon_total = [t for _, _, t in r["loaded"]["_daemon_us"][key]]
                rows.append((row, r["loaded"][key], mean_of(r["bulk_gbps"]), mean_of(r.get("urgent_gbps", {})), pct(daemon_total, 50)))
            for row, lat, gbps, urgent_gbps, daemon in rows:
                p50, p99 = pct(lat, 50), pct(lat, 99)
                met = "" if row in ("idle", "naive") else ("met" if p99 <= 2 * i50 + 50 else "not met")
                g = f"{gbps:10.1f} {gbps / raw:6.3f}" if gbps else f"{'':>10} {'':>6}"
                link = f"{(gbps + urgent_gbps) / raw:6.3f}" if gbps and urgent_gbps is not None else f"{'':>6}"
                dm = f"{daemon:7.0f}" if daemon is not None else f"{'':>7}"
                lines.append(f"{name:<5} {label:<10} {row:<13} {p50:9.1f} {p50 / i50:7.1f} {p99:9.1f} {p99 / i50:7.1f} {dm} {g} {link}  {met}")
        lines.append(f"{name:<5} raw cudaMemcpyAsync GB/s (the set's directions at once): " + ", ".join(f"{d} {v:.1f}" for d, v in inproc["raw_gbps"].items()))
        for row in priod_rows(s):
            cpu = s[row].get("daemon_cpu")
            if cpu:
                lines.append(
                    f"{name:<5} daemon CPU ({row}, bulk_poll {s[row].get('bulk_poll', 'spin')}): {cpu['loaded_cpu_s_per_s']:.2f} CPU s/s under urgent load, "
                    f"{cpu['bulk_alone_cpu_s_per_s']:.2f} CPU s/s, {cpu['bulk_alone_cpu_s_per_gb']:.4f} CPU s/GB and "
                    f"{cpu.get('bulk_alone_polls_per_s', 0):,.0f} polls/s with bulk alone"
                )
            alone = s[row].get("bulk_alone_gbps", {})
            lines.append(
                f"{name:<5} bulk through priod, no urgent load ({row}) GB/s: "
                + ", ".join(f"{d} {v:.1f} (x raw {v / inproc['raw_gbps'][d]:.3f})" for d, v in alone.items())
            )
    lines.append("daemon: the daemon's own p50 (arrival to completion seen); link: (bulk + urgent bytes) / raw")
    return "\n".join(lines)


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
            series = {"idle": s["inprocess"]["idle"][key], "naive": s["inprocess"]["naive"][key]["lat"]}
            series.update({f"priod {row}": s[row]["loaded"][key] for row in priod_rows(s)})
            for label, v in series.items():
                v = sorted(v)
                ax.plot(v, np.linspace(0, 1, len(v)), label=label)
            ax.set_xscale("log")
            ax.set_title(f"{name}: urgent {key}")
            ax.set_xlabel("latency (us)")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("CDF")
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
