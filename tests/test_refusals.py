"""Refused requests are logged and attributed: each refusal is one ``request_refused`` line at
info naming the client, its uid, the request and the limit or reason, within a line budget per
connection (floods are summed up in ``request_refusals_suppressed`` lines), and ``priod status
--json`` counts them under ``refusals`` by code, by limit, by uid and by connection
(docs/operations.md, the PriodRefusalsRising runbook)."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import priod
from priod.daemon import session
from priod.daemon.log import LineBudget
from priod.errors import InvalidRequest, LimitExceeded, NotFound
from priod.testing import DaemonProcess, daemon_process, wait_until

REGIONS = 2
"""[limits] max_regions of the daemon under test: a third region is refused."""
FLOOD = 1000
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def refusing() -> Iterator[DaemonProcess]:
    """A daemon at the default log level (info) whose connections may hold two regions."""
    with daemon_process({"PRIOD_LIMITS__MAX_REGIONS": str(REGIONS), "PRIOD_LOG__LEVEL": '"info"'}) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


def events(d: DaemonProcess, event: str, client: str) -> list[dict[str, Any]]:
    """The daemon's JSON log lines of ``event`` for the client that said hello as ``client``."""
    out = []
    for line in d.log().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            fields = json.loads(line)
            if fields["event"] == event and fields.get("client") == client:
                out.append(fields)
    return out


def status_json(d: DaemonProcess) -> dict[str, Any]:
    """``priod status --json``, as an operator runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "priod", "status", "--socket", d.socket_path, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    st: dict[str, Any] = json.loads(out.stdout)
    return st


def conn_of(st: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``refusals.clients`` entry of the connection named ``name``."""
    entries: list[dict[str, Any]] = [c for c in st["refusals"]["clients"] if c["name"] == name]
    assert len(entries) == 1, entries
    return entries[0]


