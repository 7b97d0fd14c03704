"""The Prometheus endpoint ([metrics] address/port): every documented metric is served with its
documented labels, GPUs are labelled as DCGM exporter labels them, counters, histograms and
gauges move with the work the daemon does, and the latency buckets and alerts fit the figures
README.md gives.

Gauges are refreshed by the daemon's loop about once a second, so tests poll the endpoint
with a generous timeout rather than sleeping for a fixed time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import priod
from priod.client.client import Client
from priod.common.types import Direction, LaneKey
from priod.daemon.metrics import (
    LANE_LABELS,
    LATENCY_BUCKETS,
    REFRESH_MIN_S,
    gpu_labels,
    lane_labels,
    nvidia_device_nodes,
)
from priod.testing import DaemonProcess, daemon_process
from priod.testing.scrape import Samples, Scraper, free_port, get, total

MiB = 1 << 20
T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "operations.md"
README = ROOT / "README.md"
RULES = ROOT / "deploy" / "helm" / "priod" / "files" / "priod-rules.yaml"
RULE_TESTS = ROOT / "tests" / "promtool" / "priod-rules.test.yaml"


async def poll(check: Callable[[], T | None], timeout: float = 30.0, what: str = "metrics") -> T:
    """Scrape until ``check`` returns something truthy (copies take their time to land)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


SLOW = {"PRIOD_SIM__H2D_GBPS": "0.064", "PRIOD_TUNING__MIN_CHUNK_BYTES": "65536"}


def gpu0(d: DaemonProcess) -> dict[str, str]:
    """The ``gpu`` and ``UUID`` labels of the daemon's GPU 0: its ordinal, and its UUID as
    `priod status` shows it."""
    with priod.SyncClient(d.socket_path, copy_path="daemon") as c:
        g = c.status()["gpus"][0]
        return {"gpu": str(g["index"]), "UUID": str(g["uuid"])}


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

    lane = gpu0(d)
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
        series = {**gpu0(d), "direction": "d2h", "priority": "bulk", "path": "dma"}
        buckets = sorted(
            (float(dict(k[1])["le"]), v)
            for k, v in after.items()
            if k[0] == f"{hist}_bucket" and set(series.items()) <= k[1]
        )
        assert buckets[-1] == (float("inf"), get(after, f"{hist}_count", **series))
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    # A copy that did not complete (the failed one, the cancelled ones, some of which never ran
    # and so have no path) is counted by its outcome and timed nowhere: no path="none" series.
    assert not [k for k in after if dict(k[1]).get("path") == "none"]
    for cls in ("bulk", "normal"):
        done = delta("priod_requests_total", priority=cls, outcome="done")
        assert delta("priod_request_duration_seconds_count", priority=cls) == done
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
    """A GPU's labels come from gpu_labels alone, as DCGM exporter's: ``gpu`` its ordinal and
    ``UUID`` its UUID ("" where the engine names none); a lane adds its direction, a peer lane's
    naming its destination's ordinal."""
    uuids = {3: "GPU-00000000-0000-0000-0000-000000000003"}
    assert LANE_LABELS == ("gpu", "UUID", "direction")
    assert gpu_labels(3, uuids) == ("3", uuids[3])
    assert gpu_labels(3) == gpu_labels(3, {}) == gpu_labels(3, {0: "GPU-x"}) == ("3", "")
    assert lane_labels(LaneKey(3, Direction.D2H), uuids) == ("3", uuids[3], "d2h")
    assert lane_labels(LaneKey(3, Direction.D2H)) == ("3", "", "d2h")
    assert lane_labels(LaneKey(3, Direction.PEER, 0), uuids) == ("3", uuids[3], "peer:0")


async def test_gauges_show_queues_in_flight_busy_and_clients(metered: tuple[DaemonProcess, Scraper]) -> None:
    """Queued requests and bytes by lane and class, bytes in flight by lane and path, the
    engine's busy seconds, clients and pinned bytes follow the daemon's state within a refresh
    or two."""
    d, scrape = metered
    h2d = {**gpu0(d), "direction": "h2d"}
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
        assert ("priod_inflight_bytes", frozenset({**gpu0(d), "direction": "d2h", "path": "express"}.items())) in s
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


