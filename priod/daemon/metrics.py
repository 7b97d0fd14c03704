"""Prometheus metrics, on their own registry (one per daemon, so tests can run several).

Names follow prometheus.io's naming guidance: one prefix, base units (seconds, bytes) in the
name, ``_total`` on counters, ``_info`` on constant label carriers, no per-client labels. A
lane is two labels, ``gpu`` and ``direction``, so queries aggregate over either; `gpu_label`
is the one place the ``gpu`` value comes from. Gauges that mirror state (queues, in-flight
bytes, the engine's busy time) are refreshed by the daemon's loop from the same
`statistics()` that feeds `priod status` (report.py): the HTTP server runs in a thread and
must not read the loop's state itself.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from priod._version import __version__
from priod.common.types import LaneKey, Path

__all__ = ["LATENCY_BUCKETS", "Metrics", "gpu_label", "lane_labels", "nvidia_device_nodes"]

LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
    2.5,
    10.0,
)
"""Bounds of the latency histograms (seconds); direct copies are timed into the same (holds.py)."""
_LATENCY_BUCKETS = LATENCY_BUCKETS
DIRECT_PRIORITY = "urgent"
DIRECT_PATH = "direct"
"""The ``priority`` and ``path`` labels of direct copies in ``priod_request_duration_seconds``: the
class that takes the direct path, beside its copies through the daemon, so that one family (and
the urgent-latency panel and alert, which select ``priority="urgent"``) covers both paths."""
_NVIDIA_NODE = re.compile(r"nvidia[0-9]+")


def gpu_label(device: int, names: Mapping[int, str] | None = None) -> str:
    """The ``gpu`` label's value for a device ordinal: the GPU's UUID where the engine reports
    one (``names``: `Engine.device_uuids`), stable across ``CUDA_VISIBLE_DEVICES`` remaps and
    reboots; else the ordinal as a string. Every series with a ``gpu`` label gets its value here."""
    return (names.get(device) if names else None) or str(device)


def lane_labels(lane: LaneKey, names: Mapping[int, str] | None = None) -> tuple[str, str]:
    """``(gpu, direction)`` label values of a lane. A peer lane's ``direction`` names its
    destination, ``peer:<gpu label>`` (``gpu`` is the source), so each pair is its own series
    and ``direction=~"peer:.*"`` selects them all without a label that other lanes lack."""
    if lane.peer is not None:
        return gpu_label(lane.device, names), f"peer:{gpu_label(lane.peer, names)}"
    return gpu_label(lane.device, names), lane.direction.value


def nvidia_device_nodes(dev: str = "/dev") -> int:
    """NVIDIA GPU device nodes (``/dev/nvidiaN``) visible to this process.

    Counted apart from the engine so that a daemon that fell back to the sim engine on a GPU
    node (driver too old for cuda-bindings, bindings missing from the image) can be told from
    one on a machine without GPUs: the first is an outage that looks healthy.
    """
    try:
        return sum(1 for name in os.listdir(dev) if _NVIDIA_NODE.fullmatch(name))
    except OSError:
        return 0


@dataclass(slots=True)
class _Series:
    """One copy key's counts: where its figures go in `CopySeries`."""

    requests: list[int]
    """[finished copies] of (lane, class, outcome)"""
    counts: list[int]
    """[bytes, deadline misses] of (lane, class)"""
    duration: list[float]
    """Per bucket (and one past the last), then the sum: of (lane, class, path)"""
    queue_wait: list[float]


