"""scripts/bench.py's echo floor: both of its clients get every reply whole from the real uvloop
echo server, whether the polling client finds the reply while it polls or blocks for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from priod.testing.scripts import import_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script(ROOT / "scripts" / "bench.py", "priod_bench")


@pytest.mark.parametrize("spin_us", [0.0, 200.0, 1e6])
def test_polling_echo_client_reads_every_reply_whole(bench: Any, spin_us: float) -> None:
    """``spin_us`` 0 blocks in select at once, 1e6 never does: each way, 50 round trips each
    decode a whole reply frame (a torn or misframed read would fail the decode or hang)."""
    msg = bench.copy_request(1, 2, 64, "normal")
    with bench.echo_server() as path:
        latencies = bench.sync_rtt_echo_polling(path, msg, 50, spin_us)
        blocking = bench.sync_rtt_echo(path, msg, 50)
    assert len(latencies) == 50 and len(blocking) == 50
    assert all(0 < us < 5e6 for us in latencies + blocking)