async def test_a_scrape_reads_the_gauges_at_that_moment(metered: tuple[DaemonProcess, Scraper]) -> None:
    """Gauges are read from the daemon's state when it is scraped, not on a timer: the first
    scrape once bulk copies are taken (65 ms each on the slow link) shows them queued and in
    flight, and once they are cancelled a scrape within a refresh interval shows the queue empty."""
    d, scrape = metered
    h2d = {**gpu0(d), "direction": "h2d"}
    async with priod.connect(d.socket_path, copy_path="daemon") as c:
        host, dev = await c.alloc_host(4 * MiB), await c.alloc_device(4 * MiB)
        queued = [c.start_copy(dev, host, priority="bulk") for _ in range(50)]
        await c.status()  # answered once the copies sent before it are taken
        # An interval, not a condition: past REFRESH_MIN_S since the daemon's last refresh (an
        # earlier test's scrape), so this scrape refreshes.
        await asyncio.sleep(REFRESH_MIN_S)
        s = await asyncio.to_thread(scrape)
        assert get(s, "priod_queued_requests", priority="bulk", **h2d) >= 1
        assert get(s, "priod_inflight_bytes", path="dma", **h2d) > 0
        await asyncio.wait_for(asyncio.gather(*(h.cancel() for h in queued)), 60)
        s = await poll(  # the next refresh within REFRESH_MIN_S of the last one
            lambda: (lambda s: s if get(s, "priod_queued_requests", priority="bulk", **h2d) == 0 else None)(scrape()),
            timeout=5.0,
            what="the cancelled copies out of the queue",
        )
        assert get(s, "priod_queued_bytes", priority="bulk", **h2d) == 0


U0 = "GPU-0b5e5f4a-1c2d-4e3f-8a9b-0c1d2e3f4a5b"
U1 = "GPU-9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"


def documented_metrics() -> dict[str, set[str]]:
    """docs/operations.md's metrics table: each family's name as served (``_total`` on counters,
    ``_info`` on infos) and its label names, the values in parentheses aside."""
    rows = re.findall(r"^\| `(priod_[a-z_]+)` \| [a-z]+ \|([^|]*)\|", DOCS.read_text(), re.M)
    return {name: set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))) for name, labels in rows}


def test_the_docs_table_parser_reads_names_and_labels() -> None:
    """The parser the docs check relies on reads every row with its labels (not their values)."""
    doc = documented_metrics()
    assert len(doc) >= 20
    assert doc["priod_urgent_path_latency_seconds"] == {*LANE_LABELS, "path", "size_bytes", "form"}
    assert doc["priod_refused_requests_total"] == {"code"}
    assert doc["priod_clients"] == set()


@dataclass
class Served:
    """What one scrape serves: each priod family's name as served with its label names (``le``
    aside), the label sets of its counter or histogram series, and of the ``_created`` series."""

    labels: dict[str, set[str]]
    series: dict[str, set[frozenset[tuple[str, str]]]]
    created: dict[str, set[frozenset[tuple[str, str]]]]
    created_at: list[float]
    samples: list[tuple[str, dict[str, str]]]