def at_least(n: int, items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    return items if len(items) >= n else None


def fill_regions(c: priod.SyncClient) -> None:
    for _ in range(REGIONS):
        c.alloc_host(4096)


def test_a_refusal_is_one_info_line_naming_who_what_and_why(refusing: DaemonProcess) -> None:
    """A region past max_regions is refused with LimitExceeded; the daemon writes one
    ``request_refused`` line at info with the connection, the client's name, pid and uid, the
    op and its id, the code, the limit and the message. A refusal that is not a limit's (a free
    of a region that does not exist) names no limit. ``status --json`` counts both."""
    name = "refusals-one"
    # ring=False: no ring request after the hello, so the ids below are the requests' own.
    with priod.SyncClient(refusing.socket_path, name=name, timeout=30, ring=False) as c:
        fill_regions(c)  # requests 2 and 3 (hello is 1)
        with pytest.raises(LimitExceeded, match=r"\[limits\] max_regions = 2") as over:
            c.alloc_host(4096)  # request 4
        with pytest.raises(NotFound) as missing:
            c.raw_request({"op": "free", "region": 987654})  # request 5
        lines = wait_until(lambda: at_least(2, events(refusing, "request_refused", name)), 30, "two lines")
        st = status_json(refusing)
        (me,) = [x for x in st["clients"] if x["name"] == name]
    limit, other = lines
    who = {"conn": me["conn"], "client": name, "client_pid": os.getpid(), "uid": os.getuid(), "level": "info"}
    assert limit.items() >= {**who, "op": "alloc_host", "id": 4, "code": "limit", "limit": "max_regions"}.items()
    assert limit["error"] == str(over.value)
    assert other.items() >= {**who, "op": "free", "id": 5, "code": "not_found", "error": str(missing.value)}.items()
    assert "limit" not in other
    time.sleep(0.2)  # nothing more comes for them
    assert len(events(refusing, "request_refused", name)) == 2
    assert not events(refusing, "request_refusals_suppressed", name)

    assert me["refused"] == 2 and me["pid"] == os.getpid()
    entry = conn_of(st, name)
    assert (
        entry.items()
        >= {
            "conn": me["conn"],
            "pid": os.getpid(),
            "uid": os.getuid(),
            "open": True,
            "refused": 2,
            "by_code": {"limit": 1, "not_found": 1},
            "by_limit": {"max_regions": 1},
        }.items()
    )
    assert entry["last"].items() >= {"op": "free", "id": 5, "code": "not_found", "limit": None}.items()
    ref = st["refusals"]
    assert ref["total"] == st["totals"]["refused"] == sum(ref["by_code"].values())
    assert ref["by_limit"]["max_regions"] >= 1 and ref["by_uid"][str(os.getuid())] >= 2


def test_a_flood_is_rate_limited_per_client_and_others_are_still_logged(refusing: DaemonProcess) -> None:
    """1,000 refusals of one connection write at most the connection's budget of lines (10,
    then one a second) plus summary lines (10 s after the first refusal held back, and at the
    close), which with the lines account for every refusal; another client's single refusal
    meanwhile is logged; ``status --json`` attributes the 1,000
    to the flooding connection and max_regions, and keeps them once it has closed."""
    flooder, bystander = "refusals-flooder", "refusals-bystander"
    budget = session.REFUSAL_LINES_BURST
    with priod.SyncClient(refusing.socket_path, name=flooder, timeout=30) as f:
        fill_regions(f)
        began = time.monotonic()
        for _ in range(FLOOD):
            with pytest.raises(LimitExceeded):
                f.alloc_host(4096)
        took = time.monotonic() - began
        with priod.SyncClient(refusing.socket_path, name=bystander, timeout=30) as b:
            with pytest.raises(InvalidRequest):
                b.raw_request({"op": "alloc_host", "nbytes": -1})
            wait_until(lambda: events(refusing, "request_refused", bystander), 30, "the bystander's line")
        st = status_json(refusing)
        entry = conn_of(st, flooder)
        assert entry["open"] and entry["refused"] == FLOOD
        assert entry["by_code"] == {"limit": FLOOD} and entry["by_limit"] == {"max_regions": FLOOD}
        assert conn_of(st, bystander)["by_code"] == {"bad_request": 1}
        assert st["refusals"]["by_limit"]["max_regions"] >= FLOOD
        assert st["refusals"]["log"]["suppressed"] >= FLOOD - budget - math.ceil(took) - 1
        # The summary comes SUPPRESSED_SUMMARY_S after the first refusal held back, the
        # connection still open (and when it closes, for any held back since).
        wait_until(lambda: events(refusing, "request_refusals_suppressed", flooder), 60, "the periodic summary")
    took = time.monotonic() - began

    def accounted() -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        lines = events(refusing, "request_refused", flooder)
        summaries = events(refusing, "request_refusals_suppressed", flooder)
        return (lines, summaries) if len(lines) + sum(s["suppressed"] for s in summaries) == FLOOD else None

    lines, summaries = wait_until(accounted, 30, "every refusal logged or summed up")
    assert budget <= len(lines) <= budget + math.ceil(took * session.REFUSAL_LINES_PER_S) + 1
    assert 1 <= len(summaries) <= 1 + math.ceil(took / session.SUPPRESSED_SUMMARY_S)
    for s in summaries:
        assert s["level"] == "info" and s["uid"] == os.getuid() and s["client_pid"] == os.getpid()
        assert s["by_code"] == {"limit": s["suppressed"]} and s["by_limit"] == {"max_regions": s["suppressed"]}
    assert all(x["code"] == "limit" and x["limit"] == "max_regions" for x in lines)
    (seen,) = events(refusing, "request_refused", bystander)
    assert seen["code"] == "bad_request" and seen["op"] == "alloc_host" and "limit" not in seen

    gone = conn_of(status_json(refusing), flooder)  # closed, still shown
    assert not gone["open"] and gone["refused"] == FLOOD and gone["last"]["limit"] == "max_regions"


def test_every_limit_names_itself() -> None:
    """Each LimitExceeded the daemon raises names its setting in its message (``[limits] NAME``
    or ``[server] NAME``) or is one `limit_name` knows by its text, so ``by_limit`` never says
    ``unnamed``."""
    calls = []
    for path in sorted((ROOT / "priod" / "daemon").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LimitExceeded":
                calls.append((path.name, ast.get_source_segment(text, node) or ""))
    assert len(calls) >= 10
    known = [part for part, _ in session._UNNAMED_LIMITS]
    for where, call in calls:
        named = "[limits] " in call or "[server] " in call or any(part in call for part in known)
        assert named, f"{where}: {call}"
    assert session.limit_name(LimitExceeded("x ([limits] max_queued_bytes_per_uid = 9); wait")) == (
        "max_queued_bytes_per_uid"
    )
    assert session.limit_name(LimitExceeded("this connection has 4096 IPC events open, ...")) == (
        "max_events_per_connection"
    )
    assert session.limit_name(LimitExceeded("something new")) == "unnamed"
    assert session.limit_name(NotFound("no region 3")) is None


def test_line_budget_gives_a_burst_then_a_rate() -> None:
    b = LineBudget(per_s=1.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(100.5)
    assert b.take(101.0) and not b.take(101.0)
    assert [b.take(1000.0) for _ in range(4)] == [True, True, True, False]  # never more than the burst
