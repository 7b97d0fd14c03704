"""The front door on a real GPU (marker ``gpu``): urgent `copy` and `copy_batch` take the direct
path by themselves once this process can make the copy (the device region open here, the host
region pinned here, which starts on first need and off the copy's path), every byte checked."""

from __future__ import annotations

import numpy as np
import pytest

import priod
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess, wait_until

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _direct_once_pinned(c: priod.SyncClient, dst: priod.Region, src: priod.Region) -> None:
    """Urgent copies go through the daemon until the host region is pinned here, then direct."""
    wait_until(lambda: c.copy(dst, src, 4096, priority="urgent").path == "direct", 20, "the direct path")


def test_urgent_copies_take_the_direct_path_once_this_process_can_make_them(gpu_daemon: DaemonProcess) -> None:
    n = 4 * MiB
    rng = np.random.default_rng(21)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        host, dev, back = c.alloc_host(n), c.alloc_device(n), c.alloc_host(n)
        assert host.array is not None and back.array is not None
        host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        # The device region is not open in this process: the daemon makes the copy.
        assert c.copy(dev, host, priority="urgent").path in ("dma", "express")
        with pytest.raises(InvalidRequest, match="not open in this process"):
            c.copy(dev, host, priority="urgent", path="direct")
        dev.device_view()  # opened here: this process now has the GPU's context and the region's address
        _direct_once_pinned(c, dev, host)
        _direct_once_pinned(c, back, dev)

        for size, d_off, s_off in ((n, 0, 0), (3 * MiB + 5, 7, MiB - 13), (1, n - 1, 0)):
            back.array[:] = 0
            up = c.copy(dev, host, size, dst_offset=d_off, src_offset=s_off, priority="urgent")
            down = c.copy(back, dev, size, dst_offset=s_off, src_offset=d_off, priority="urgent")
            assert (up.path, down.path, up.nbytes, down.nbytes) == ("direct", "direct", size, size)
            assert np.array_equal(back.array[s_off : s_off + size], host.array[s_off : s_off + size]), size

        blocks = np.array([[i * 65536, (63 - i) * 65536, 65536] for i in range(64)], dtype=np.int64)
        back.array[:] = 0
        b = c.copy_batch(dev, host, blocks, priority="urgent")
        assert (b.path, b.nbytes, b.segments) == ("direct", 64 * 65536, 64)
        assert c.copy(back, dev, 64 * 65536, priority="bulk").path in ("dma", "express")  # checked by the daemon's path
        for d, s_, size in blocks.tolist():
            assert np.array_equal(back.array[d : d + size], host.array[s_ : s_ + size])
        assert sum(c.status()["direct"]["copies"].values()) > 0  # the daemon saw the holds
        c.free(host)  # unpinned here first, then freed


async def test_the_async_client_takes_the_direct_path_too(gpu_daemon: DaemonProcess) -> None:
    n = 8 * MiB  # past INLINE_DIRECT_BYTES: the copy runs on a worker thread
    rng = np.random.default_rng(22)
    async with priod.connect(gpu_daemon.socket_path) as c:
        host, dev, back = await c.alloc_host(n), await c.alloc_device(n), await c.alloc_host(n)
        assert host.array is not None and back.array is not None
        host.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        dev.device_view()
        for dst, src in ((dev, host), (back, dev)):
            for _ in range(2000):
                if (await c.copy(dst, src, 4096, priority="urgent")).path == "direct":
                    break
            else:
                raise AssertionError("the host region was never pinned")
        assert (await c.copy(dev, host, priority="urgent")).path == "direct"
        assert (await c.copy(back, dev, priority="urgent")).path == "direct"
        assert np.array_equal(back.array, host.array)