def served(text: str) -> Served:
    families = list(text_string_to_metric_families(text))
    types = {f.name: f.type for f in families}
    out = Served({}, {}, {}, [], [])
    suffix = {"counter": "_total", "info": "_info"}
    for fam in families:
        if not fam.name.startswith("priod_"):
            continue
        out.samples += [(s.name, s.labels) for s in fam.samples]
        base = fam.name.removesuffix("_created")
        if base != fam.name and types.get(base) in ("counter", "histogram"):
            # Text format 0.0.4: a family of its own, named <family>_created.
            out.created[base] = {frozenset(s.labels.items()) for s in fam.samples}
            out.created_at += [s.value for s in fam.samples]
            continue
        name = fam.name + suffix.get(fam.type, "")
        out.labels[name] = {k for s in fam.samples for k in s.labels if k != "le"}
        if fam.type in ("counter", "histogram"):
            out.series[fam.name] = {
                frozenset((k, v) for k, v in s.labels.items() if k != "le")
                for s in fam.samples
                if not s.name.endswith("_created")
            }
    return out


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_docs_list_exactly_the_served_families_and_labels_and_gpus_are_labelled_as_dcgm_does() -> None:
    """A two-GPU sim daemon after work that gives every family a series (copies of three classes
    both ways and between the GPUs, a missed deadline, a refusal, queued copies cancelled, a
    direct copy announced on a hold page). Its /metrics and docs/operations.md's table agree both
    ways: the same families, each with the same label names. Every series with a GPU carries
    ``gpu`` = the daemon's ordinal and ``UUID`` = that GPU's UUID (DCGM exporter's labels), a
    peer lane's direction names the destination's ordinal, every counter and histogram series
    has its ``_created`` series (as the docs say), and no series has ``path="none"``."""
    port = free_port()
    env = {
        **SLOW,
        "PRIOD_SIM__DEVICES": "2",
        "PRIOD_SIM__UUIDS": json.dumps([U0, U1]),
        "PRIOD_METRICS__PORT": str(port),
        "PRIOD_LOG__LEVEL": '"warning"',
    }
    scrape = Scraper(port)
    started = time.time()
    with daemon_process(env) as d:
        async with priod.connect(d.socket_path, copy_path="daemon") as c:
            host, dev = await c.alloc_host(MiB), await c.alloc_device(MiB, device=0)
            other = await c.alloc_device(MiB, device=1)
            for _ in range(3):
                await c.copy(dev, host, 65536, priority="urgent")
            await c.copy(host, dev, 65536, priority="bulk")
            await c.copy(dev, host, 65536, priority="normal", deadline_ms=0.001)
            await c.copy(other, dev, priority="high")  # gpu0 -> gpu1
            with pytest.raises(priod.InvalidRequest):
                await c.copy(dev, host, priority="no-such-class")
            queued = [c.start_copy(dev, host, priority="bulk") for _ in range(4)]  # 16 ms each
            await asyncio.gather(*(h.cancel() for h in queued))
            page = await c.hold_page()
            slot = page.slot(U0, "h2d")
            page.begin(slot)
            await c.status()  # the daemon looks at the page
            page.end(slot)
            await c.status()
            page.close()

            def complete() -> str | None:
                text = scrape.text()
                wanted = ("priod_direct_copies_total{", "priod_queued_requests{", "priod_urgent_path_latency_seconds{")
                return text if all(w in text for w in wanted) else None

            text = await poll(complete, what="the direct copy counted and the gauges refreshed")
    got = served(text)

    documented = documented_metrics()
    assert set(got.labels) == set(documented)
    assert {n: ls for n, ls in got.labels.items() if ls != documented[n]} == {}

    uuids = {"0": U0, "1": U1}
    with_gpu = [(n, ls) for n, ls in got.samples if "gpu" in ls]
    assert with_gpu and all(ls["UUID"] == uuids[ls["gpu"]] for _, ls in with_gpu)
    assert {ls["gpu"] for _, ls in with_gpu} == {"0", "1"}
    peer = {ls["direction"] for _, ls in with_gpu if ls["direction"].startswith("peer:")}
    assert peer == {"peer:0", "peer:1"}  # busy time is served for both peer lanes
    assert get_one(got, "priod_copied_bytes_total", priority="high") == {"gpu": "0", "UUID": U0, "direction": "peer:1"}

    assert got.series and got.created == got.series
    assert all(started - 1 <= t <= time.time() for t in got.created_at)
    assert not [(n, ls) for n, ls in got.samples if ls.get("path") == "none"]


def get_one(got: Served, name: str, **labels: str) -> dict[str, str]:
    """The lane labels of the one series of ``name`` with these labels."""
    found = [ls for n, ls in got.samples if n == name and labels.items() <= ls.items()]
    assert len(found) == 1, found
    return {k: v for k, v in found[0].items() if k in LANE_LABELS}


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
        series = {**gpu0(d), "direction": "h2d", "priority": "normal"}
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
    copies would give, bucket boundaries (le: value <= bound) and ``_created`` series included.
    Copies that did not complete are counted and not timed: a cancelled one that never ran (no
    path) makes no latency series."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from priod.common.types import Path as CopyPath
    from priod.daemon.metrics import _LATENCY_BUCKETS, Metrics

    ours = Metrics({0: "GPU-0"})
    ref = CollectorRegistry()
    lane = ["gpu", "UUID", "direction"]
    requests = Counter("priod_requests", "x", [*lane, "priority", "outcome"], registry=ref)
    nbytes = Counter("priod_copied_bytes", "x", [*lane, "priority"], registry=ref)
    duration = Histogram(
        "priod_request_duration_seconds",
        "x",
        [*lane, "priority", "path"],
        buckets=_LATENCY_BUCKETS,
        registry=ref,
    )
    values = [*_LATENCY_BUCKETS, 0.0, 1e-7, 3e-5, 0.7, 11.0, 1e-3 + 1e-12]
    for i, v in enumerate(values):
        outcome = "done" if i % 5 else "cancelled"
        ours.copy_finished("urgent", outcome, LaneKey(0, Direction.H2D), CopyPath.DMA, 100 + i, v / 2, v, False)
        requests.labels("0", "GPU-0", "h2d", "urgent", outcome).inc()
        nbytes.labels("0", "GPU-0", "h2d", "urgent").inc(100 + i)
        if outcome == "done":
            duration.labels("0", "GPU-0", "h2d", "urgent", "dma").observe(v)
    # Cancelled while queued, on another lane and class: counted, with no path and no time.
    ours.copy_finished("bulk", "cancelled", LaneKey(0, Direction.D2H), None, 0, 0.5, 0.5, False)
    requests.labels("0", "GPU-0", "d2h", "bulk", "cancelled").inc()
    nbytes.labels("0", "GPU-0", "d2h", "bulk")

    def lines(registry: CollectorRegistry, prefixes: tuple[str, ...]) -> set[str]:
        text = generate_latest(registry).decode()
        return {ln for ln in text.splitlines() if ln.startswith(prefixes) and "_created" not in ln}

    def created(registry: CollectorRegistry) -> set[str]:
        """The ``_created`` series (their times differ), without their values."""
        text = generate_latest(registry).decode()
        return {ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln.startswith("priod_") and "_created{" in ln}

    prefixes = ("priod_requests_total", "priod_copied_bytes_total", "priod_request_duration_seconds_")
    assert lines(ours.registry, prefixes) == lines(ref, prefixes)
    assert 'path="none"' not in generate_latest(ours.registry).decode()
    mine = {ln for ln in created(ours.registry) if not ln.startswith(("priod_deadline_misses", "priod_queue_wait"))}
    assert mine == created(ref)
    assert len(mine) == 3 + 2 + 1  # requests by lane and outcome, bytes by lane, one latency series


