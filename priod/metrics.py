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

import os
import re
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server

from . import __version__
from .engines.base import LaneKey, Path

__all__ = ["Metrics", "gpu_label", "lane_labels", "nvidia_device_nodes"]

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0,
)
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


class Metrics:
    def __init__(self, gpu_names: Mapping[int, str] | None = None) -> None:
        self.gpu_names = dict(gpu_names or {})
        """The ``gpu`` label of each device ordinal (`gpu_label`): the engine's GPU UUIDs."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        # process_* (CPU seconds, resident memory, open fds against their limit, start time): the
        # daemon's own cost, and an fd leak, show without node_exporter's per-process view.
        ProcessCollector(registry=r)
        lane = ["gpu", "direction"]
        self.requests = Counter("priod_requests", "Copy requests finished, by lane, class and outcome", [*lane, "priority", "outcome"], registry=r)
        self.duration = Histogram(
            "priod_request_duration_seconds",
            "Copy latency from arrival to completion, by lane, class and path, for completed copies",
            [*lane, "priority", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "priod_queue_wait_seconds",
            "Time from arrival to the first chunk's submission, by lane, class and path, for completed copies",
            [*lane, "priority", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes = Counter("priod_copied_bytes", "Bytes copied, by lane and class", [*lane, "priority"], registry=r)
        self.deadline_misses = Counter("priod_deadline_misses", "Copies that finished after their deadline", [*lane, "priority"], registry=r)
        self.refused = Counter("priod_refused_requests", "Requests refused at once, by error code", ["code"], registry=r)
        self.queued_requests = Gauge("priod_queued_requests", "Copy requests waiting in priod's queues, by lane and class", [*lane, "priority"], registry=r)
        self.queued_bytes = Gauge("priod_queued_bytes", "Bytes of copies waiting in priod's queues, not yet handed out", [*lane, "priority"], registry=r)
        self.inflight = Gauge("priod_inflight_bytes", "Bytes submitted to the engine and not yet complete", [*lane, "path"], registry=r)
        self.busy = Counter(
            "priod_engine_busy_seconds",
            "Time the lane's copy engine spent busy (sim: copying; cuda: a chunk outstanding, as polled); rate() is the busy ratio",
            lane,
            registry=r,
        )
        self.urgent_path_latency = Gauge(
            "priod_urgent_path_latency_seconds",
            "Recent latency of each urgent path (smoothed, submission to completion seen), by lane and size bucket; the lower is chosen",
            [*lane, "path", "size_bytes"],
            registry=r,
        )
        self.direct_copies = Counter(
            "priod_direct_copies", "Direct urgent copies (a client's own DMA) announced on hold pages, by lane", lane, registry=r
        )
        self.direct_holds_cut = Counter(
            "priod_direct_holds_cut",
            "Direct copies whose hold on bulk was cut short (under way longer than direct_hold_max_ms, or past the client's hold budget)",
            lane,
            registry=r,
        )
        self.clients = Gauge("priod_clients", "Connected clients", registry=r)
        self.pinned = Gauge("priod_pinned_bytes", "Host bytes mapped and pinned for clients", registry=r)
        Info("priod_build", "priod version", registry=r).info({"version": __version__})
        self.engine = Info("priod_engine", "The copy engine serving this daemon (cuda or sim)", registry=r)
        Gauge(
            "priod_nvidia_device_nodes", "NVIDIA GPU device nodes (/dev/nvidiaN) visible to the daemon at start; > 0 with engine sim is a GPU left unserved", registry=r
        ).set(nvidia_device_nodes())
        self._engine_name = ""
        self._seen: dict[tuple[str, str, str], float] = {}
        """The running totals counters were last moved to, by counter name and lane labels."""
        self._series: dict[tuple[str, str, LaneKey, Path | None], tuple[Any, ...]] = {}

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
        """Account one finished copy (any outcome). Runs once per copy: the labelled series
        are looked up once per (class, outcome, lane, path) and kept, since a lookup costs ~5 us."""
        key = (priority, outcome, lane, path)
        series = self._series.get(key)
        if series is None:
            gpu, direction = lane_labels(lane, self.gpu_names)
            by_path = (gpu, direction, priority, path.value if path is not None else "none")
            series = self._series[key] = (
                self.requests.labels(gpu, direction, priority, outcome),
                self.duration.labels(*by_path),
                self.queue_wait.labels(*by_path),
                self.bytes.labels(gpu, direction, priority),
                self.deadline_misses.labels(gpu, direction, priority),
            )
        requests, duration, queue_wait, nbytes_total, misses = series
        requests.inc()
        if nbytes:
            nbytes_total.inc(nbytes)
        if outcome == "done":
            duration.observe(total_s)
            queue_wait.observe(queued_s)
            if missed_deadline:
                misses.inc()

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

    def add_direct(self, lane: LaneKey, copies: int, cut: int) -> None:
        """Move the direct-copy counters to the daemon's running totals for the lane."""
        self._advance(self.direct_copies, "direct", lane, copies)
        self._advance(self.direct_holds_cut, "cut", lane, cut)

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
