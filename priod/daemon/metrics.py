"""Prometheus metrics, on their own registry (one per daemon, so tests can run several).

Names follow prometheus.io's naming guidance: one prefix, base units (seconds, bytes) in the
name, ``_total`` on counters, ``_info`` on constant label carriers, no per-client labels. A
GPU is two labels as NVIDIA's DCGM exporter writes them, ``gpu`` (the ordinal) and ``UUID``, so
that priod's series join DCGM's on either; a lane is those and ``direction``, so queries
aggregate over any. `gpu_labels` is the one place their values come from. Every counter and
histogram series has a ``_created`` series beside it, the hand-counted ones (`CopySeries`) as
prometheus_client's own (both leave them out under ``PROMETHEUS_DISABLE_CREATED_SERIES``).
Gauges that mirror state (queues, in-flight bytes, the engine's busy time) are refreshed by the
daemon's loop from the same `statistics()` that feeds `priod status` (report.py): the HTTP
server runs in a thread and must not read the loop's state itself.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Generic, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector, make_wsgi_app
from prometheus_client import metrics as _client_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from priod._version import __version__
from priod.common.types import LaneKey, Path

__all__ = [
    "GPU_LABELS",
    "LANE_LABELS",
    "LATENCY_BUCKETS",
    "Metrics",
    "gpu_labels",
    "lane_labels",
    "nvidia_device_nodes",
]

LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    75e-6,
    100e-6,
    150e-6,
    200e-6,
    250e-6,
    300e-6,
    400e-6,
    500e-6,
    600e-6,
    750e-6,
    1e-3,
    2e-3,
    5e-3,
    10e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
    10.0,
)
"""Bounds of the latency histograms (seconds); direct copies are timed into the same (holds.py).
Fine from 50 to 750 us, where urgent copies are on a GPU (README.md's tables: p50 67-495 us,
p99 120-597 us; no bound more than 1.5 times the one before), with a bound at each urgent-latency
alert's threshold (0.6 ms and 0.75 ms: deploy/helm/priod/files/priod-rules.yaml) so that
``histogram_quantile`` is exact there; coarse above, to 10 s for bulk copies. 21 bounds: with
+Inf, ``_sum``, ``_count`` and ``_created``, 25 series per label set of a histogram."""
_LATENCY_BUCKETS = LATENCY_BUCKETS
DIRECT_PRIORITY = "urgent"
DIRECT_PATH = "direct"
"""The ``priority`` and ``path`` labels of direct copies in ``priod_request_duration_seconds``: the
class that takes the direct path, beside its copies through the daemon, so that one family (and
the urgent-latency panel, which selects ``priority="urgent"``) covers both paths; the alerts
take each path apart (``PriodUrgentLatencyHigh``, ``PriodDirectLatencyHigh``)."""
_NVIDIA_NODE = re.compile(r"nvidia[0-9]+")


GPU_LABELS = ("gpu", "UUID")
"""The labels that name a GPU, as NVIDIA's DCGM exporter names them (``DCGM_FI_DEV_*{gpu="0",
UUID="GPU-..."}``): the daemon's ordinal, and the GPU's UUID as ``nvidia-smi -L`` prints it."""
LANE_LABELS = (*GPU_LABELS, "direction")
"""The labels of a lane: its GPU's, then ``direction``."""


def gpu_labels(device: int, uuids: Mapping[int, str] | None = None) -> tuple[str, str]:
    """``(gpu, UUID)`` label values of a device ordinal: the ordinal as a string, as DCGM's
    ``gpu`` label (the daemon sees every GPU of the host, so its ordinals are the host's), and
    the UUID the engine reports (``uuids``: `Engine.device_uuids`), stable across
    ``CUDA_VISIBLE_DEVICES`` remaps and reboots; "" where it reports none. Every series with a
    ``gpu`` label gets both values here."""
    return str(device), (uuids.get(device) if uuids else None) or ""


