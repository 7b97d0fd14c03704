"""scripts/bench_serving.py on any machine: the whole script on the sim engine (its priod rows,
every block checked with numpy), that its check catches blocks that did not land or landed from
the wrong slot, and the GPU run's table from a results file as that run writes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    import_script(ROOT / "scripts" / "bench_gpu.py", "bench_gpu")  # what the script imports by that name
    return import_script(SCRIPT, "priod_bench_serving")


def test_sim_run_prints_the_table_and_checks_every_block(tmp_path: Path) -> None:
    """End to end on sim: the daemon, a bulk client each way, the decode loop's urgent
    copy_batch every 5 ms; the table comes last, results.json has the row, every step's blocks
    were checked and none was wrong."""
    cmd = [sys.executable, str(SCRIPT), "--backend", "sim", "--steps", "20", "--shapes", "8x64K", "--warm-s", "0.2"]
    out = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("serving: K scattered blocks reloaded h2d every 5 ms beside bulk both ways; targets: ")
    assert "link (bulk + urgent) >= 0.97 of raw" in lines[0]
    row = next(ln for ln in lines if ln.startswith("8x64K") and " priod " in ln)
    assert "  8x64K priod gemm none: blocks checked" in out.stdout and "wrong 0: met" in out.stdout
    assert lines[-1].startswith("paths: ")

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == "sim"
    (r,) = results["rows"]
    assert (r["row"], r["shape"], r["steps"], len(r["lat_us"])) == ("priod", "8x64K", 20, 20)
    # every step is checked, the warm-up's too: 8 blocks a step
    assert r["checked"] == 8 * (r["steps"] + r["warm_steps"]) > 0
    assert r["wrong"] == 0
    assert sum(r["paths"].values()) == 20
    assert f"{r['checked']:>8} {r['wrong']:>5}" in row
    assert all(v > 0 for v in r["bulk_gbps"].values())  # both bulk clients moved bytes beside the steps
    assert (tmp_path / "table.txt").read_text().strip() == out.stdout.strip()


def test_the_check_counts_blocks_not_landed_or_from_the_wrong_slot(bench: Any) -> None:
    """The numpy check (sim) against a pool where the step's copies ran, then where one block
    kept an earlier step's bytes and one came from another host slot."""
    shape = bench.Shape(4, 8192)
    plan = bench.make_plan(shape, 3, seed=7)
    host = np.zeros((shape.slots, shape.words), dtype=np.int64)
    gpu = np.zeros_like(host)
    bench.fill_pattern(host)
    check = bench.NumpyCheck(shape, gpu)

    def land(step: int) -> None:
        bench.stamp_host(host, step, plan.host[step])
        gpu[plan.gpu[step]] = host[plan.host[step]]

    land(0)
    check.check(0, plan)
    assert check.result() == (4, 0)
    land(1)
    w, _, y, z = plan.gpu[1]
    gpu[w] = 0  # never landed
    other = (plan.host[1][2] + 1) % shape.slots
    bench.stamp_host(host, 1, np.array([other]))
    gpu[y] = host[other]  # this step's stamps, another slot's pattern
    gpu[z] = bench.expected_blocks(shape, 0, plan.host[1][3:])[0]  # the right slot's, an earlier step's stamps
    check.check(1, plan)
    assert check.result() == (8, 3)  # block 1 landed right


def test_shapes_parse_and_refuse_what_is_not_a_shape(bench: Any) -> None:
    assert bench.parse_shape("32x64K") == bench.Shape(32, 64 << 10)
    assert bench.parse_shape("128x128k").step_bytes == 16 << 20
    assert bench.parse_shape("2x1M").label == "2x1024K"
    for bad in ("32", "0x64K", "4x100", "x64K"):
        with pytest.raises(ValueError, match="shape"):
            bench.parse_shape(bad)


def row(name: str, shape: str, gemm: str, p99: float, **extra: Any) -> dict[str, Any]:
    return {
        "row": name,
        "shape": shape,
        "gemm": gemm,
        "steps": 800,
        "p50": p99 / 2,
        "p99": p99,
        "paths": extra.pop("paths", {"cudaMemcpyAsync": 800}),
        "checked": 32_000,
        "wrong": 0,
        "urgent_gbps": 1.0,
        **extra,
    }


def test_the_gpu_table_gives_each_target_its_verdict(bench: Any) -> None:
    """From a results file as the GPU run writes it: the 32x64K bound is 300 us, 128x128K's
    2 x its idle-contig row's p50; link and GEMM ratios against raw and the GEMM-only phase."""
    results = {
        "args": {"interval_ms": 5.0},
        "raw_gbps": {"h2d": 55.0, "d2h": 55.0},
        "gemm_alone": {"other": {"tflops": 700.0}, "same": {"tflops": 690.0}},
        "rows": [
            row("idle-contig", "128x128K", "none", 400.0),  # p50 200: the 128x128K bound is 400 us
            row(
                "anchor",
                "32x64K",
                "other",
                1290.0,
                bulk_gbps={"h2d": 53.0, "d2h": 53.0},
                gemm_rate={"tflops": 695.0},
            ),
            row(
                "priod",
                "32x64K",
                "other",
                250.0,
                paths={"direct": 798, "dma": 2},
                bulk_gbps={"h2d": 53.0, "d2h": 53.5},
                gemm_rate={"tflops": 696.5},
            ),
            row(
                "priod",
                "128x128K",
                "same",
                450.0,
                paths={"direct": 800},
                bulk_gbps={"h2d": 50.0, "d2h": 52.0},
                gemm_rate={"tflops": 680.0},
            ),
        ],
    }
    table = bench.render(results)
    lines = table.splitlines()
    assert "targets: step p99 <= 300 us for 32x64K beside GEMMs" in lines[0]
    anchor = next(ln for ln in lines if ln.startswith("32x64K") and " anchor " in ln)
    assert anchor.split()[-1] == "met"  # "NOT met": the last word is still "met"
    assert anchor.split()[-2] == "NOT"
    priod_row = next(ln for ln in lines if ln.startswith("32x64K") and " priod " in ln)
    assert "direct:798 dma:2" in priod_row
    assert priod_row.split()[-1] == "met" and priod_row.split()[-2] != "NOT"
    assert "  32x64K priod gemm other: p99 250 <= 300 us: met" in table
    assert "  32x64K priod gemm other: link 0.977 >= 0.97: met" in table  # (106.5 + 1) / 110
    assert "  32x64K priod gemm other: GEMMs 696 / alone 700 TFLOP/s = 0.995 >= 0.99: met (x anchor 1.002)" in table
    assert "  128x128K priod gemm same: p99 450 <= 2 x idle-contig p50 200 = 400 us: NOT met" in table
    assert "  128x128K priod gemm same: link 0.936 >= 0.97: NOT met" in table
    assert (
        "  128x128K priod gemm same: GEMMs 680 / alone 690 TFLOP/s = 0.986 >= 0.99: NOT met\n" in table
    )  # no anchor row
    assert "raw cudaMemcpyAsync, both ways at once, in-process: h2d 55.0 GB/s, d2h 55.0 GB/s" in table
