"""scripts/bench_gpu_batch.py's table, on any machine: each row's ratio to the anchor's same form,
the path counts of the chosen direct batch, and the targets' verdicts, from a results file as the
GPU run writes it. (The run itself needs a GPU; a wrong verdict here would only show there.)"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Any:
    import_script(ROOT / "scripts" / "bench_gpu.py", "bench_gpu")  # what the script imports by that name
    return import_script(ROOT / "scripts" / "bench_gpu_batch.py", "priod_bench_gpu_batch")


def lat(p50: float, p99: float) -> dict[str, float]:
    return {"p50": p50, "p99": p99, "n": 100}


def cell(
    anchor_batch: tuple[float, float],
    direct: tuple[float, float],
    contiguous: tuple[float, float],
    kernel: int,
    dma: int,
) -> dict[str, Any]:
    return {
        "anchor": {
            "latency_us": {"contiguous": lat(450, 480), "batch": lat(*anchor_batch), "loop": lat(2000, 2100)},
            "bulk_gbps": 52.0,
        },
        "priod_bulk": {
            "latency_us": {"batch": lat(900, 1100), "contiguous": lat(600, 750)},
            "paths": {"batch": ["express"], "contiguous": ["express"]},
            "bulk_contiguous": {"gbps": 49.5},
        },
        "direct_bulk": {
            "latency_us": {
                "batch": lat(*direct),
                "batch_kernel": lat(440, 500),
                "batch_dma": lat(600, 700),
                "contiguous": lat(*contiguous),
            },
            "chosen": [{"express_chosen": kernel, "dma_chosen": dma}],
            "bulk_contiguous": {"gbps": 44.0},
        },
        "cotenant": {"kind": "none"},
    }


def test_the_table_gives_ratios_to_the_anchor_path_counts_and_verdicts(bench: Any) -> None:
    results = {
        "inprocess": {
            "latency_us": {"contiguous": lat(310, 320), "batch": lat(360, 400), "loop": lat(900, 950)},
            "raw_gbps": 55.0,
            "batch_bulk_gbps": 52.0,
        },
        "cotenants": {
            "none": cell((1500, 1600), (450, 540), (400, 460), 104, 2),  # +80 over contiguous: met
            "gemm": cell((1500, 1600), (620, 1700), (400, 470), 2, 104),  # +1,230, and over the anchor's p99
        },
        "priod_batch_bulk": {"gbps": 49.0},
    }
    args = argparse.Namespace(blocks=256, block_kib=64, direction="h2d", gap="sleep")
    table = bench.render(results, args)
    lines = table.splitlines()
    chosen = next(ln for ln in lines if "direct under priod bulk: copy_batch (kernel 104x, dma 2x)" in ln)
    assert chosen.split()[-4:] == ["450.0", "540.0", "0.30", "0.34"]  # p50, p99, then xA against the anchor's batch
    assert "co-tenant none, direct: batch p99 540 <= contiguous p99 460 + 100 us: met" in table
    assert "co-tenant none, direct: batch beats the anchor's cuMemcpyBatchAsync at p50 and p99: yes" in table
    assert "co-tenant gemm, direct: batch p99 1700 <= contiguous p99 470 + 100 us: NOT met" in table
    assert "co-tenant gemm, direct: batch beats the anchor's cuMemcpyBatchAsync at p50 and p99: NO" in table
    assert "co-tenant none, through the daemon: batch p99 1100 <= contiguous p99 750 + 100 us: NOT met" in table
    bulk = next(ln for ln in lines if ln.startswith("priod bulk copy_batch"))
    assert bulk.split()[-2:] == ["49.00", "0.891"]
    assert "target: priod batch bulk >= 0.9 of raw: NOT met" in table
