"""scripts/dashboard_png.py: its PromQL stand-ins compute what Prometheus computes, its panels
are the dashboard's, and a short run against a live daemon fills every main panel."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dashboard_png.py"
DASHBOARD = ROOT / "deploy" / "helm" / "priod" / "files" / "priod-dashboard.json"


@pytest.fixture(scope="module")
def dp() -> ModuleType:
    """The script, imported as a module."""
    return import_script(SCRIPT, "priod_dashboard_png")


def test_histogram_quantile_interpolates_as_prometheus_does(dp: ModuleType) -> None:
    """Linear inside the bucket the rank falls in, from 0 for the lowest bucket, the highest
    finite bound for a rank in +Inf, NaN without observations."""
    buckets = {0.001: 10.0, 0.01: 90.0, math.inf: 100.0}
    assert dp.histogram_quantile(0.05, buckets) == pytest.approx(0.0005)
    assert dp.histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 40 / 80)
    assert dp.histogram_quantile(0.9, buckets) == pytest.approx(0.01)
    assert dp.histogram_quantile(0.995, buckets) == 0.01
    assert math.isnan(dp.histogram_quantile(0.5, {0.001: 0.0, math.inf: 0.0}))
    assert math.isnan(dp.histogram_quantile(0.5, {0.001: 3.0}))  # no +Inf bucket


def test_rate_and_sum_by(dp: ModuleType) -> None:
    """rate() over two scrapes per series (a series new in between counts from 0, a reset
    from 0 again), and sum by the named labels."""

    def labels(**kw: str) -> frozenset[tuple[str, str]]:
        return frozenset(kw.items())

    then = dp.Scrape(10.0, {("c_total", labels(p="a", d="h2d")): 100.0, ("c_total", labels(p="b", d="h2d")): 50.0})
    now = dp.Scrape(
        12.0,
        {
            ("c_total", labels(p="a", d="h2d")): 140.0,
            ("c_total", labels(p="b", d="h2d")): 10.0,  # reset: counted from 0
            ("c_total", labels(p="a", d="d2h")): 6.0,  # new
            ("other_total", labels(p="a", d="h2d")): 1e9,
        },
    )
    r = dp.rate(now, then, "c_total")
    assert r == {labels(p="a", d="h2d"): 20.0, labels(p="b", d="h2d"): 5.0, labels(p="a", d="d2h"): 3.0}
    assert dp.sum_by(r, ("d",)) == {("h2d",): 25.0, ("d2h",): 3.0}
    assert dp.rate(now, then, "c_total", p="b") == {labels(p="b", d="h2d"): 5.0}


def test_panels_are_dashboard_panels(dp: ModuleType) -> None:
    """Every panel the PNG plots has a panel of the same title in the Grafana dashboard."""
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    plotted = [p.title for p in dp.panels()]
    assert len(plotted) == 8 and set(plotted) <= titles


@pytest.mark.slow
def test_short_run_fills_every_main_panel(dp: ModuleType, tmp_path: Path) -> None:
    """Against a live sim daemon under a 6 s load, every panel gets series from the scraped
    metrics: urgent latency on the GPU (by ordinal), bulk bytes both ways, the urgent path counts, limit
    refusals, missed deadlines of the normal class; the PNG is written."""
    out = tmp_path / "dash.png"
    args = dp.argparse.Namespace(
        duration=6.0, scrape_s=0.5, window_s=2.0, h2d_gbps=0.5, refuse_every_s=0.25, dpi=40, out=str(out)
    )
    result = dp.run(args)
    panels = {p.title: p.series for p in result["panels"]}
    assert all(panels.values()), [t for t, s in panels.items() if not s]
    latency = panels["Urgent copy latency by GPU (p50, p99, p99.9)"]
    p99 = [pts for name, pts in latency.items() if name == "p99 gpu 0"]  # the sim GPU's ordinal
    assert len(p99) == 1 and any(v > 0 for _, v in p99[0]), sorted(latency)
    bytes_s = panels["Bytes/s by class and direction"]
    assert max(v for _, v in bytes_s["bulk h2d"]) > 0.05 and max(v for _, v in bytes_s["bulk d2h"]) > 0.05
    assert max(v for _, v in panels["Refusals by code"]["limit"]) > 0
    assert max(v for _, v in panels["Deadline misses by class"]["normal"]) > 0
    assert sum(max(v for _, v in pts) for pts in panels["Urgent copies: express vs DMA"].values()) > 0
    assert result["engine"] == "sim" and result["sim_on_gpu_node"] == 0
    dp.plot(result, str(out), args)
    assert out.stat().st_size > 20_000
