"""The Prometheus endpoint ([metrics] address/port): every documented metric is served, and
counters, histograms and gauges move with the work the daemon does.

Gauges are refreshed by the daemon's loop about once a second, so tests poll the endpoint
with a generous timeout rather than sleeping for a fixed time.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import priod
from priod.client.client import Client
from priod.common.types import Direction, LaneKey
from priod.daemon.metrics import gpu_label, lane_labels, nvidia_device_nodes
from priod.testing import DaemonProcess, daemon_process
from priod.testing.scrape import Samples, Scraper, free_port, get, total

MiB = 1 << 20
T = TypeVar("T")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


async def poll(check: Callable[[], T | None], timeout: float = 30.0, what: str = "metrics") -> T:
    """Scrape until ``check`` returns something truthy (gauges refresh about once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


SLOW = {"PRIOD_SIM__H2D_GBPS": "0.064", "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536"}


def gpu0(d: DaemonProcess) -> str:
    """The ``gpu`` label of the daemon's GPU 0: its UUID, as `priod status` shows it."""
    with priod.SyncClient(d.socket_path, copy_path="daemon") as c:
        return str(c.status()["gpus"][0]["uuid"])


@pytest.fixture(scope="module")
def metered() -> Iterator[tuple[DaemonProcess, Scraper]]:
    """A daemon serving /metrics on a free port, with a slow h2d link so queues can be seen."""
    port = free_port()
    env = {
        **SLOW,
        "PRIOD_METRICS__PORT": str(port),
        "PRIOD_SIM__FAULT_ON_NBYTES": "12345",
        "PRIOD_LOG__LEVEL": '"warning"',
    }
    with daemon_process(env) as d:
        yield d, Scraper(port)
    assert d.proc.returncode == 0, d.log()[-4000:]


async def test_counters_and_histograms_move_with_copies(metered: tuple[DaemonProcess, Scraper]) -> None:
    """Finished copies count by class and outcome, bytes by direction, express copies, deadline
    misses and refusals by code; latency and queue-wait histograms observe each done copy."""
    d, scrape = metered
    before = await asyncio.to_thread(scrape)
    async with priod.connect(d.socket_path, copy_path="daemon") as c:
        host, dev = await c.alloc_host(MiB), await c.alloc_device(MiB)
        urgent_path = (await c.copy(dev, host, priority="urgent")).path  # the faster path as measured so far
        for _ in range(3):
            await c.copy(host, dev, 256 * 1024, priority="bulk")
        assert (await c.copy(dev, host, 65536, priority="normal", deadline_ms=0.001)).missed_deadline
        with pytest.raises(priod.EngineError, match=r"^copy failed after 0 of 12345 bytes: injected engine fault"):
            await c.copy(dev, host, 12345)
        with pytest.raises(priod.InvalidRequest, match=r"^unknown class 'no-such-class'; the classes are "):
            await c.copy(dev, host, priority="no-such-class")
        with pytest.raises(
            priod.LimitExceeded, match=r"^1099511627776 more pinned bytes would exceed \[limits\] max_pinned_bytes = "
        ):
            await c.alloc_host(1 << 40)
        queued = [c.start_copy(dev, host, priority="bulk") for _ in range(4)]  # 16 ms each
        assert [await h.cancel() for h in queued][-1] < MiB
    after = await asyncio.to_thread(scrape)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    lane = {"gpu": gpu0(d)}
    assert delta("priod_requests_total", priority="urgent", outcome="done", direction="h2d", **lane) == 1
    assert (
        delta("priod_requests_total", priority="bulk", outcome="done")
        + delta("priod_requests_total", priority="bulk", outcome="cancelled")
        == 3 + 4
    )
    assert delta("priod_requests_total", priority="bulk", outcome="cancelled") >= 1
    assert delta("priod_requests_total", priority="normal", outcome="done") == 1
    assert delta("priod_requests_total", priority="normal", outcome="failed") == 1
    assert delta("priod_copied_bytes_total", direction="d2h", priority="bulk", **lane) == 3 * 256 * 1024
    assert delta("priod_copied_bytes_total", direction="d2h") == 3 * 256 * 1024
    assert delta("priod_copied_bytes_total", direction="h2d", priority="urgent") == MiB
    assert delta("priod_copied_bytes_total", direction="h2d") >= MiB + 65536
    # The path each completed copy took is a label of the histograms: the express choice is
    # their count by path.
    assert delta("priod_request_duration_seconds_count", priority="urgent", path=urgent_path) == 1
    assert delta("priod_request_duration_seconds_count", priority="bulk", path="dma", direction="d2h") == 3
    assert delta("priod_request_duration_seconds_count", path="express") == (urgent_path == "express")
    assert delta("priod_deadline_misses_total", priority="normal", direction="h2d", **lane) == 1
    assert delta("priod_refused_requests_total", code="bad_request") == 1
    assert delta("priod_refused_requests_total", code="limit") == 1
    for hist in ("priod_request_duration_seconds", "priod_queue_wait_seconds"):
        assert delta(f"{hist}_count", priority="urgent") == 1
        assert delta(f"{hist}_count", priority="bulk") >= 3
        assert delta(f"{hist}_sum", priority="bulk") > 0
        series = {"gpu": gpu0(d), "direction": "d2h", "priority": "bulk", "path": "dma"}
        buckets = sorted(
            (float(dict(k[1])["le"]), v)
            for k, v in after.items()
            if k[0] == f"{hist}_bucket" and set(series.items()) <= k[1]
        )
        assert buckets[-1] == (float("inf"), get(after, f"{hist}_count", **series))
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert scrape.families["priod_requests"] == "counter"
    assert scrape.families["priod_copied_bytes"] == "counter"
    assert scrape.families["priod_request_duration_seconds"] == "histogram"


def test_names_follow_prometheus_conventions(metered: tuple[DaemonProcess, Scraper]) -> None:
    """Counters end in _total, no name says fraction (ratios are rates of busy-seconds
    counters), units are base units, lanes are gpu and direction labels rather than one packed
    label, and the process collector and the engine's name are served."""
    _, scrape = metered
    s = scrape()
    for (name, labels), _v in s.items():
        if not name.startswith("priod_"):
            continue
        assert "lane" not in dict(labels), name
        assert not re.search(r"fraction|_ms$|_us$|_milliseconds|_microseconds|_kib|_mib|_gb", name), name
        family = scrape.families.get(re.sub(r"_(total|created|bucket|count|sum|info)$", "", name), "")
        if family == "counter" and not name.endswith("_created"):
            assert name.endswith("_total"), name
    assert get(s, "priod_engine_info", engine="sim") == 1
    assert get(s, "priod_nvidia_device_nodes") == nvidia_device_nodes()
    assert get(s, "priod_build_info", version=priod.__version__) == 1
    assert get(s, "process_resident_memory_bytes") > 10 * MiB
    assert get(s, "process_open_fds") > 3
    assert get(s, "process_cpu_seconds_total") > 0
    assert get(s, "process_max_fds") > 0


def test_lane_labels_come_from_one_helper() -> None:
    """The gpu label's value comes from gpu_label alone: the GPU's UUID where the engine names
    one, else the ordinal; a lane splits into its gpu and direction."""
    uuids = {3: "GPU-00000000-0000-0000-0000-000000000003"}
    assert gpu_label(3, uuids) == uuids[3]
    assert gpu_label(3) == gpu_label(3, {}) == "3"
    assert lane_labels(LaneKey(3, Direction.D2H), uuids) == (uuids[3], "d2h")
    assert lane_labels(LaneKey(3, Direction.D2H)) == ("3", "d2h")


async def test_gauges_show_queues_in_flight_busy_and_clients(metered: tuple[DaemonProcess, Scraper]) -> None:
    """Queued requests and bytes by lane and class, bytes in flight by lane and path, the
    engine's busy seconds, clients and pinned bytes follow the daemon's state within a refresh
    or two."""
    d, scrape = metered
    h2d = {"gpu": gpu0(d), "direction": "h2d"}
    busy_before = get(await asyncio.to_thread(scrape), "priod_engine_busy_seconds_total", **h2d)
    started = time.monotonic()
    async with priod.connect(d.socket_path, copy_path="daemon") as c:
        host, dev = await c.alloc_host(4 * MiB), await c.alloc_device(4 * MiB)
        # 65 ms each, 13 s in all: far longer than a gauge refresh; cancelled once seen.
        queued = [c.start_copy(dev, host, priority="bulk") for _ in range(200)]

        def busy() -> Samples | None:
            s = scrape()
            ok = (
                get(s, "priod_queued_requests", priority="bulk", **h2d) >= 1
                and get(s, "priod_inflight_bytes", path="dma", **h2d) > 0
            )
            return s if ok else None

        s = await poll(busy, what="bulk queued and in flight on gpu 0 h2d")
        assert get(s, "priod_queued_bytes", priority="bulk", **h2d) >= 4 * MiB
        assert get(s, "priod_clients") >= 1
        assert get(s, "priod_pinned_bytes") >= 4 * MiB
        assert get(s, "priod_queued_requests", priority="urgent", **h2d) == 0
        assert ("priod_inflight_bytes", frozenset({"gpu": gpu0(d), "direction": "d2h", "path": "express"}.items())) in s
        await asyncio.wait_for(asyncio.gather(*(h.cancel() for h in queued)), 60)
        await poll(
            lambda: get(scrape(), "priod_engine_busy_seconds_total", **h2d) > busy_before, what="a busy h2d engine"
        )
    s = await poll(
        lambda: (
            lambda s: (
                s
                if get(s, "priod_queued_requests", priority="bulk", **h2d) == 0 and get(s, "priod_clients") == 0
                else None
            )
        )(scrape()),
        what="queues drained and the client gone",
    )
    assert get(s, "priod_pinned_bytes") == 0
    assert get(s, "priod_queued_bytes", priority="bulk", **h2d) == 0
    assert get(s, "priod_inflight_bytes", path="dma", **h2d) == 0
    # A counter of seconds: it grew by no more than the time that passed.
    assert 0 < get(s, "priod_engine_busy_seconds_total", **h2d) - busy_before <= time.monotonic() - started + 1.0


def test_every_served_metric_is_documented(metered: tuple[DaemonProcess, Scraper]) -> None:
    """docs/operations.md lists exactly the metric families the endpoint serves."""
    _, scrape = metered
    scrape()
    # prometheus_client adds a "<name>_created" timestamp gauge beside each counter and
    # histogram series; the docs mention them once rather than per metric.
    served = {
        n
        for n in scrape.families
        if n.startswith("priod_") and not (n.endswith("_created") and n[: -len("_created")] in scrape.families)
    }
    suffix = {"counter": "_total", "info": "_info"}
    served_names = {n + suffix.get(scrape.families[n], "") for n in served}
    documented = set(re.findall(r"^\| `(priod_[a-z_]+)`", DOCS.read_text(), re.M))
    assert documented == served_names


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_reload_drops_queue_depth_of_removed_classes(tmp_path: Path) -> None:
    """After a reload removes a class, its queued-requests series goes away instead of freezing at
    its last value."""
    config = tmp_path / "priod.toml"
    config.write_text("[classes.urgent]\nstrict = true\n[classes.normal]\nweight = 2\n[classes.bulk]\nweight = 1\n")
    port = free_port()
    scrape = Scraper(port)
    with daemon_process({"PRIOD_METRICS__PORT": str(port)}, config=str(config)) as d:
        c = await Client.connect(d.socket_path, copy_path="daemon")
        await c.ping()  # the daemon's signal handlers are in place once it serves requests
        series = {"gpu": gpu0(d), "direction": "h2d", "priority": "normal"}
        await poll(
            lambda: ("priod_queued_requests", frozenset(series.items())) in scrape(), what="queue depth of class normal"
        )
        config.write_text("[classes.urgent]\nstrict = true\n[classes.bulk]\nweight = 1\n")
        d.proc.send_signal(signal.SIGHUP)
        await poll(
            lambda: ("priod_queued_requests", frozenset(series.items())) not in scrape(),
            what="class normal gone from queue depth",
        )
        assert ("priod_queued_requests", frozenset({**series, "priority": "bulk"}.items())) in scrape()
        await c.close()


def test_the_per_copy_series_expose_what_prometheus_clients_own_types_would() -> None:
    """The copy series are counted in plain Python and exposed by a custom collector (a lock-free
    copy path); the text a scrape reads must be what a Counter and a Histogram fed the same
    copies would give, bucket boundaries (le: value <= bound) included."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from priod.common.types import Path as CopyPath
    from priod.daemon.metrics import _LATENCY_BUCKETS, Metrics

    ours = Metrics({0: "GPU-0"})
    ref = CollectorRegistry()
    requests = Counter("priod_requests", "x", ["gpu", "direction", "priority", "outcome"], registry=ref)
    nbytes = Counter("priod_copied_bytes", "x", ["gpu", "direction", "priority"], registry=ref)
    duration = Histogram(
        "priod_request_duration_seconds",
        "x",
        ["gpu", "direction", "priority", "path"],
        buckets=_LATENCY_BUCKETS,
        registry=ref,
    )
    values = [*_LATENCY_BUCKETS, 0.0, 1e-7, 3e-5, 0.7, 11.0, 1e-3 + 1e-12]
    for i, v in enumerate(values):
        outcome = "done" if i % 5 else "cancelled"
        ours.copy_finished("urgent", outcome, LaneKey(0, Direction.H2D), CopyPath.DMA, 100 + i, v / 2, v, False)
        requests.labels("GPU-0", "h2d", "urgent", outcome).inc()
        nbytes.labels("GPU-0", "h2d", "urgent").inc(100 + i)
        if outcome == "done":
            duration.labels("GPU-0", "h2d", "urgent", "dma").observe(v)

    def lines(registry: CollectorRegistry, prefixes: tuple[str, ...]) -> set[str]:
        text = generate_latest(registry).decode()
        return {ln for ln in text.splitlines() if ln.startswith(prefixes) and "_created" not in ln}

    prefixes = ("priod_requests_total", "priod_copied_bytes_total", "priod_request_duration_seconds_")
    assert lines(ours.registry, prefixes) == lines(ref, prefixes)


async def test_direct_copies_made_through_a_page_show_in_status_and_the_urgent_latency_histogram(
    metered: tuple[DaemonProcess, Scraper],
) -> None:
    """Copies a client makes itself and announces on its hold page, one at a time with the daemon
    looking (a status looks) before, during and after each, are counted and timed: status shows
    them per lane with p50 / p99, and the scrape has them in priod_request_duration_seconds with
    priority="urgent", path="direct" (the family the urgent-latency panel and alert read), each
    no shorter than the copy and no longer than the looks around it."""
    d, scrape = metered
    lane = {"gpu": gpu0(d), "direction": "h2d", "priority": "urgent", "path": "direct"}
    before = await asyncio.to_thread(scrape)
    copies, hold_s = 4, 0.05
    with priod.SyncClient(d.socket_path, copy_path="daemon") as c:
        was = c.status()["direct"]  # the module's daemon: other runs' copies are counted there too
        page = c.hold_page()
        slot = page.slot(page.lanes[0]["device_uuid"], "h2d")
        spans = []
        for _ in range(copies):
            t0 = time.perf_counter()
            c.status()  # the look before
            page.begin(slot)
            c.status()  # sees it begin
            time.sleep(hold_s)  # the copy
            c.status()  # still under way
            page.end(slot)
            c.status()  # sees it over
            spans.append(time.perf_counter() - t0)
        st = c.status()["direct"]
        page.close()
    timed_before = was["timed"].get("gpu0/h2d", {}).get("copies", 0)
    assert st["copies"]["gpu0/h2d"] - was["copies"].get("gpu0/h2d", 0) == copies
    assert st["timed"]["gpu0/h2d"]["copies"] - timed_before == copies
    if not timed_before:  # the percentiles are over these copies alone
        assert (
            hold_s * 1e6 <= st["timed"]["gpu0/h2d"]["p50_us"] <= st["timed"]["gpu0/h2d"]["p99_us"] <= max(spans) * 1e6
        )

    def seen() -> Samples | None:
        s = scrape()
        return (
            s
            if get(s, "priod_request_duration_seconds_count", **lane)
            - total(before, "priod_request_duration_seconds_count", **lane)
            >= copies
            else None
        )

    after = await poll(seen, what="the direct copies in the latency histogram")
    assert (
        get(after, "priod_request_duration_seconds_count", **lane)
        - total(before, "priod_request_duration_seconds_count", **lane)
        == copies
    )
    added = get(after, "priod_request_duration_seconds_sum", **lane) - total(
        before, "priod_request_duration_seconds_sum", **lane
    )
    assert copies * hold_s <= added <= sum(spans)
    h2d = {"gpu": gpu0(d), "direction": "h2d"}
    assert get(after, "priod_direct_copies_total", **h2d) - total(before, "priod_direct_copies_total", **h2d) == copies
    assert total(after, "priod_request_duration_seconds_count", path="direct", direction="d2h") == 0


def test_the_direct_latency_series_is_what_a_histogram_fed_the_same_copies_would_give() -> None:
    """Direct copies' durations, kept by the hold scans (holds.py) and moved into the copy series
    at each refresh, read as a prometheus_client Histogram with the same labels and buckets would."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from priod.daemon.holds import DirectTimes
    from priod.daemon.metrics import _LATENCY_BUCKETS, Metrics

    ours = Metrics({0: "GPU-0"})
    ref = CollectorRegistry()
    duration = Histogram(
        "priod_request_duration_seconds",
        "x",
        ["gpu", "direction", "priority", "path"],
        buckets=_LATENCY_BUCKETS,
        registry=ref,
    )
    times = DirectTimes()
    for i, v in enumerate([*_LATENCY_BUCKETS, 1e-7, 3e-5, 0.7, 11.0, 1e-3 + 1e-12]):
        times.observe(v)
        duration.labels("GPU-0", "d2h", "urgent", "direct").observe(v)
        if i % 7 == 0:  # refreshed now and then, and the totals only move forward
            ours.set_direct_times(LaneKey(0, Direction.D2H), times.buckets, times.total_s)
    ours.set_direct_times(LaneKey(0, Direction.D2H), times.buckets, times.total_s)

    def lines(registry: CollectorRegistry) -> set[str]:
        text = generate_latest(registry).decode()
        return {
            ln for ln in text.splitlines() if ln.startswith("priod_request_duration_seconds_") and "_created" not in ln
        }

    assert lines(ours.registry) == lines(ref)
