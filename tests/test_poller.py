"""The poller on an engine that must be polled (as cuda is): ``[server] bulk_poll`` modes.

The sim engine normally wakes the daemon on every completion; here that is switched off, so
the daemon finds completions only by polling, as it does on a GPU.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

import priod
from priod.config import load_config
from priod.engines.sim import SimEngine
from priod.server import Daemon

NBYTES = 64 << 20  # 32 chunks of ~1 MB at the sim's 2 GB/s: 32 ms of bulk


async def _copy_counting_polls(mode: str) -> int:
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path, "bulk_poll": mode}, log={"level": "warning"})
    engine = SimEngine(cfg.sim)
    engine.wakes_on_completion = False  # completions are found by polling only, as on a GPU
    daemon = Daemon(cfg, engine)
    polls = 0
    poll = daemon._poll

    def counting_poll() -> bool:
        nonlocal polls
        polls += 1
        return poll()

    daemon._poll = counting_poll  # type: ignore[method-assign]
    await daemon.start()
    try:
        async with priod.connect(path) as c:
            h, d = await c.alloc_host(NBYTES), await c.alloc_device(NBYTES)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(NBYTES, dtype=np.uint32).astype(np.uint8)
            r = await c.copy(d, h, priority="bulk")
            assert r.nbytes == NBYTES and np.array_equal(d.array, h.array)
            small = await c.copy(d, h, 4096, priority="urgent")  # urgent work is polled tightly in both modes
            assert small.nbytes == 4096
    finally:
        await daemon.stop()
    return polls


@pytest.mark.parametrize("mode", ["spin", "timer"])
async def test_polled_engine_completes_every_copy(mode: str) -> None:
    """With completions found by polling alone, bulk and urgent copies complete in both modes."""
    assert await _copy_counting_polls(mode) > 0


async def test_timer_mode_polls_far_less_than_spin() -> None:
    """While only bulk chunks are in flight, "timer" sleeps until a chunk is due instead of
    polling every loop turn: several times fewer polls for the same copy."""
    spin = await _copy_counting_polls("spin")
    timer = await _copy_counting_polls("timer")
    assert timer * 3 < spin, (timer, spin)