def lane_labels(lane: LaneKey, uuids: Mapping[int, str] | None = None) -> tuple[str, str, str]:
    """``(gpu, UUID, direction)`` label values of a lane. A peer lane's ``direction`` names its
    destination, ``peer:<ordinal>`` (``gpu`` and ``UUID`` are the source's), so each pair is
    its own series and ``direction=~"peer:.*"`` selects them all without a label that other
    lanes lack."""
    gpu, uuid = gpu_labels(lane.device, uuids)
    return gpu, uuid, f"peer:{lane.peer}" if lane.peer is not None else lane.direction.value


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


N = TypeVar("N", int, float)


def _use_created() -> bool:
    """Whether prometheus_client writes ``_created`` series (``PROMETHEUS_DISABLE_CREATED_SERIES``
    or `prometheus_client.disable_created_metrics` turn them off): the hand-counted families
    follow its counters and histograms."""
    return bool(getattr(_client_metrics, "_use_created", True))


@dataclass(slots=True)
class _Table(Generic[N]):
    """One family's series: a list of numbers per label values, made at zero on first use, and
    when each was made (its ``_created`` series, as prometheus_client's own counters have)."""

    width: int
    zero: N
    rows: dict[tuple[str, ...], list[N]] = field(default_factory=dict)
    created: dict[tuple[str, ...], float] = field(default_factory=dict)

    def row(self, key: tuple[str, ...]) -> list[N]:
        got = self.rows.get(key)
        if got is None:
            self.created[key] = time.time()  # before the row: a scrape that sees it sees this
            got = self.rows[key] = [self.zero] * self.width
        return got


@dataclass(slots=True)
class _Series:
    """One copy key's counts: where its figures go in `CopySeries`."""

    requests: list[int]
    """[finished copies] of (lane, class, outcome)"""
    counts: list[int]
    """[bytes, deadline misses] of (lane, class)"""
    duration: list[float] | None
    """Per bucket (and one past the last), then the sum: of (lane, class, path); None for a copy
    that did not complete (it is timed nowhere), or one that never ran (it has no path)."""
    queue_wait: list[float] | None