async def test_direct_copies_made_through_a_page_show_in_status_and_the_urgent_latency_histogram(
    metered: tuple[DaemonProcess, Scraper],
) -> None:
    """Copies a client makes itself and announces on its hold page, one at a time with the daemon
    looking (a status looks) before, during and after each, are counted and timed: status shows
    them per lane with p50 / p99, and the scrape has them in priod_request_duration_seconds with
    priority="urgent", path="direct" (the family the urgent-latency panel and alert read), each
    no shorter than the copy and no longer than the looks around it."""
    d, scrape = metered
    lane = {**gpu0(d), "direction": "h2d", "priority": "urgent", "path": "direct"}
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
    h2d = {**gpu0(d), "direction": "h2d"}
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
        ["gpu", "UUID", "direction", "priority", "path"],
        buckets=_LATENCY_BUCKETS,
        registry=ref,
    )
    times = DirectTimes()
    for i, v in enumerate([*_LATENCY_BUCKETS, 1e-7, 3e-5, 0.7, 11.0, 1e-3 + 1e-12]):
        times.observe(v)
        duration.labels("0", "GPU-0", "d2h", "urgent", "direct").observe(v)
        if i % 7 == 0:  # refreshed now and then, and the totals only move forward
            ours.set_direct_times(LaneKey(0, Direction.D2H), times.buckets, times.total_s)
    ours.set_direct_times(LaneKey(0, Direction.D2H), times.buckets, times.total_s)

    def lines(registry: CollectorRegistry) -> set[str]:
        text = generate_latest(registry).decode()
        return {
            ln for ln in text.splitlines() if ln.startswith("priod_request_duration_seconds_") and "_created" not in ln
        }

    assert lines(ours.registry) == lines(ref)


# -- the buckets and the alerts against README.md's figures -------------------------------------


def test_latency_buckets_resolve_urgent_copies() -> None:
    """Urgent copies take 50-500 us on a GPU (README.md's table): the buckets resolve that range
    (no bound more than 1.5 times the one before), reach from 25 us to 10 s, and stay few (a
    histogram's series are the bounds, +Inf, _sum, _count and _created per label set)."""
    bounds = list(LATENCY_BUCKETS)
    assert bounds == sorted(set(bounds))
    fine = [b for b in bounds if 50e-6 <= b <= 500e-6]
    assert fine[0] == 50e-6 and fine[-1] == 500e-6 and len(fine) >= 8
    assert max(hi / lo for lo, hi in itertools.pairwise(fine)) <= 1.5
    assert bounds[0] <= 25e-6 and bounds[-1] >= 10.0
    assert len(bounds) <= 21


