"""The front door: `copy` and `copy_batch` with the urgent class take the direct path where this
process can make the copy itself, the daemon's otherwise, and both paths mean the same thing.

On the sim engine the direct path is the client moving the bytes between the two shared
memfds itself, inside a hold announced on its page (the daemon holds bulk back meanwhile). Every
call runs both ways here, with its bytes checked; the CUDA form runs in tests/test_gpu_direct.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.client import INLINE_DIRECT_BYTES
from priod.errors import InvalidRequest, NotFound
from priod.testing import DaemonProcess, daemon_process, wait_until
from priod.wire.hold_page import WORDS_PER_SLOT

MiB = 1 << 20
PATHS = ("direct", "daemon")


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}) as d:
        yield d


def _pattern(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _expect_path(result: Any, path: str) -> None:
    if path == "direct":
        assert result.path == "direct"
    else:
        assert result.path in ("dma", "express")


@pytest.mark.parametrize("path", PATHS)
def test_sync_copy_and_batch_move_the_same_bytes_on_either_path(daemon: DaemonProcess, path: str) -> None:
    with priod.SyncClient(daemon.socket_path) as c:
        host, dev, back = c.alloc_host(4 * MiB), c.alloc_device(4 * MiB), c.alloc_host(4 * MiB)
        assert host.array is not None and dev.array is not None and back.array is not None
        host.array[:] = _pattern(4 * MiB, 1)
        r = c.copy(dev, host, 3 * MiB, dst_offset=MiB, src_offset=0, priority="urgent", path=path)  # type: ignore[arg-type]
        _expect_path(r, path)
        assert r.nbytes == 3 * MiB
        assert np.array_equal(dev.array[MiB:], host.array[: 3 * MiB])
        r = c.copy(back, dev, 3 * MiB, dst_offset=5, src_offset=MiB, priority="urgent", path=path)  # type: ignore[arg-type]
        _expect_path(r, path)
        assert np.array_equal(back.array[5 : 5 + 3 * MiB], host.array[: 3 * MiB])

        blocks = np.array([[i * 65536, (31 - i) * 65536, 65536] for i in range(32)], dtype=np.int64)
        b = c.copy_batch(dev, host, blocks, priority="urgent", path=path)  # type: ignore[arg-type]
        _expect_path(b, path)
        assert (b.nbytes, b.segments) == (32 * 65536, 32)
        for d, s, n in blocks.tolist():
            assert np.array_equal(dev.array[d : d + n], host.array[s : s + n])


def test_auto_takes_the_direct_path_for_urgent_copies_only(daemon: DaemonProcess) -> None:
    with priod.SyncClient(daemon.socket_path) as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        assert c.copy(dev, host, priority="urgent").path == "direct"
        assert c.copy(dev, host, priority="bulk").path in ("dma", "express")
        assert c.copy(dev, host).path in ("dma", "express")  # no class: normal
        assert c.copy_batch(dev, host, [(0, 0, 4096)], priority="urgent").path == "direct"
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        assert c.copy(dev, host, priority="urgent").path in ("dma", "express")  # the connection's default
        assert c.copy(dev, host, priority="urgent", path="direct").path == "direct"  # the call's wins


def test_a_forced_direct_copy_this_process_cannot_make_says_why(daemon: DaemonProcess) -> None:
    with priod.SyncClient(daemon.socket_path) as c:
        host, other, dev = c.alloc_host(MiB), c.alloc_host(MiB), c.alloc_device(MiB)
        with pytest.raises(InvalidRequest, match="only urgent copies take the direct path"):
            c.copy(dev, host, priority="bulk", path="direct")
        with pytest.raises(InvalidRequest, match="between a host region and a device region"):
            c.copy(other, host, priority="urgent", path="direct")
        with pytest.raises(InvalidRequest, match="both regions are host memory"):
            c.copy(other, host, priority="urgent")  # auto: to the daemon, whose refusal it is
        with pytest.raises(InvalidRequest, match="path = 'sideways' is not one of"):
            c.copy(dev, host, priority="urgent", path="sideways")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nbytes", "dst_offset", "segments"),
    [
        (MiB + 1, 0, [(0, 0, 8192), (4096, 65536, 8192)]),  # past the end; overlapping destinations
        (4096, MiB - 100, [(MiB - 4096, 0, 8192)]),  # an offset past the end; a segment past it
    ],
)
def test_bad_copies_get_the_same_error_on_both_paths(
    daemon: DaemonProcess, nbytes: int, dst_offset: int, segments: list[tuple[int, int, int]]
) -> None:
    """A copy or batch outside its regions is refused with the same class and words whichever
    path it would take, and moves no byte."""
    with priod.SyncClient(daemon.socket_path) as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        assert dev.array is not None
        messages = {}
        for path in PATHS:
            with pytest.raises(InvalidRequest) as copy_error:
                c.copy(dev, host, nbytes, dst_offset=dst_offset, priority="urgent", path=path)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest) as batch_error:
                c.copy_batch(dev, host, segments, priority="urgent", path=path)  # type: ignore[arg-type]
            messages[path] = (str(copy_error.value), str(batch_error.value))
        assert messages["direct"] == messages["daemon"], messages
        assert not dev.array.any()


@pytest.mark.parametrize("path", PATHS)
async def test_async_copy_and_batch_move_the_same_bytes_on_either_path(daemon: DaemonProcess, path: str) -> None:
    async with priod.connect(daemon.socket_path) as c:
        host, dev = await c.alloc_host(2 * MiB), await c.alloc_device(2 * MiB)
        assert host.array is not None and dev.array is not None
        host.array[:] = _pattern(2 * MiB, 2)
        r = await c.copy(dev, host, priority="urgent", path=path)  # type: ignore[arg-type]
        _expect_path(r, path)
        assert np.array_equal(dev.array, host.array)
        host.array[:] = _pattern(2 * MiB, 3)
        b = await c.copy_batch(dev, host, [(0, MiB, MiB), (MiB, 0, MiB)], priority="urgent", path=path)  # type: ignore[arg-type]
        _expect_path(b, path)
        assert np.array_equal(dev.array[:MiB], host.array[MiB:]) and np.array_equal(dev.array[MiB:], host.array[:MiB])


async def test_a_large_direct_copy_leaves_the_event_loop_serving(daemon: DaemonProcess) -> None:
    """Past `INLINE_DIRECT_BYTES` a direct copy runs on a worker thread: a task ticking every
    millisecond keeps ticking while it runs (on the loop, a 256 MiB copy would stop it for its
    whole length)."""
    size = 256 * MiB
    assert size > INLINE_DIRECT_BYTES
    async with priod.connect(daemon.socket_path) as c:
        host, dev = await c.alloc_host(size), await c.alloc_device(size)
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        r = await c.copy(dev, host, priority="urgent")
        t1 = time.perf_counter()
        ticker.cancel()
        assert r.path == "direct" and r.nbytes == size
        during = [t for t in ticks if t0 < t < t1]
        assert t1 - t0 > 0.005, "the copy was too quick to tell"  # 256 MiB by numpy: tens of ms
        assert len(during) >= 2, (t1 - t0, len(during))


def test_a_uid_past_its_hold_budget_goes_through_the_daemon_and_comes_back() -> None:
    """When the daemon says on the page that this uid's hold budget on the lane is spent, urgent
    copies go through the daemon instead of running un-held, and take the direct path again once
    the budget has refilled; a forced direct copy says why it cannot."""
    env = {
        "PRIOD_LOG__LEVEL": '"warning"',
        "PRIOD_TUNING__DIRECT_HOLD_BURST_MS": "1",  # 20 copies' worth (each costs >= 50 us)
        "PRIOD_SCHEDULER__URGENT_BUDGET_SHARE": "0.01",  # refills 1 ms of holding in 0.1 s
    }
    with daemon_process(env) as d, priod.SyncClient(d.socket_path) as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        paths = []
        for _ in range(200):
            paths.append(c.copy(dev, host, 4096, priority="urgent").path)
            c.status()  # the daemon updates the page's word when it scans the pages
            if paths[-1] != "direct":
                break
        assert paths[0] == "direct" and paths[-1] in ("dma", "express"), paths
        with pytest.raises(InvalidRequest, match="hold budget on the lane is spent"):
            c.copy(dev, host, 4096, priority="urgent", path="direct")

        def direct_again() -> bool:
            c.status()
            return c.copy(dev, host, 4096, priority="urgent").path == "direct"

        wait_until(direct_again, 10, "the direct path after the budget refilled")


@pytest.mark.parametrize("timeout", [0.0, -1.0, 1e-9, float("nan"), float("inf"), float("-inf"), 1e300])
def test_sync_timeouts_of_any_value_end_cleanly_and_leave_no_copy_running(timeout: float) -> None:
    """A blocking copy given any float as its timeout either finishes, times out (cancelled in
    the daemon, `CopyTimeout`), or is refused before it is sent (NaN): never a ValueError or
    OverflowError from the socket with the copy still running."""
    slow = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SIM__H2D_GBPS": "0.5"}  # 64 MiB: ~130 ms
    with daemon_process(slow) as d, priod.SyncClient(d.socket_path) as c:
        host, dev = c.alloc_host(64 * MiB), c.alloc_device(64 * MiB)
        try:
            r = c.copy(dev, host, priority="bulk", timeout=timeout)
            assert r.nbytes == 64 * MiB and timeout > 1
        except priod.CopyTimeout:
            assert timeout <= 1e-9
        except InvalidRequest as exc:
            assert timeout != timeout and "timeout = nan" in str(exc)
        assert c.status()["totals"]["copies"] in (0, 1)
        assert not any(c["pending"] for c in c.status()["clients"]), "a copy runs on after the call returned"


def test_a_region_freed_after_its_direct_copies_is_refused_not_copied(daemon: DaemonProcess) -> None:
    """The route remembers a pair that took the direct path; freeing either region forgets it,
    so the next copy naming the region is refused, on both paths, and moves nothing."""
    with priod.SyncClient(daemon.socket_path) as c:
        host, dev, other = c.alloc_host(MiB), c.alloc_device(MiB), c.alloc_host(MiB)
        assert c.copy(dev, host, priority="urgent").path == "direct"
        assert c.copy(other, dev, priority="urgent").path == "direct"
        c.free(host)
        with pytest.raises(NotFound, match="no region"):
            c.copy(dev, host, priority="urgent")  # auto: to the daemon, which no longer has it
        with pytest.raises(InvalidRequest, match="not mapped in this process"):
            c.copy(dev, host, priority="urgent", path="direct")
        assert c.copy(other, dev, priority="urgent").path == "direct"  # the other pair is unaffected


def test_a_refused_direct_batch_leaves_no_hold_behind(daemon: DaemonProcess) -> None:
    """A direct batch's hold begins before its table is checked; a table that fails the checks
    ends it at once: every begun counter of the page has its end."""
    with priod.SyncClient(daemon.socket_path) as c:
        host, dev = c.alloc_host(MiB), c.alloc_device(MiB)
        assert c.copy(dev, host, priority="urgent").path == "direct"
        with pytest.raises(InvalidRequest, match="overlap"):
            c.copy_batch(dev, host, [(0, 0, 8192), (4096, 65536, 8192)], priority="urgent")
        page = c.route.page()
        words = page._words.tolist()  # the page as the daemon reads it
        counters = [tuple(words[i * WORDS_PER_SLOT : i * WORDS_PER_SLOT + 2]) for i in range(len(page.lanes))]
        assert all(begun == ended for begun, ended in counters), counters
        assert any(begun >= 2 for begun, _ in counters), counters  # the copy's hold, and the batch's
