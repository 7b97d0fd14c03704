#!/usr/bin/env python3
"""What GPU-side ordering costs: copies with ``wait_event`` / ``signal_event``
against the same copies without, through an idle cuda daemon.

Rows, per size (--sizes, host -> device, urgent, one copy at a time with --interval-ms between;
client-observed from send to reply, p50/p99 in microseconds; the forms alternate copy by copy so
drift hits them alike):
  plain          the copy alone
  wait           with a wait_event that has already completed (the daemon's poll at arrival)
  signal         with a signal_event; also ``recorded``: send until the daemon's report that the
                 event is recorded, when a stream may wait on it
  wait+signal    both
  wait (open)    the first copy naming a fresh event: the daemon opens the handle (once per
                 connection), --opens samples
  kernel+sync    a ~--kernel-us spinning kernel, the host waits for it (cudaEventSynchronize),
                 then the plain copy: the host-synchronised way (needs torch)
  kernel+wait    the same kernel, its event recorded, the copy sent at once with wait_event: the
                 daemon polls for the kernel (needs torch); ``event_wait_us`` is the daemon's
                 figure for the wait

    python scripts/bench_gpu_events.py --out out/bench_gpu_events      # about a minute
    python scripts/bench_gpu_events.py --backend sim --count 50        # dry run, no GPU (sim events)

Writes results.json under --out after each size and prints a table last. Every copy has a
timeout (--timeout), so a stuck GPU or daemon ends the run with an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import priod
from priod.testing import daemon_process, percentile
from priod.wire.ipc_event import SimEvent

KiB, MiB = 1 << 10, 1 << 20
FORMS = ("plain", "wait", "signal", "wait+signal")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary(us: list[float]) -> dict[str, float]:
    return {"p50": percentile(us, 50), "p99": percentile(us, 99), "n": len(us)}


class Events:
    """Events of the backend: CUDA interprocess events (priod.client.cuda_ipc), or sim events in a
    device region; ``done()`` gives one already completed, ``fresh()`` a new one."""

    def __init__(self, c: priod.SyncClient, backend: str) -> None:
        self.backend = backend
        self._made: list[Any] = []
        if backend == "sim":
            self._region = c.alloc_device(4096)
            self._next = 0

    def fresh(self) -> Any:
        if self.backend == "sim":
            sim = SimEvent(self._region, self._next)
            self._next += 1
            sim.complete()
            return sim
        from priod.client.cuda_ipc import ipc_event

        ev = ipc_event()
        ev.record(0)  # nothing queued before it: complete at once
        ev.synchronize()
        self._made.append(ev)
        return ev

    def close(self) -> None:
        for ev in self._made:
            ev.close()


def measure(
    c: priod.SyncClient, dst: Any, src: Any, size: int, form: str, wait_ev: Any, sig_ev: Any, timeout: float
) -> tuple[float, float | None]:
    """One copy of ``form``: (send to reply, send to recorded report or None) in microseconds."""
    opts: dict[str, Any] = {"priority": "urgent"}
    if "wait" in form:
        opts["wait_event"] = wait_ev
    if "signal" in form:
        opts["signal_event"] = sig_ev
    t0 = time.perf_counter()
    h = c.start_copy(dst, src, size, **opts)
    recorded = None
    if "signal" in form:
        h.wait_recorded(timeout=timeout)
        recorded = (time.perf_counter() - t0) * 1e6
    h.wait(timeout=timeout)
    return (time.perf_counter() - t0) * 1e6, recorded


def kernel_rows(c: priod.SyncClient, dst: Any, src: Any, size: int, args: argparse.Namespace) -> dict[str, Any]:
    """kernel+sync against kernel+wait, alternating; needs torch (a spinning kernel)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    torch_any: Any = torch
    # Cycles for --kernel-us: calibrated once with timing events (the clock varies by GPU).
    probe_start, probe_end = torch_any.cuda.Event(enable_timing=True), torch_any.cuda.Event(enable_timing=True)
    probe_start.record()
    torch_any.cuda._sleep(1_000_000)
    probe_end.record()
    probe_end.synchronize()
    cycles = int(1_000_000 * args.kernel_us / (probe_start.elapsed_time(probe_end) * 1e3))
    ev = torch_any.cuda.Event(interprocess=True)
    sync_us: list[float] = []
    wait_us: list[float] = []
    daemon_wait: list[float] = []
    for i in range(args.count):
        for form in ("sync", "wait") if i % 2 == 0 else ("wait", "sync"):
            t0 = time.perf_counter()
            torch_any.cuda._sleep(cycles)
            ev.record()
            if form == "sync":
                ev.synchronize()
                c.copy(dst, src, size, priority="urgent", timeout=args.timeout)
                sync_us.append((time.perf_counter() - t0) * 1e6)
            else:
                r = c.copy(dst, src, size, priority="urgent", wait_event=ev, timeout=args.timeout)
                wait_us.append((time.perf_counter() - t0) * 1e6)
                daemon_wait.append(r.event_wait_us or 0.0)
            time.sleep(args.interval_ms / 1e3)
    return {
        "kernel_cycles": cycles,
        "kernel+sync": summary(sync_us),
        "kernel+wait": summary(wait_us),
        "event_wait_us": summary(daemon_wait),
    }