def readme_p99_us(row: str) -> list[float]:
    """The p99 figures (us, the top of each range) of README.md's headline table row whose
    first cell starts with ``row``, one per copy size."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith(f"| {row}"))
    cells = [c.strip() for c in line.strip().strip("|").split("|")[1:]]
    return [max(float(x.replace(",", "")) for x in cell.split("/")[1].split("-")) for cell in cells]


def urgent_latency_alerts() -> dict[str, tuple[set[str], float]]:
    """Each alert on urgent copies' p99: the paths its histogram_quantile selects and its
    threshold (seconds); the rate floor beside it must select the same paths."""
    out = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            if "histogram_quantile(0.99" not in expr or 'priority="urgent"' not in expr:
                continue
            paths = re.findall(r'path(=~|=)"([^"]*)"', expr)
            assert len(paths) == 2 and paths[0] == paths[1], (rule["alert"], paths)
            op, value = paths[0]
            threshold = re.search(r"\)\)\)\s*>\s*([0-9.e-]+)\s", expr)
            assert threshold, expr
            out[rule["alert"]] = (set(value.split("|")) if op == "=~" else {value}, float(threshold.group(1)))
    return out


def test_each_urgent_path_has_its_alert_just_above_the_readme_p99() -> None:
    """One urgent-latency alert per path, together covering every path of the histogram once:
    through the daemon (dma, express) and direct, each with its threshold above the highest p99
    README.md's table gives for that path (every copy size), within 1.5 times it (room for
    hosts: the H200's front door read 503-539 us at 16 MiB where README's H100 reads 426-449),
    at a bucket bound."""
    alerts = urgent_latency_alerts()
    # The front door's row: its urgent copies took the direct path by themselves.
    rows = {"PriodUrgentLatencyHigh": "through the daemon", "PriodDirectLatencyHigh": "priod: `copy("}
    assert set(alerts) == set(rows)
    assert alerts["PriodUrgentLatencyHigh"][0] == {"dma", "express"}
    assert alerts["PriodDirectLatencyHigh"][0] == {"direct"}
    for alert, row in rows.items():
        threshold = alerts[alert][1]
        worst = max(readme_p99_us(row)) * 1e-6
        assert worst < threshold <= 1.5 * worst, (alert, worst, threshold)
        assert threshold in LATENCY_BUCKETS, (alert, threshold)  # histogram_quantile exact there


def test_the_dcgm_joins_the_docs_show_are_the_ones_promtool_runs() -> None:
    """docs/operations.md's queries that join DCGM exporter's series are run, as written, by the
    promtool tests (tests/test_deploy.py runs them), and join on the labels priod serves."""
    text = DOCS.read_text()
    joins = [ln for ln in re.findall(r"^(\S.*DCGM_FI_DEV_\w+.*)$", text, re.M) if not ln.startswith("#")]
    assert len(joins) == 2 and all(re.search(r"\bon \((UUID|node, gpu)\)", q) for q in joins), joins
    tested = [t["expr"] for g in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in g.get("promql_expr_test", [])]
    assert set(joins) <= set(tested)


def test_a_flood_of_scrapes_refreshes_the_gauges_at_most_once_per_refresh_min_s() -> None:
    """Scrapes as fast as one client can make them for a second: every one is answered, and the
    event loop runs the gauges' refresh at most once per `REFRESH_MIN_S`, so a scraper cannot
    take the loop from the daemon's clients."""
    import urllib.request

    from priod.daemon.metrics import Metrics

    async def main() -> tuple[int, float, list[float]]:
        loop = asyncio.get_running_loop()
        calls: list[float] = []
        port = Metrics().serve("127.0.0.1", 0, loop, lambda: calls.append(time.monotonic()))

        def flood() -> tuple[int, float]:
            start, n = time.monotonic(), 0
            while time.monotonic() - start < 1.0:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    assert r.status == 200
                n += 1
            return n, time.monotonic() - start

        n, took = await asyncio.to_thread(flood)
        return n, took, calls

    n, took, calls = asyncio.run(main())
    assert 1 <= len(calls) <= took / REFRESH_MIN_S + 1, (n, len(calls))
    assert all(b - a >= REFRESH_MIN_S for a, b in itertools.pairwise(calls)), calls
    assert n > 2 * len(calls), f"{n} scrapes in {took:.2f} s, {len(calls)} refreshes"


def test_healthz_answers_while_the_event_loop_turns_and_503_once_it_is_stuck() -> None:
    """The liveness probe's endpoint checks the event loop itself: 200 while it runs callbacks,
    503 while it is blocked (as a hung loop would be), and no access log line either way."""
    import io
    import urllib.error
    import urllib.request
    from contextlib import redirect_stderr

    from priod.daemon import metrics as metrics_module
    from priod.daemon.metrics import Metrics

    def get(port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    async def main() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        port = Metrics().serve("127.0.0.1", 0, loop)
        alive = await asyncio.to_thread(get, port)
        answer = loop.run_in_executor(None, get, port)
        time.sleep(metrics_module.HEALTH_TIMEOUT_S + 0.5)  # the loop blocked: the probe gets no answer from it
        stuck = await answer
        scrape = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").status)
        return alive, stuck, int(scrape)

    err = io.StringIO()
    with redirect_stderr(err):
        assert asyncio.run(main()) == (200, 503, 200)
    assert "GET /healthz" not in err.getvalue()
