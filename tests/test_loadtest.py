"""scripts/loadtest.py: its byte checks catch every kind of bad copy, its client profiles parse
(and refuse nonsense with the fix), and short runs against a daemon it spawns verify every byte,
through mapped regions and through staging copies (the cuda path), counting errors by kind."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import priod

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "loadtest.py"
MiB = 1 << 20


@pytest.fixture(scope="module")
def lt() -> Iterator[ModuleType]:
    """The script, imported as a module."""
    spec = importlib.util.spec_from_file_location("priod_loadtest", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def run_script(out: Path, *args: str, timeout: float = 120) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--spawn-daemon", "--out", str(out), "--progress-s", "1", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report_path = out / "loadtest.json"
    assert report_path.exists(), proc.stderr[-4000:]
    return proc.returncode, json.loads(report_path.read_text()), proc.stderr


def test_pattern_check_catches_flipped_stale_shifted_and_tail_bytes(lt: ModuleType) -> None:
    """A destination that matches its request's pattern counts 0 bad bytes; one flipped byte
    (in the body or in a partial last word) counts 1; another request's pattern (a copy that
    never happened) counts nearly every byte, and the right pattern 8 bytes off (a shifted
    copy) at least one byte in every 64-bit word."""
    scratch = np.empty(lt.BLOCK_WORDS, dtype=np.uint64)
    n = 3 * MiB + 5  # several blocks and a partial last word
    key = lt.request_key(3, 17)
    buf = np.zeros(n, dtype=np.uint8)
    lt.write_pattern(buf, key)
    assert lt.count_bad(buf, key, scratch) == 0
    buf[MiB + 3] ^= 0x40
    assert lt.count_bad(buf, key, scratch) == 1
    buf[MiB + 3] ^= 0x40
    buf[-2] ^= 1
    assert lt.count_bad(buf, key, scratch) == 1
    buf[-2] ^= 1
    assert lt.count_bad(buf, lt.request_key(3, 18), scratch) > 0.99 * n
    shifted = np.zeros(n + 8, dtype=np.uint8)
    lt.write_pattern(shifted, key)
    assert lt.count_bad(shifted[8:], key, scratch) >= n // 8


def test_profiles_parse_and_refuse_nonsense(lt: ModuleType) -> None:
    """Client specs give profiles; sizes are fixed, log-uniform ranges or choices and stay in
    bounds; a bad spec is refused with a message that names the fix."""
    p = lt.parse_profile("class=urgent,dir=d2h,size=64KiB..4MiB,rate=100,window=3,count=2,churn=5")
    assert (p.cls, p.direction, p.rate, p.slots, p.count, p.churn, p.name) == (
        "urgent",
        "d2h",
        100.0,
        3,
        2,
        5,
        "urgent-d2h",
    )
    closed = lt.parse_profile("class=bulk,size=1MiB,concurrency=4")
    assert (closed.slots, closed.direction, closed.rate) == (4, "h2d", 0.0)
    rng = random.Random(1)
    ranged = lt.SizeDist("64KiB..4MiB")
    assert ranged.max == 4 * MiB
    assert all(64 * 1024 <= ranged.sample(rng) <= 4 * MiB for _ in range(500))
    assert {lt.SizeDist("4KiB|1MiB").sample(rng) for _ in range(100)} == {4096, MiB}
    assert lt.parse_bytes("1.5MiB") == 3 * MiB // 2 and lt.parse_bytes("2GB") == 2 * 10**9
    with pytest.raises(ValueError, match=r"^dir=sideways is invalid; use h2d, d2h or d2d$"):
        lt.parse_profile("dir=sideways")
    with pytest.raises(
        ValueError,
        match=r"^unknown client spec key 'speed'; known: class, dir, size, rate, window, concurrency, requests, count, deadline_ms, device, churn, api$",
    ):
        lt.parse_profile("speed=9")
    with pytest.raises(
        ValueError, match=r"^cannot read '12 parsecs' as a size; write it like 4096, 64KiB, 1.5MiB or 2GB$"
    ):
        lt.parse_profile("size=12 parsecs")
    with pytest.raises(ValueError, match=r"^size range '4MiB..1MiB' runs backwards; write it low..high$"):
        lt.SizeDist("4MiB..1MiB")


def test_restart_checks_tell_old_new_and_neither_and_the_documented_errors(lt: ModuleType) -> None:
    """With --kill-every a copy's destination first holds "old bytes": afterwards every word is
    counted as new, old (a success there is a false one) or neither (corrupted), a partial last
    word byte by byte; the documented restart errors are told from every other error; the kill
    interval parses and refuses nonsense."""
    scratch = np.empty(lt.BLOCK_WORDS, dtype=np.uint64)
    n = 2 * MiB + 3
    key = lt.request_key(5, 9)
    old = key ^ lt.OLD_XOR
    buf = np.zeros(n, dtype=np.uint8)
    lt.write_pattern(buf, key)
    assert lt.classify_words(buf, key, old, scratch) == (0, 0)
    lt.write_pattern(buf[: MiB + 8], old)  # an interrupted copy: old words up to a word boundary
    assert lt.classify_words(buf, key, old, scratch) == (MiB + 8, 0)
    buf[17] ^= 0xFF  # one word neither old nor new
    buf[-1] ^= 0xFF  # one byte of the partial last word
    assert lt.classify_words(buf, key, old, scratch) == (MiB, 9)
    lost = priod.ConnectionClosed(
        "copy 7 was sent to priod at /s and the connection was lost before its reply: it may have moved some "
        "or all of its bytes, or none, and did not report success. ... The client has reconnected (in 0.4 s) "
        "and registered its regions again."
    )
    assert lt.restart_kind(lost) == "lost_reply"
    assert lt.restart_kind(priod.ShuttingDown("the daemon is stopping")) == "shutting_down"
    reconnecting = priod.ConnectionClosed("... lost (x); the client is reconnecting (for up to ...): retry the request")
    assert lt.restart_kind(reconnecting) == "reconnecting"
    gave_up = priod.ConnectionClosed(
        "copy 7 was sent ... and the connection was lost before its reply: ... The client did not reconnect: x."
    )
    assert lt.restart_kind(gave_up) is None
    assert lt.restart_kind(priod.InvalidRequest("no")) is None
    assert lt.parse_kill_every("10-20") == (10.0, 20.0) and lt.parse_kill_every("3") == (3.0, 3.0)
    for bad in ("20-10", "0-1", "soon"):
        with pytest.raises(ValueError, match="--kill-every"):
            lt.parse_kill_every(bad)


@pytest.mark.slow
def test_short_run_verifies_every_byte(tmp_path: Path) -> None:
    """Three seconds of the default mix (urgent both ways, bulk both ways, normal d2d), each
    client its own process: every class completes copies, every byte is verified at its
    destination, nothing is corrupted or lost, the plots are written, and the daemon holds the
    same fds after the run as before it."""
    code, report, err = run_script(tmp_path, "--duration", "3")
    assert code == 0, err[-4000:]
    assert report["ok"] and report["problems"] == []
    assert set(report["classes"]) == {"urgent", "bulk", "normal"}
    for cls, c in report["classes"].items():
        assert c["requests"] > 0, cls
        assert c["bytes_verified"] == c["bytes"] > 0, cls
        assert (c["bytes_corrupted"], c["bytes_lost"], c["bytes_unverified"], c["errors"]) == (0, 0, 0, {}), cls
        lat = c["latency_us"]
        assert 0 < lat["p50"] <= lat["p99"] <= lat["p99.9"] <= lat["max"], cls
    assert (
        report["classes"]["urgent"]["express_fraction"] > 0
    )  # both urgent paths are measured and used where faster (choice.py)
    assert report["verify"] == ["mapped"]
    res = report["daemon"]["resources"]
    assert res["fds_after"] == res["fds_before"] and res["clients_after"] == res["clients_before"]
    for name in ("latency_cdf.png", "throughput.png", "daemon.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert "[" in err and "/3s]" in err  # the progress line


@pytest.mark.slow
def test_staged_verification_and_errors_by_kind(tmp_path: Path) -> None:
    """--verify staged checks device ends through host staging copies (how it runs on cuda,
    where device memory is not mapped): those copies are counted as aux bytes and every
    measured byte still verifies. A client whose every copy hits the engine fault sees them
    counted by kind (EngineError); nothing is lost or corrupted, and the run exits 1 naming the
    failures."""
    code, report, err = run_script(
        tmp_path,
        "--duration", "2",
        "--verify", "staged",
        "--daemon-env", "PRIOD_SIM__FAULT_ON_NBYTES=12345",
        "--client", "class=urgent,dir=h2d,size=4KiB..512KiB,rate=40",
        "--client", "class=bulk,dir=d2h,size=4MiB,concurrency=2,churn=10",
        "--client", "class=normal,dir=d2d,size=100000..1MiB,concurrency=1",
        "--client", "class=high,dir=h2d,size=12345,rate=20",
    )  # fmt: skip
    assert code == 1, err[-4000:]
    assert report["verify"] == ["staged"]
    failed = report["classes"]["high"]
    assert failed["requests"] == 0 and set(failed["errors"]) == {"EngineError"} and failed["errors"]["EngineError"] > 0
    assert report["problems"] == [f"{failed['errors']['EngineError']} copies failed (allowed 0)"]
    for cls in ("urgent", "bulk", "normal"):
        c = report["classes"][cls]
        assert c["requests"] > 0 and c["errors"] == {}, cls
        assert c["bytes_verified"] == c["bytes"] and c["aux_bytes"] >= c["bytes"], cls
    assert report["totals"]["bytes_corrupted"] == 0 and report["totals"]["bytes_lost"] == 0
    assert any(cl["reconnects"] > 0 for cl in report["clients"] if cl["cls"] == "bulk")
