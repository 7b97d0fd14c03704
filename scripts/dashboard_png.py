#!/usr/bin/env python3
"""The Grafana dashboard's main panels as a PNG, from a live daemon's metrics under load.

    python scripts/dashboard_png.py --out docs/img/dashboard.png

Starts a sim daemon serving /metrics, runs scripts/loadtest.py against it (urgent copies both
ways under bulk streams both ways, a d2d client whose larger copies miss their deadline) plus a
client that keeps asking for more pinned memory than its limit (refused with ``limit``),
scrapes /metrics every ``--scrape-s`` seconds, and evaluates what each panel's query
(deploy/helm/priod/files/priod-dashboard.json) computes: ``rate()`` over a sliding window of
scrapes, ``sum by``, and ``histogram_quantile`` with Prometheus' interpolation inside a bucket.
Grafana itself cannot run here; the panel titles are the dashboard's own (tests check that).

The sim engine's h2d link is slowed (``--h2d-gbps``) so that bulk queues and the urgent path
choice show within a short run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from priod.client.client import connect
from priod.errors import LimitExceeded
from priod.testing import daemon_process
from priod.testing.scrape import Samples, Scraper, free_port

LOAD_MIX = (
    "class=urgent,dir=h2d,size=64KiB..1MiB,rate=40",
    "class=urgent,dir=d2h,size=4KiB..256KiB,rate=40",
    "class=bulk,dir=h2d,size=8MiB..32MiB,concurrency=3",
    "class=bulk,dir=d2h,size=8MiB,concurrency=2",
    # A deadline the larger copies cannot meet (4 MiB takes 0.5 ms on the sim's 8 GB/s d2d link), so
    # the misses panel has a series on any machine: with 3 ms the misses came only from a busy host.
    "class=normal,dir=d2d,size=256KiB..4MiB,rate=30,deadline_ms=0.3",
    "class=high,dir=h2d,size=1MiB..4MiB,rate=10",
)
Labels = frozenset[tuple[str, str]]


# -- the PromQL the panels use, over a list of timed scrapes ------------------------------------


@dataclass
class Scrape:
    t: float
    samples: Samples


def select(s: Samples, name: str, **match: str) -> dict[Labels, float]:
    """``name{match}``: every series of ``name`` whose labels include ``match``."""
    want = set(match.items())
    return {ls: v for (n, ls), v in s.items() if n == name and want <= ls}


def rate(now: Scrape, then: Scrape, name: str, **match: str) -> dict[Labels, float]:
    """``rate(name{match}[window])`` between two scrapes (a series absent at first starts at 0,
    as a counter created in between did; a reset is taken as counting again from 0)."""
    dt = now.t - then.t
    before = select(then.samples, name, **match)
    out = {}
    for ls, v in select(now.samples, name, **match).items():
        v0 = before.get(ls, 0.0)
        out[ls] = (v - v0 if v >= v0 else v) / dt
    return out


def sum_by(series: dict[Labels, float], by: Iterable[str]) -> dict[tuple[str, ...], float]:
    """``sum by (by) (series)``, keyed by the values of ``by`` in order."""
    keys = tuple(by)
    out: dict[tuple[str, ...], float] = {}
    for ls, v in series.items():
        d = dict(ls)
        k = tuple(d.get(b, "") for b in keys)
        out[k] = out.get(k, 0.0) + v
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' ``histogram_quantile`` over one histogram's cumulative bucket counts (by
    upper bound ``le``): linear interpolation inside the bucket the rank falls in, the lowest
    bucket starting at 0, and the highest finite bound where the rank is in +Inf. NaN without
    observations."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return math.nan
    total = buckets[bounds[-1]]
    if total <= 0 or math.isnan(total):
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return bounds[-2] if len(bounds) > 1 else math.nan
            if b <= 0:
                return b
            return (
                prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count) if count > prev_count else b
            )
        prev_bound, prev_count = b, count
    return bounds[-2]


def quantile_by(
    q: float, now: Scrape, then: Scrape, name: str, by: Iterable[str], **match: str
) -> dict[tuple[str, ...], float]:
    """``histogram_quantile(q, sum by (by, le) (rate(name_bucket{match}[window])))``."""
    keys = tuple(by)
    per = sum_by(rate(now, then, f"{name}_bucket", **match), (*keys, "le"))
    grouped: dict[tuple[str, ...], dict[float, float]] = {}
    for k, v in per.items():
        grouped.setdefault(k[:-1], {})[float(k[-1])] = v
    return {k: histogram_quantile(q, b) for k, b in grouped.items()}


# -- the panels ---------------------------------------------------------------------------------


@dataclass
class Panel:
    """One dashboard panel: its title (as in the dashboard), unit, and what it plots per window."""

    title: str
    unit: str
    compute: Callable[[Scrape, Scrape], dict[str, float]]
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def _fmt(key: tuple[str, ...], template: str) -> str:
    return template.format(*key)


def panels() -> list[Panel]:
    """The main panels, each computing what the dashboard's query of that title computes."""
    urgent = {"priority": "urgent"}
    return [
        Panel(
            "Urgent copy latency by GPU (p50, p99, p99.9)",
            "ms",
            lambda now, then: {
                f"p{label} gpu {k[0]}": v * 1e3
                for q, label in ((0.5, "50"), (0.99, "99"), (0.999, "99.9"))
                for k, v in quantile_by(q, now, then, "priod_request_duration_seconds", ("gpu",), **urgent).items()
            },
        ),
        Panel(
            "Bytes/s by class and direction",
            "GB/s",
            lambda now, then: {
                _fmt(k, "{} {}"): v / 1e9
                for k, v in sum_by(rate(now, then, "priod_copied_bytes_total"), ("priority", "direction")).items()
            },
        ),
        Panel(
            "Queue depth by class and direction",
            "requests",
            lambda now, _then: {
                _fmt(k, "{} {}"): v
                for k, v in sum_by(select(now.samples, "priod_queued_requests"), ("priority", "direction")).items()
            },
        ),
        Panel(
            "Urgent copies: express vs DMA",
            "copies/s",
            lambda now, then: {
                k[0]: v
                for k, v in sum_by(rate(now, then, "priod_request_duration_seconds_count", **urgent), ("path",)).items()
            },
        ),
        Panel(
            "Copy latency p99 by class and GPU",
            "ms",
            lambda now, then: {
                _fmt(k, "{} gpu {}"): v * 1e3
                for k, v in quantile_by(0.99, now, then, "priod_request_duration_seconds", ("priority", "gpu")).items()
            },
        ),
        Panel(
            "Copy engine busy ratio",
            "ratio",
            lambda now, then: {
                _fmt(k, "gpu {} {}"): v
                for k, v in sum_by(rate(now, then, "priod_engine_busy_seconds_total"), ("gpu", "direction")).items()
            },
        ),
        Panel(
            "Refusals by code",
            "requests/s",
            lambda now, then: {
                k[0]: v for k, v in sum_by(rate(now, then, "priod_refused_requests_total"), ("code",)).items()
            },
        ),
        Panel(
            "Deadline misses by class",
            "copies/s",
            lambda now, then: {
                k[0]: v for k, v in sum_by(rate(now, then, "priod_deadline_misses_total"), ("priority",)).items()
            },
        ),
    ]


