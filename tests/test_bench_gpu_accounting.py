"""scripts/bench_gpu.py's bulk figures, on any machine: the daemon counts the chunks it ran on a
lane, so urgent copies made through it come out of that count, and direct ones (the client's
own DMA, never counted there) do not. Results files from before counted them, and the direct rows' bulk read
about 0.02 of the link low."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script(ROOT / "scripts" / "bench_gpu.py", "priod_bench_gpu")


def test_urgent_bytes_through_the_daemon_come_out_direct_ones_do_not(bench: Any) -> None:
    lane, urgent = 50_000_000_000, 1_000_000_000
    assert bench.bulk_rate(lane, urgent, 1.0, direct=False) == pytest.approx(49.0)
    assert bench.bulk_rate(lane, urgent, 1.0, direct=True) == pytest.approx(50.0)


def test_bulk_per_size_takes_each_size_apart_and_only_its_own_lane(bench: Any) -> None:
    """Two sizes, h2d and d2h both loaded, urgent copies h2d only: each size's window gives
    bulk per lane over its own seconds; the d2h lane never loses urgent bytes."""
    count = 100
    loaded = {
        "_lane_bytes": {
            f"h2d/{64 * KiB}": (
                {"gpu0/h2d": 0, "gpu0/d2h": 0},
                {"gpu0/h2d": 25_000_000_000 + 64 * KiB * count, "gpu0/d2h": 20_000_000_000},
                0.5,
            ),
            f"h2d/{16 * MiB}": (
                {"gpu0/h2d": 0, "gpu0/d2h": 0},
                {"gpu0/h2d": 23_000_000_000 + 16 * MiB * count, "gpu0/d2h": 24_000_000_000},
                0.5,
            ),
        }
    }
    through = bench.bulk_per_size(loaded, ("h2d", "d2h"), count, direct=False)
    assert through[f"h2d/{64 * KiB}"] == pytest.approx({"h2d": 50.0, "d2h": 40.0})
    assert through[f"h2d/{16 * MiB}"] == pytest.approx({"h2d": 46.0, "d2h": 48.0})
    direct = bench.bulk_per_size(loaded, ("h2d", "d2h"), count, direct=True)
    assert direct[f"h2d/{16 * MiB}"]["h2d"] == pytest.approx((23_000_000_000 + 16 * MiB * count) / 0.5 / 1e9)
    assert direct[f"h2d/{16 * MiB}"]["d2h"] == pytest.approx(48.0)


def _render(bench: Any, name: str) -> list[str]:
    with gzip.open(ROOT / "tests" / "data" / name) as f:
        return list(bench.render(json.load(f)).splitlines())


def test_the_table_shows_bulk_per_size_and_falls_back_for_older_results(bench: Any) -> None:
    """A recorded H200 run (tests/data): the 64 KiB direct row shows bulk while those copies ran (0.927
    of raw, h2d, no co-tenant), the row summary the whole phase (0.907). A results file from
    before has no per-size figures: its table shows the whole phase's bulk, as it did."""
    lines = _render(bench, "bench_gpu_with_per_size_bulk.json.gz")
    row = next(ln for ln in lines if ln.startswith("h2d   h2d 64 KiB direct ") and " none " in ln)
    # x raw, link (64 KiB every 5 ms: 0.02% of it), then the target's verdict (104 / 151 us)
    assert row.split()[-3:] == ["0.927", "0.927", "met"]
    assert any("whole urgent phase h2d 50.2 (x raw 0.907)" in ln for ln in lines)
    old = _render(bench, "bench_gpu_without_per_size_bulk.json.gz")
    row = next(ln for ln in old if ln.startswith("h2d   h2d 64 KiB direct ") and " none " in ln)
    assert row.split()[-3:-1] == ["0.881", "0.900"]  # the whole phase, as recorded then


@pytest.mark.parametrize(
    ("row", "nbytes", "p50", "p99", "idle", "want"),
    [
        ("front", 64 * KiB, 130.0, 200.0, 10.0, "met"),
        ("front", MiB, 131.0, 150.0, 28.0, "not met"),  # p50 over 130
        ("direct", MiB, 100.0, 201.0, 28.0, "not met"),  # p99 over 200
        ("front", 16 * MiB, 400.0, 465.0, 310.0, "met"),  # 1.5x idle: 465
        ("ahead", 16 * MiB, 400.0, 466.0, 310.0, "not met"),
        ("express", 64 * KiB, 150.0, 250.0, 10.0, "met"),
        ("express/spin", 64 * KiB, 151.0, 200.0, 10.0, "not met"),  # the same row in another mode
        ("dma", 16 * MiB, 600.0, 720.0, 310.0, "met"),  # 2x idle + 100: 720
        ("express", 16 * MiB, 600.0, 721.0, 310.0, "not met"),
        ("priod-idle", 64 * KiB, 100.0, 150.0, 10.0, "met"),
        ("priod-idle", 64 * KiB, 101.0, 120.0, 10.0, "not met"),
        ("priod-idle", MiB, 90.0, 120.0, 28.0, ""),  # the idle daemon's target is 64 KiB's
        ("anchor", 64 * KiB, 150.0, 180.0, 10.0, ""),
        ("floor", 64 * KiB, 150.0, 180.0, 10.0, ""),
    ],
)
def test_each_row_is_held_to_its_own_target(
    bench: Any, row: str, nbytes: int, p50: float, p99: float, idle: float, want: str
) -> None:
    """The table's target column: the direct path, the daemon path under bulk and the idle
    daemon each against their own bounds, at the bound itself met; rows without one blank."""
    assert bench.verdict(row, nbytes, p50, p99, idle) == want