class CopySeries:
    """The series every finished copy adds to, kept in plain Python on the daemon's loop and
    turned into metric families when scraped (a prometheus_client custom collector).

    Why not Counter and Histogram: their updates take a lock each, and a copy made five of them
    (~10 us of the loop per copy, 12% of a small copy's cost on the sim engine); here a copy is a
    dict lookup, a bisect and a few list updates. The HTTP thread reads copies of the lists
    (``list()`` of a list or dict is one step under the GIL), so a scrape may see a copy counted
    in one family and not yet in the next, never a torn number.

    A series is made on first use, so that it exists from the first copy of its kind; the latency
    histograms' from the first completed copy of their kind only: a copy cancelled or failed
    before it ran has no path, and one that did not complete is not timed, so neither makes a
    latency series (``priod_requests_total`` with its outcome counts both).
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = list(bounds)
        self._le: list[str] = [floatToGoString(b) for b in (*bounds, math.inf)]  # type: ignore[no-untyped-call]
        """The ``le`` label of each bucket, as prometheus_client writes it."""
        slots = len(bounds) + 2
        self.requests: _Table[int] = _Table(1, 0)
        self.counts: _Table[int] = _Table(2, 0)
        self.duration: _Table[float] = _Table(slots, 0.0)
        self.queue_wait: _Table[float] = _Table(slots, 0.0)

    def series(self, lane: tuple[str, str, str], priority: str, outcome: str, path: str | None) -> _Series:
        """The lists a copy of this kind adds to (``lane``: `lane_labels`); ``path`` None: the
        copy is timed nowhere (it did not complete, or never ran)."""
        timed = (*lane, priority, path) if path is not None else None
        return _Series(
            self.requests.row((*lane, priority, outcome)),
            self.counts.row((*lane, priority)),
            self.duration.row(timed) if timed else None,
            self.queue_wait.row(timed) if timed else None,
        )

    def direct(self, lane: tuple[str, str, str]) -> list[float]:
        """The duration histogram of a lane's direct copies (per bucket, one past the last, then
        the sum), made at zero on first use; moved to holds.py's running totals (`Metrics.set_direct_times`)."""
        return self.duration.row((*lane, DIRECT_PRIORITY, DIRECT_PATH))

    def add(self, s: _Series, nbytes: int, queued_s: float, total_s: float, missed: bool) -> None:
        s.requests[0] += 1
        s.counts[0] += nbytes
        if s.duration is not None and s.queue_wait is not None:
            bounds = self.bounds
            s.duration[bisect.bisect_left(bounds, total_s)] += 1
            s.duration[-1] += total_s
            s.queue_wait[bisect.bisect_left(bounds, queued_s)] += 1
            s.queue_wait[-1] += queued_s
            if missed:
                s.counts[1] += 1

    def collect(self) -> Iterator[Metric]:
        created = _use_created()
        lane = list(LANE_LABELS)
        requests = CounterMetricFamily(
            "priod_requests",
            "Copy requests finished, by lane, class and outcome",
            labels=[*lane, "priority", "outcome"],
        )
        made = self.requests.created
        for labels, (n,) in list(self.requests.rows.items()):
            requests.add_metric(labels, n, created=made.get(labels) if created else None)
        nbytes = CounterMetricFamily(
            "priod_copied_bytes", "Bytes copied, by lane and class", labels=[*lane, "priority"]
        )
        misses = CounterMetricFamily(
            "priod_deadline_misses", "Copies that finished after their deadline", labels=[*lane, "priority"]
        )
        made = self.counts.created
        for labels, (b, m) in list(self.counts.rows.items()):
            at = made.get(labels) if created else None
            nbytes.add_metric(labels, b, created=at)
            misses.add_metric(labels, m, created=at)
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
            names = [*lane, "priority", "path"]
            family = HistogramMetricFamily(name, doc, labels=names)
            made = table.created
            for labels, hist in list(table.rows.items()):
                counts = list(hist)
                cumulative: list[tuple[str, float]] = []
                running = 0.0
                for le, in_bucket in zip(self._le, counts[:-1], strict=True):
                    running += in_bucket
                    cumulative.append((le, running))
                family.add_metric(labels, cumulative, sum_value=counts[-1])
                at = made.get(labels)
                if created and at is not None:  # add_metric takes no created time for histograms
                    family.samples.append(Sample(f"{name}_created", dict(zip(names, labels, strict=True)), at))
            yield family


