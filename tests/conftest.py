"""Shared test harness: every async test runs on both asyncio and uvloop, with a loop
exception handler that fails the test (asyncpg's habit), and daemons run in their own process."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
import uvloop

from priod.testing import DaemonProcess, daemon_process


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
async def _fail_on_loop_errors() -> AsyncIterator[None]:
    """Any error the loop reports but nobody awaited (a task that died) fails the test."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield
    assert not errors, f"unhandled errors in the event loop: {errors}"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """A sim-engine daemon in its own process, shared by a module's tests."""
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    """A cuda-engine daemon (express lane on) in its own process, shared by a module's gpu tests."""
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=120) as d:
        yield d


def gpu_present() -> bool:
    try:
        from priod.common.cuda.driver import gpu_available
    except ImportError:
        return False
    return gpu_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_present() or os.environ.get("PRIOD_FORCE_GPU_TESTS"):
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU (or cuda-bindings) here: gpu tests run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
