"""scripts/attack.py's attackers really attack: their raw connections are greeted by the daemon
this checkout builds, and a verdict says "NOT met" where an attack did not take place (its
connections refused, its clients never left replies waiting) instead of measuring the honest
client beside nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from priod.testing import DaemonProcess, daemon_process
from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def attack() -> Any:
    return import_script(ROOT / "scripts" / "attack.py", "priod_attack")


@pytest.fixture(scope="module")
def daemon() -> Any:
    with daemon_process() as d:
        yield d


def test_the_raw_attackers_connections_are_greeted(attack: Any, daemon: DaemonProcess) -> None:
    """The tenant attackers' connections say hello in the daemon's protocol version: a hello the
    daemon refuses left every tenant attack without a single connection."""
    conns, refused, limited = attack._uid_conns({"path": daemon.socket_path, "uids": [None], "conns": 3})
    try:
        assert (len(conns), refused, limited) == (3, [], [])
        _, _, fs = conns[0]
        assert attack._ask(fs, {"id": 2, "op": "ping"})["ok"]
    finally:
        for _, _, fs in conns:
            fs.close()


def test_an_attacker_whose_connects_were_refused_did_not_attack(attack: Any) -> None:
    refused = {"connects_refused": {"count": 2, "first": ["PriodError: protocol version 1 is not supported"]}}
    assert "2 connects refused" in attack._not_carried_out({"connections": 0, **refused})
    assert attack._not_carried_out({"connections": 0}) == " (no connection)"
    assert attack._not_carried_out({"hellos_refused": {"count": 3}}) == " (3 hellos refused)"
    # The daemon's connection limits refusing some of them is its defence, not a failed attack.
    limited = {"connections": 253, "connects_limited": {"count": 3}}
    assert attack._not_carried_out(limited) == ""
    assert "3 of its connects refused" in attack._limited_note(limited)


def test_sigterm_and_mute_verdicts_need_replies_left_waiting(attack: Any) -> None:
    """Attack 7 is met only if every connection had replies waiting when SIGTERM came, and
    attack 8's memory figure only if every connection had replies waiting in the daemon."""
    done = {"seconds": 0.1, "exit_code": 0}
    sigterm = {"honest_unloaded": done, "honest_attacked": done, "attacker": {"connections": 60}}
    for stuck, verdict in ((60, "met"), (0, "NOT met")):
        (row,) = attack.attack_rows("sigterm", {**sigterm, "clients_with_output_stuck": stuck})
        assert row[-1] == verdict
    ping = {"n": 10, "p50": 80.0, "p99": 200.0, "max": 300.0}
    mute = {
        "rss_anon_per_client_mib": 1.1,
        "max_output_bytes": 1 << 20,
        "rss_mib": {"before": {"RssAnon": 29.0}},
        "attacker": {"connections": 100},
        "ping_unloaded": ping,
        "ping_attacked": ping,
        "ping_after_close": ping,
        "daemon_cpu_s_per_s_after_close": 0.01,
        "connections_dropped_after_s": 1.5,
        "drain_wait_s": 10.0,
    }
    for waiting, verdict in (
        ({"n": 100, "min": 700_000, "max": 800_000}, "met"),
        ({"n": 100, "min": 0, "max": 0}, "NOT met"),
    ):
        rows = attack.attack_rows("mute", {**mute, "output_buffered": waiting})
        assert rows[0][-1] == verdict


def test_connects_the_daemons_limits_refuse_are_told_apart(attack: Any) -> None:
    """A connect refused by the daemon's client limit is its defence, counted apart from
    refusals that mean the attacker could not attack."""
    with daemon_process({"PRIOD_SERVER__MAX_CLIENTS": "2"}) as d:
        conns, refused, limited = attack._uid_conns({"path": d.socket_path, "uids": [None], "conns": 3})
        try:
            assert (len(conns), refused, len(limited)) == (2, [], 1)
            assert limited[0].startswith("LimitExceeded: ")
        finally:
            for _, _, fs in conns:
                fs.close()
