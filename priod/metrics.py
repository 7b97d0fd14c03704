"""Prometheus metrics, on their own registry (one per daemon, so tests can run several).

Names follow prometheus.io naming: one prefix, base units, ``_total`` on counters, no
per-client labels. Gauges that mirror state (queue depth, in-flight bytes, engine busy) are
refreshed by the daemon's loop from the same `statistics()` that feeds `priod status` (the
HTTP server runs in a thread, and must not read the loop's state itself).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from . import __version__

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0,
)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("priod_requests", "Copy requests finished, by class and outcome", ["priority", "outcome"], registry=r)
        self.duration = Histogram(
            "priod_request_duration_seconds", "Copy latency from arrival to completion", ["priority"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "priod_queue_wait_seconds", "Time from arrival to the first chunk's submission", ["priority"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.bytes = Counter("priod_bytes_copied", "Bytes copied, by direction", ["direction"], registry=r)
        self.express = Counter("priod_express_copies", "Copies that took the express lane", ["direction"], registry=r)
        self.deadline_misses = Counter("priod_deadline_misses", "Copies that finished after their deadline", ["priority"], registry=r)
        self.refused = Counter("priod_refused_requests", "Requests refused at once, by error code", ["code"], registry=r)
        self.queue_depth = Gauge("priod_queue_depth", "Queued copy requests by lane and class", ["lane", "priority"], registry=r)
        self.inflight = Gauge("priod_inflight_bytes", "Bytes submitted to the engine and not yet complete", ["lane", "path"], registry=r)
        self.busy = Gauge("priod_engine_busy_fraction", "Fraction of time the lane's copy engine was busy", ["lane"], registry=r)
        self.urgent_path_latency = Gauge(
            "priod_urgent_path_latency_seconds",
            "Recent latency of each urgent path (smoothed, submission to completion seen), by lane and size bucket; the lower is chosen",
            ["lane", "path", "size_bytes"],
            registry=r,
        )
        self.clients = Gauge("priod_clients", "Connected clients", registry=r)
        self.pinned = Gauge("priod_pinned_bytes", "Host bytes mapped and pinned for clients", registry=r)
        Info("priod_build", "priod version", registry=r).info({"version": __version__})
        self._series: dict[tuple[str, str, str], tuple[Any, ...]] = {}

    def copy_finished(
        self,
        priority: str,
        outcome: str,
        direction: str,
        nbytes: int,
        queued_s: float,
        total_s: float,
        express: bool,
        missed_deadline: bool,
    ) -> None:
        """Account one finished copy (any outcome). Runs once per copy: the labelled series
        are looked up once per (class, outcome) and kept, since a lookup costs ~5 us."""
        key = (priority, outcome, direction)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = (
                self.requests.labels(priority, outcome),
                self.duration.labels(priority),
                self.queue_wait.labels(priority),
                self.bytes.labels(direction),
                self.express.labels(direction),
                self.deadline_misses.labels(priority),
            )
        requests, duration, queue_wait, nbytes_total, express_total, misses = series
        requests.inc()
        if nbytes:
            nbytes_total.inc(nbytes)
        if outcome == "done":
            duration.observe(total_s)
            queue_wait.observe(queued_s)
            if express:
                express_total.inc()
            if missed_deadline:
                misses.inc()

    def serve(self, address: str, port: int) -> int:
        """Serve /metrics from a thread; returns the bound port (``port=0`` is not passed here)."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        return int(server.server_port)