def size_rows(c: priod.SyncClient, events: Events, size: int, args: argparse.Namespace) -> dict[str, Any]:
    src, dst = c.alloc_host(size), c.alloc_device(size)
    wait_ev, sig_ev = events.fresh(), events.fresh()
    rtt: dict[str, list[float]] = {f: [] for f in FORMS}
    rec: dict[str, list[float]] = {f: [] for f in FORMS if "signal" in f}
    for _ in range(args.warm):
        for form in FORMS:
            measure(c, dst, src, size, form, wait_ev, sig_ev, args.timeout)
    for i in range(args.count):
        order = FORMS if i % 2 == 0 else tuple(reversed(FORMS))
        for form in order:
            total, recorded = measure(c, dst, src, size, form, wait_ev, sig_ev, args.timeout)
            rtt[form].append(total)
            if recorded is not None:
                rec[form].append(recorded)
            time.sleep(args.interval_ms / 1e3)
    out: dict[str, Any] = {form: summary(v) for form, v in rtt.items()}
    out.update({f"{form} recorded": summary(v) for form, v in rec.items()})
    opens = []
    for _ in range(args.opens):
        ev = events.fresh()
        opens.append(measure(c, dst, src, size, "wait", ev, None, args.timeout)[0])
        time.sleep(args.interval_ms / 1e3)
    out["wait (open)"] = summary(opens)
    if args.backend == "cuda" and not args.skip_kernel:
        out["kernel"] = kernel_rows(c, dst, src, size, args)
    c.free(src)
    c.free(dst)
    return out


def render(results: dict[str, Any]) -> str:
    lines = [f"{'size':>8} {'form':<22} {'p50 us':>10} {'p99 us':>10} {'n':>6}  vs plain p50"]
    for size, rows in results["sizes"].items():
        base = rows["plain"]["p50"]
        flat = {k: v for k, v in rows.items() if k != "kernel"}
        kernel = rows.get("kernel", {})
        flat.update({k: v for k, v in kernel.items() if isinstance(v, dict)})
        for form, s in flat.items():
            delta = "" if form == "plain" or "kernel" in form or form == "event_wait_us" else f"{s['p50'] - base:+.1f}"
            lines.append(f"{size:>8} {form:<22} {s['p50']:>10.1f} {s['p99']:>10.1f} {s['n']:>6}  {delta}")
        if "kernel_cycles" in kernel:
            lines.append(f"{size:>8} (kernel of {kernel['kernel_cycles']} cycles)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description="what wait_event / signal_event cost per copy, through an idle daemon")
    ap.add_argument("--sizes", default="65536,4194304", help="copy sizes in bytes, comma-separated")
    ap.add_argument("--count", type=int, default=1000, help="measured copies per form and size")
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--opens", type=int, default=50, help="copies naming a fresh event (handle opens); at most ~200")
    ap.add_argument("--interval-ms", type=float, default=1.0, help="pause between copies (an idle daemon)")
    ap.add_argument("--kernel-us", type=float, default=200.0, help="length of the producing kernel of the kernel rows")
    ap.add_argument("--skip-kernel", action="store_true", help="no kernel rows (they need torch)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION__KEY=VALUE", help="daemon setting")
    ap.add_argument("--out", default="out/bench_gpu_events")
    ap.add_argument("--backend", choices=["cuda", "sim"], default="cuda", help="sim: a dry run on any machine")
    args = ap.parse_args()
    results: dict[str, Any] = {
        "args": vars(args),
        "priod": priod.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sizes": {},
    }
    where = os.path.join(args.out, "results.json")
    os.makedirs(args.out, exist_ok=True)
    env = {"PRIOD_LOG__LEVEL": '"warning"', **dict(s.split("=", 1) for s in args.set)}
    with (
        daemon_process(env, backend=args.backend, start_timeout=180) as d,
        priod.SyncClient(d.socket_path, copy_path="daemon", name="bench-events", spin_us=2000) as c,
    ):
        events = Events(c, args.backend)
        try:
            for size in (int(s) for s in args.sizes.split(",")):
                log(f"size {size}")
                results["sizes"][str(size)] = size_rows(c, events, size, args)
                save(where, results)  # after each size: a run that fails later keeps these
        finally:
            events.close()
        results["daemon_status"] = {k: c.status().get(k) for k in ("polls", "event_polls", "held_copies")}
    print(save(where, {**results, "table": render(results)})["table"])
    return 0


def save(path: str, results: dict[str, Any]) -> dict[str, Any]:
    """Write ``results`` as JSON to ``path``; return them."""
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    sys.exit(main())