class CopySeries:
    """The series every finished copy adds to, kept in plain Python on the daemon's loop and
    turned into metric families when scraped (a prometheus_client custom collector).

    Why not Counter and Histogram: their updates take a lock each, and a copy made five of them
    (~10 us of the loop per copy, 12% of a small copy's cost on the sim engine); here a copy is a
    dict lookup, a bisect and a few list updates. The HTTP thread reads copies of the lists
    (``list()`` of a list or dict is one step under the GIL), so a scrape may see a copy counted
    in one family and not yet in the next, never a torn number.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = list(bounds)
        self._le: list[str] = [floatToGoString(b) for b in (*bounds, math.inf)]  # type: ignore[no-untyped-call]
        """The ``le`` label of each bucket, as prometheus_client writes it."""
        self.requests: dict[tuple[str, ...], list[int]] = {}
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.duration: dict[tuple[str, ...], list[float]] = {}
        self.queue_wait: dict[tuple[str, ...], list[float]] = {}

    def series(self, gpu: str, direction: str, priority: str, outcome: str, path: str) -> _Series:
        """The lists a copy of this kind adds to, made (at zero) on first use, so that a
        series exists from the first copy of its kind."""
        slots = len(self.bounds) + 2
        return _Series(
            self.requests.setdefault((gpu, direction, priority, outcome), [0]),
            self.counts.setdefault((gpu, direction, priority), [0, 0]),
            self.duration.setdefault((gpu, direction, priority, path), [0.0] * slots),
            self.queue_wait.setdefault((gpu, direction, priority, path), [0.0] * slots),
        )

    def direct(self, gpu: str, direction: str) -> list[float]:
        """The duration histogram of a lane's direct copies (per bucket, one past the last, then
        the sum), made at zero on first use; moved to holds.py's running totals (`Metrics.set_direct_times`)."""
        return self.duration.setdefault((gpu, direction, DIRECT_PRIORITY, DIRECT_PATH), [0.0] * (len(self.bounds) + 2))

    def add(self, s: _Series, nbytes: int, queued_s: float, total_s: float, done: bool, missed: bool) -> None:
        s.requests[0] += 1
        s.counts[0] += nbytes
        if done:
            bounds = self.bounds
            s.duration[bisect.bisect_left(bounds, total_s)] += 1
            s.duration[-1] += total_s
            s.queue_wait[bisect.bisect_left(bounds, queued_s)] += 1
            s.queue_wait[-1] += queued_s
            if missed:
                s.counts[1] += 1

    def collect(self) -> Iterator[Metric]:
        lane = ["gpu", "direction"]
        requests = CounterMetricFamily(
            "priod_requests",
            "Copy requests finished, by lane, class and outcome",
            labels=[*lane, "priority", "outcome"],
        )
        for labels, (n,) in list(self.requests.items()):
            requests.add_metric(labels, n)
        nbytes = CounterMetricFamily(
            "priod_copied_bytes", "Bytes copied, by lane and class", labels=[*lane, "priority"]
        )
        misses = CounterMetricFamily(
            "priod_deadline_misses", "Copies that finished after their deadline", labels=[*lane, "priority"]
        )
        for labels, (b, m) in list(self.counts.items()):
            nbytes.add_metric(labels, b)
            misses.add_metric(labels, m)
        yield from (requests, nbytes, misses)
        for name, doc, table in (
            (
                "priod_request_duration_seconds",
                "Copy latency from arrival to completion, by lane, class and path, for completed copies; path direct: a client's own urgent copy announced on its hold page, as long as the daemon's scans saw it at most",
                self.duration,
            ),
            (
                "priod_queue_wait_seconds",
                "Time from arrival to the first chunk's submission, by lane, class and path, for completed copies",
                self.queue_wait,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=[*lane, "priority", "path"])
            for labels, hist in list(table.items()):
                counts = list(hist)
                cumulative: list[tuple[str, float]] = []
                running = 0.0
                for le, in_bucket in zip(self._le, counts[:-1], strict=True):
                    running += in_bucket
                    cumulative.append((le, running))
                family.add_metric(labels, cumulative, sum_value=counts[-1])
            yield family


class Metrics:
    def __init__(self, gpu_names: Mapping[int, str] | None = None) -> None:
        self.gpu_names = dict(gpu_names or {})
        """The ``gpu`` label of each device ordinal (`gpu_label`): the engine's GPU UUIDs."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        # process_* (CPU seconds, resident memory, open fds against their limit, start time): the
        # daemon's own cost, and an fd leak, show without node_exporter's per-process view.
        ProcessCollector(registry=r)
        lane = ["gpu", "direction"]
        self.copies = CopySeries(_LATENCY_BUCKETS)
        """The per-copy series (requests, bytes, deadline misses, latency histograms)."""
        r.register(self.copies)
        self.refused = Counter(
            "priod_refused_requests", "Requests refused at once, by error code", ["code"], registry=r
        )
        self.queued_requests = Gauge(
            "priod_queued_requests",
            "Copy requests waiting in priod's queues, by lane and class",
            [*lane, "priority"],
            registry=r,
        )
        self.queued_bytes = Gauge(
            "priod_queued_bytes",
            "Bytes of copies waiting in priod's queues, not yet handed out",
            [*lane, "priority"],
            registry=r,
        )
        self.inflight = Gauge(
            "priod_inflight_bytes", "Bytes submitted to the engine and not yet complete", [*lane, "path"], registry=r
        )
        self.busy = Counter(
            "priod_engine_busy_seconds",
            "Time the lane's copy engine spent busy (sim: copying; cuda: a chunk outstanding, as polled); rate() is the busy ratio",
            lane,
            registry=r,
        )
        self.urgent_path_latency = Gauge(
            "priod_urgent_path_latency_seconds",
            "Recent latency of each urgent path (smoothed, submission to completion seen), by lane, size bucket and form (copy or batch); the lower is chosen",
            [*lane, "path", "size_bytes", "form"],
            registry=r,
        )
        self.urgent_beat = Gauge(
            "priod_urgent_beat_seconds",
            "The steady beat a lane last learned from its urgent copies, that bulk runs long chunks between ([scheduler] beat_block_us); 0: none",
            lane,
            registry=r,
        )
        self.direct_copies = Counter(
            "priod_direct_copies",
            "Direct urgent copies (a client's own DMA) announced on hold pages, by lane",
            lane,
            registry=r,
        )
        self.direct_holds_cut = Counter(
            "priod_direct_holds_cut",
            "Direct copies whose hold on bulk was cut short (under way longer than direct_hold_max_ms, or past the client's hold budget)",
            lane,
            registry=r,
        )
        self.direct_steps_back = Counter(
            "priod_direct_steps_back",
            "Hold-page begun counters read lower than before, no copy counted: a client whose page writer is not one 8-byte store per counter",
            lane,
            registry=r,
        )
        self.clients = Gauge("priod_clients", "Connected clients", registry=r)
        self.pinned = Gauge("priod_pinned_bytes", "Host bytes mapped and pinned for clients", registry=r)
        Info("priod_build", "priod version", registry=r).info({"version": __version__})
        self.engine = Info("priod_engine", "The copy engine serving this daemon (cuda or sim)", registry=r)
        Gauge(
            "priod_nvidia_device_nodes",
            "NVIDIA GPU device nodes (/dev/nvidiaN) visible to the daemon at start; > 0 with engine sim is a GPU left unserved",
            registry=r,
        ).set(nvidia_device_nodes())
        self._engine_name = ""
        self._seen: dict[tuple[str, str, str], float] = {}
        """The running totals counters were last moved to, by counter name and lane labels."""
        self._series: dict[tuple[str, str, LaneKey, Path | None], _Series] = {}

    def copy_finished(
        self,
        priority: str,
        outcome: str,
        lane: LaneKey,
        path: Path | None,
        nbytes: int,
        queued_s: float,
        total_s: float,
        missed_deadline: bool,
    ) -> None:
        """Account one finished copy (any outcome). Runs once per copy: its series are found by
        one dict lookup per (class, outcome, lane, path), their labels worked out once."""
        key = (priority, outcome, lane, path)
        series = self._series.get(key)
        if series is None:
            gpu, direction = lane_labels(lane, self.gpu_names)
            series = self._series[key] = self.copies.series(
                gpu, direction, priority, outcome, path.value if path is not None else "none"
            )
        self.copies.add(series, nbytes, queued_s, total_s, outcome == "done", missed_deadline)

    def set_engine(self, name: str) -> None:
        """Label `priod_engine_info` with the engine's name (set once; cheap to repeat)."""
        if name != self._engine_name:
            self._engine_name = name
            self.engine.info({"engine": name})

    def forget_classes(self) -> None:
        """Drop the per-class queue series (after a reload that may have removed classes)."""
        self.queued_requests.clear()
        self.queued_bytes.clear()

    def add_busy(self, lane: LaneKey, busy_seconds: float) -> None:
        """Move the busy counter to ``busy_seconds``, the engine's running total for the lane."""
        self._advance(self.busy, "busy", lane, busy_seconds)

    def add_direct(self, lane: LaneKey, copies: int, cut: int, stepped_back: int) -> None:
        """Move the direct-copy counters to the daemon's running totals for the lane."""
        self._advance(self.direct_copies, "direct", lane, copies)
        self._advance(self.direct_holds_cut, "cut", lane, cut)
        self._advance(self.direct_steps_back, "stepped_back", lane, stepped_back)

    def set_direct_times(self, lane: LaneKey, buckets: list[int], total_s: float) -> None:
        """Move the lane's direct-copy duration histogram to the daemon's running totals
        (holds.py `DirectTimes`: counts per bucket, one past the last, and their sum)."""
        hist = self.copies.direct(*lane_labels(lane, self.gpu_names))
        hist[:] = [*buckets, total_s]  # one step under the GIL: a scrape reads it whole

    def _advance(self, counter: Counter, name: str, lane: LaneKey, total: float) -> None:
        """Move ``counter``'s series for ``lane`` up to ``total``, a running total kept elsewhere."""
        labels = lane_labels(lane, self.gpu_names)
        key = (name, *labels)
        seen = self._seen.get(key)
        if seen is None:
            counter.labels(*labels)  # the series exists (at 0) before the lane's first event
            seen = self._seen[key] = 0.0
        if total > seen:
            counter.labels(*labels).inc(total - seen)
            self._seen[key] = total

    def serve(self, address: str, port: int) -> int:
        """Serve /metrics from a thread; returns the bound port (``port=0`` is not passed here)."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        return int(server.server_port)
