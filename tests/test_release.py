"""Giving region memory back happens off the event loop.

On a GPU, ``cudaFree`` and ``cudaHostUnregister`` wait for the device; the daemon runs them on a
worker thread so the loop keeps serving. Here the sim engine's release is made slow (or made to
fail) to show both: other clients' copies go on meanwhile, and a failed release is logged while
the daemon keeps serving and still stops cleanly.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import structlog

import priod
from priod.daemon.config import load_config
from priod.daemon.engines.base import HostMemory
from priod.daemon.engines.sim import SimEngine, SimSettings
from priod.daemon.server import Daemon

SLOW_RELEASE_S = 1.0


class _ReleaseEngine(SimEngine):
    """The sim engine, with host releases that take SLOW_RELEASE_S (a cudaFree waiting for the
    device, say) or that fail."""

    def __init__(self, settings: SimSettings, *, failing: bool) -> None:
        super().__init__(settings)
        self.failing = failing
        self.released = threading.Event()

    def release_host(self, mem: HostMemory) -> None:
        if self.failing:
            self.released.set()
            raise OSError("injected release failure")
        time.sleep(SLOW_RELEASE_S)
        super().release_host(mem)
        self.released.set()


@pytest.fixture
async def daemon_with_release(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Daemon, threading.Event]]:
    """An in-process daemon whose host releases take SLOW_RELEASE_S ("slow") or raise ("failing")."""
    path = os.path.join(tempfile.mkdtemp(prefix="priod-"), "s.sock")
    cfg = load_config(None, environ={}).replace(server={"socket": path}, log={"level": "warning"})
    engine = _ReleaseEngine(cfg.sim, failing=request.param == "failing")
    daemon = Daemon(cfg, engine)
    await daemon.start()
    try:
        yield daemon, engine.released
    finally:
        await daemon.stop()


@pytest.mark.parametrize("daemon_with_release", ["slow"], indirect=True)
async def test_a_slow_release_does_not_stall_other_clients(daemon_with_release: tuple[Daemon, threading.Event]) -> None:
    daemon, released = daemon_with_release
    async with (
        priod.connect(daemon.cfg.socket_path, copy_path="daemon") as a,
        priod.connect(daemon.cfg.socket_path) as b,
    ):
        doomed = await a.alloc_host(1 << 20)
        h, d = await b.alloc_host(4096), await b.alloc_device(4096)
        assert h.array is not None and d.array is not None
        h.array[:] = 7
        await a.free(doomed)  # answered at once; the memory goes back on a worker thread
        t0 = time.perf_counter()
        r = await b.copy(d, h, priority="urgent")
        took = time.perf_counter() - t0
        assert r.nbytes == 4096 and int(d.array.min()) == 7
        assert not released.is_set(), "the release finished first: this run shows nothing"
        assert took < SLOW_RELEASE_S / 2, f"an urgent 4 KiB copy took {took:.3f} s while a region was being released"


@pytest.mark.parametrize("daemon_with_release", ["failing"], indirect=True)
async def test_a_failed_release_is_logged_and_the_daemon_serves_on(
    daemon_with_release: tuple[Daemon, threading.Event],
) -> None:
    daemon, released = daemon_with_release
    with structlog.testing.capture_logs() as logs:
        async with priod.connect(daemon.cfg.socket_path, copy_path="daemon") as c:
            region = await c.alloc_host(1 << 20)
            await c.free(region)
            deadline = time.monotonic() + 5
            while not any(e["event"] == "region_release_failed" for e in logs) and time.monotonic() < deadline:
                await c.ping()
            h, d = await c.alloc_host(4096), await c.alloc_device(4096)
            assert h.array is not None and d.array is not None
            h.array[:] = np.arange(4096, dtype=np.uint16).astype(np.uint8)
            await c.copy(d, h)
            assert np.array_equal(d.array, h.array)
    assert released.is_set()
    failed = [e for e in logs if e["event"] == "region_release_failed"]
    assert len(failed) == 1 and "injected release failure" in failed[0]["error"]