class Metrics:
    def __init__(self, gpu_names: Mapping[int, str] | None = None) -> None:
        self.gpu_names = dict(gpu_names or {})
        """The ``UUID`` label of each device ordinal (`gpu_labels`): the engine's GPU UUIDs."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        # process_* (CPU seconds, resident memory, open fds against their limit, start time): the
        # daemon's own cost, and an fd leak, show without node_exporter's per-process view.
        ProcessCollector(registry=r)
        lane = list(LANE_LABELS)
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
        self._seen: dict[tuple[str, str, str, str], float] = {}
        """The running totals counters were last moved to, by counter name and lane labels."""
        self._series: dict[tuple[str, str, LaneKey, Path | None], _Series] = {}
        self._lanes: dict[LaneKey, tuple[str, str, str]] = {}

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
        one dict lookup per (class, outcome, lane, path), their labels worked out once. Only a
        completed copy is timed: one cancelled or failed is counted by outcome and bytes, and one
        that never ran (``path`` None: cancelled while queued, or its region freed) makes no
        latency series."""
        key = (priority, outcome, lane, path)
        series = self._series.get(key)
        if series is None:
            timed = path.value if path is not None and outcome == "done" else None
            series = self._series[key] = self.copies.series(self.lane_labels(lane), priority, outcome, timed)
        self.copies.add(series, nbytes, queued_s, total_s, missed_deadline)

    def lane_labels(self, lane: LaneKey) -> tuple[str, str, str]:
        """``(gpu, UUID, direction)`` of a lane (`lane_labels` with this daemon's UUIDs), worked out
        once per lane: what the gauges' and counters' ``labels()`` take first."""
        got = self._lanes.get(lane)
        if got is None:
            got = self._lanes[lane] = lane_labels(lane, self.gpu_names)
        return got

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
        hist = self.copies.direct(self.lane_labels(lane))
        hist[:] = [*buckets, total_s]  # one step under the GIL: a scrape reads it whole

    def _advance(self, counter: Counter, name: str, lane: LaneKey, total: float) -> None:
        """Move ``counter``'s series for ``lane`` up to ``total``, a running total kept elsewhere."""
        labels = self.lane_labels(lane)
        key = (name, *labels)
        seen = self._seen.get(key)
        if seen is None:
            counter.labels(*labels)  # the series exists (at 0) before the lane's first event
            seen = self._seen[key] = 0.0
        if total > seen:
            counter.labels(*labels).inc(total - seen)
            self._seen[key] = total

    def serve(
        self,
        address: str,
        port: int,
        loop: asyncio.AbstractEventLoop | None = None,
        refresh: Callable[[], None] | None = None,
    ) -> int:
        """Serve /metrics, and /healthz for a liveness probe, from a thread; returns the bound
        port (``port=0`` is not passed here). /healthz answers 200 once ``loop`` has run a
        callback within `HEALTH_TIMEOUT_S`, 503 when it has not (a stuck event loop): a probe
        that checks what matters, with no process started and no log line per probe.

        A scrape first has ``loop`` run ``refresh`` (the gauges read from the daemon's state, on
        the loop's thread, which owns it), so the figures are those of the scrape and a daemon
        nobody scrapes spends nothing on them. At most one refresh runs per `REFRESH_MIN_S`, so
        a flood of scrapes cannot take the loop from the clients; a loop that does not answer
        within `HEALTH_TIMEOUT_S` leaves the last figures."""
        scrape = make_wsgi_app(self.registry)
        refreshed = -math.inf
        lock = threading.Lock()

        def fresh() -> None:
            nonlocal refreshed
            with lock:  # scrapes come on threads of their own
                if loop is None or refresh is None or time.monotonic() - refreshed < REFRESH_MIN_S:
                    return
                _run_on_loop(loop, refresh, HEALTH_TIMEOUT_S)
                refreshed = time.monotonic()

        def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/healthz":
                fresh()
                body: Iterable[bytes] = scrape(environ, start_response)
                return body
            alive = loop is None or _loop_answers(loop, HEALTH_TIMEOUT_S)
            start_response("200 OK" if alive else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if alive else b"the event loop has not answered for %.0f s\n" % HEALTH_TIMEOUT_S]

        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        httpd: WSGIServer = make_server(address, port, app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=httpd.serve_forever, name="priod-metrics", daemon=True).start()
        return int(httpd.server_port)


REFRESH_MIN_S = 0.1
"""The least time between two scrapes' refreshes of the gauges on the event loop: ten a second at
most, whatever the scrapes. A refresh took 73 us of the loop (2-vCPU VM, one sim GPU, no client,
warm); more lanes and clients make it longer, a scrape flood no more frequent."""

HEALTH_TIMEOUT_S = 2.0
"""How long /healthz waits for the event loop to run a callback: a loop turn takes well under a
millisecond, so 2 s of silence is a stuck loop, not a busy one."""


def _loop_answers(loop: asyncio.AbstractEventLoop, timeout: float) -> bool:
    return _run_on_loop(loop, lambda: None, timeout)


def _run_on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], None], timeout: float) -> bool:
    """Run ``call`` on ``loop`` from another thread and wait for it; False if the loop did not
    run it within ``timeout`` seconds (or is closed)."""
    ran = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            ran.set()

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # the loop is closed
        return False
    return ran.wait(timeout)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log: Prometheus scrapes and probes would fill the journal."""

    def log_message(self, format: str, *args: object) -> None:
        pass
