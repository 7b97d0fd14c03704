"""The floors the sim benchmarks measure priod against: scripts/bench.py's echo, whose two
clients get every reply whole from the real uvloop echo server, and scripts/bench_batch.py's
in-process copy of the same blocks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from priod.client.copy_ring import ClientRing
from priod.daemon import pump
from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script(ROOT / "scripts" / "bench.py", "priod_bench")


@pytest.mark.parametrize("spin_us", [0.0, 200.0, 1e6])
def test_echo_client_reads_every_reply_whole_polling_or_blocking(bench: Any, spin_us: float) -> None:
    """``spin_us`` 0 blocks at once, 1e6 never does: each way, 50 round trips each decode a
    whole reply frame (a torn or misframed read would fail the decode or hang)."""
    msg = bench.copy_request(1, 2, 64, "normal")
    with bench.echo_server() as path:
        latencies = bench.sync_rtt_echo(path, msg, 50, spin_us)
        blocking = bench.sync_rtt_echo(path, msg, 50)
    assert len(latencies) == 50 and len(blocking) == 50
    assert all(0 < us < 5e6 for us in latencies + blocking)


def test_spaced_echo_round_trips_come_one_per_interval(bench: Any) -> None:
    """The spaced figure's echo (and copies) go one every ``interval_s``, not back to back: 20
    of them at 5 ms take at least 95 ms, and each is timed from its send (well under the gap)."""
    msg = bench.copy_request(1, 2, 64, "urgent")
    with bench.echo_server() as path:
        bench.sync_rtt_echo(path, msg, 5, 200.0)  # the server is up and warm
        t0 = time.perf_counter()
        latencies = bench.sync_rtt_echo(path, msg, 20, 200.0, bench.SPACED_S)
        elapsed = time.perf_counter() - t0
    assert len(latencies) == 20 and elapsed >= 19 * bench.SPACED_S
    assert all(0 < us < 5e6 for us in latencies)
    assert sorted(latencies)[10] < bench.SPACED_S * 1e6  # the median round trip, not the pause


def test_bench_batch_measures_the_floor_beside_both_forms(tmp_path: Path) -> None:
    """scripts/bench_batch.py on the sim: singles, one batch and the in-process floor each run
    every round with every block read back and checked (a block that did not land stops the
    script), and the results name the ratio the floor allows."""
    script = import_script(ROOT / "scripts" / "bench_batch.py", "priod_bench_batch")
    out = tmp_path / "bb"
    assert script.main(["--blocks", "16", "--block-kib", "4", "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads((out / "bench_batch.json").read_text())
    assert len(res["single_s"]) == len(res["batch_s"]) == len(res["floor_s"]) == 2
    assert res["floor_ratio"] == res["single_p50_s"] / res["floor_p50_s"]


def test_bench_gpu_wake_floor_times_a_real_wake_up_of_another_process() -> None:
    """scripts/bench_gpu.py's wake-up floor (its "floor" row: idle-5ms plus this): each figure is
    a round trip to another live process, asleep in its loop until woken, which must answer
    every time (a missed wake-up would raise rather than read as fast), and it stops after."""
    script = import_script(ROOT / "scripts" / "bench_gpu.py", "priod_bench_gpu_floor")
    lat = script.wake_floor(20, interval_s=0.002, warm=2)
    assert len(lat) == 20
    assert all(0 < us < 1e6 for us in lat)


def test_gpu_steps_add_up_to_the_whole_copy_and_each_comes_after_the_one_before() -> None:
    """scripts/bench_gpu_steps.py on the sim engine: each urgent copy's five steps, timed from
    the client's marks and the daemon's stamps, add up to the copy's whole time, none runs
    backwards (the daemon took the copy after its doorbell, handed it on after taking it, and
    its landed word was seen after that); the bare wake-up floor is a positive time."""
    steps = import_script(ROOT / "scripts" / "bench_gpu_steps.py", "priod_bench_gpu_steps")
    from priod.testing import daemon_process

    with daemon_process(backend="sim") as dmn:
        rows = steps.urgent_steps(dmn.socket_path, 20)
    assert len(rows) >= 15  # a copy answered by its completion rather than its word has no stamps
    for row in rows:
        parts = [row[s] for s in steps.STEPS if s != "whole"]
        assert all(p > -1.0 for p in parts), row  # the reply's figures are rounded to the ns
        assert sum(parts) == pytest.approx(row["whole"], abs=1.0), row
    assert ClientRing.ring.__name__ == "ring", "the client's ring is left as it was"
    wakes = steps.wake_floor(10)
    assert len(wakes) == 10 and all(0 < us < 1e6 for us in wakes)


def test_gpu_steps_by_function_splits_the_daemons_part_in_pipeline_order(tmp_path: Path) -> None:
    """``bench_gpu_steps.py --by-function`` on the sim: a daemon started with its hot-path
    functions stamped gives, for most copies, every stage from the doorbell to the engine, in
    the pipeline's order (no stage runs backwards), and the wrapped daemon still moves them."""
    if not pump.__file__.endswith(".py"):
        pytest.skip("the compiled build (PRIOD_COMPILE=1): --by-function stamps the pure build's functions only")
    steps = import_script(ROOT / "scripts" / "bench_gpu_steps.py", "priod_bench_gpu_steps_fine")
    stages = steps.by_function(str(tmp_path), "sim", 20)
    want = ["doorbell -> read", "read -> checks", "checks -> queued", "queued -> to the pump", "to the pump -> engine"]
    for stage in want:
        assert len(stages.get(stage, [])) >= 15, (stage, {k: len(v) for k, v in stages.items()})
        assert all(us >= 0 for us in stages[stage]), stage
    assert ClientRing.ring.__name__ == "ring", "the client's ring is left as it was"