def sim_on_gpu_node(s: Samples) -> int:
    """The "Engine = sim on a GPU node" stat: daemons on the sim engine that see GPU nodes."""
    sim = select(s, "priod_engine_info", engine="sim")
    nodes = sum(select(s, "priod_nvidia_device_nodes").values())
    return int(bool(sim) and nodes > 0)


# -- the run ------------------------------------------------------------------------------------


async def refused_client(socket_path: str, stop: threading.Event, every_s: float) -> int:
    """Asks for more pinned memory than [limits] max_pinned_bytes, over and over: refusals."""
    n = 0
    async with connect(socket_path, copy_path="daemon") as c:
        while not stop.is_set():
            try:
                await c.alloc_host(1 << 40)
            except LimitExceeded:
                n += 1
            await asyncio.sleep(every_s)
    return n


def run(args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    env = {
        "PRIOD_METRICS__PORT": str(port),
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_SIM__H2D_GBPS": str(args.h2d_gbps),
    }
    scrape = Scraper(port)
    scrapes: list[Scrape] = []
    with daemon_process(env) as d, tempfile.TemporaryDirectory(prefix="priod-dash-") as out:
        load = subprocess.Popen(
            [
                sys.executable,
                os.path.join(_ROOT, "scripts", "loadtest.py"),
                "--socket",
                d.socket_path,
                "--duration",
                str(args.duration),
                "--out",
                out,
                "--progress-s",
                "5",
            ]
            + [a for spec in LOAD_MIX for a in ("--client", spec)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": _ROOT},
        )
        stop = threading.Event()
        refusals: list[int] = []
        refuser = threading.Thread(
            target=lambda: refusals.append(asyncio.run(refused_client(d.socket_path, stop, args.refuse_every_s)))
        )
        refuser.start()
        t0 = time.monotonic()
        try:
            while load.poll() is None:
                scrapes.append(Scrape(time.monotonic() - t0, scrape()))
                time.sleep(args.scrape_s)
            time.sleep(args.scrape_s * 2)  # a refresh or two after the load: queues drained
            scrapes.append(Scrape(time.monotonic() - t0, scrape()))
        finally:
            stop.set()
            refuser.join()
            if load.poll() is None:
                load.kill()
            _, err = load.communicate()
        if load.returncode != 0:
            raise SystemExit(f"dashboard_png: the load test failed ({load.returncode}):\n{err[-3000:]}")
        with open(os.path.join(out, "loadtest.json")) as fp:
            load_report = json.load(fp)
    ps = panels()
    window = max(1, round(args.window_s / args.scrape_s))
    for i in range(window, len(scrapes)):
        now, then = scrapes[i], scrapes[i - window]
        for p in ps:
            for name, v in p.compute(now, then).items():
                if not math.isnan(v):
                    p.series.setdefault(name, []).append((now.t, v))
    last = scrapes[-1].samples
    return {
        "panels": ps,
        "sim_on_gpu_node": sim_on_gpu_node(last),
        "engine": next(iter(dict(k) for k in select(last, "priod_engine_info")), {}).get("engine", "?"),
        "scrapes": len(scrapes),
        "refusals_sent": sum(refusals),
        "load": load_report,
    }


def plot(result: dict[str, object], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps: list[Panel] = result["panels"]  # type: ignore[assignment]
    fig, axes = plt.subplots(4, 2, figsize=(15, 16), constrained_layout=True)
    for ax, p in zip(axes.flat, ps, strict=True):
        # Series that stayed at 0 (queues of classes that never waited) only crowd the legend.
        shown = {name: pts for name, pts in sorted(p.series.items()) if any(v for _, v in pts)}
        for name, pts in shown.items():
            ts, vs = zip(*pts, strict=True)
            ax.plot(ts, vs, label=name, linewidth=1.2)
        ax.set_title(p.title, fontsize=11, loc="left")
        ax.set_ylabel(p.unit)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        if p.unit == "ms":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        if shown:
            ax.legend(fontsize=7, loc="upper right", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
    stat = result["sim_on_gpu_node"]
    fig.suptitle(
        f"priod dashboard, main panels: a sim daemon under scripts/loadtest.py ({args.duration:.0f} s, h2d link {args.h2d_gbps} GB/s), "
        f"rates over {args.window_s:.0f} s windows of /metrics scrapes\n"
        f'engine = {result["engine"]}   ·   "Engine = sim on a GPU node" = {stat} (no /dev/nvidiaN here)',
        fontsize=12,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=args.dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="docs/img/dashboard.png", help="the PNG to write")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load")
    ap.add_argument(
        "--scrape-s",
        type=float,
        default=1.0,
        help="seconds between scrapes (the daemon refreshes gauges once a second)",
    )
    ap.add_argument("--window-s", type=float, default=5.0, help="rate() window")
    ap.add_argument("--h2d-gbps", type=float, default=0.5, help="the sim engine's h2d bandwidth")
    ap.add_argument("--refuse-every-s", type=float, default=0.5, help="how often the over-limit client asks")
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args(argv)
    result = run(args)
    plot(result, args.out, args)
    ps: list[Panel] = result["panels"]  # type: ignore[assignment]
    print(
        f"{args.out}: {result['scrapes']} scrapes, {sum(len(p.series) for p in ps)} series in {len(ps)} panels; "
        f"refusals sent {result['refusals_sent']}; engine {result['engine']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
