"""Direct urgent copies on a real GPU (marker ``gpu``): the client's own DMA, bytes checked,
while the daemon runs bulk and holds it back for each one (priod.client.direct, holds.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import priod
from priod.client.direct import DirectCopies
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_direct_copies_move_the_right_bytes_both_ways_and_are_counted(gpu_daemon: DaemonProcess) -> None:
    import cupy as cp

    rng = np.random.default_rng(11)
    n = 3 * MiB + 5
    host = cp.cuda.alloc_pinned_memory(n)
    src = np.frombuffer(host, dtype=np.uint8, count=n)
    src[:] = rng.integers(0, 256, n, dtype=np.uint8)
    dev = cp.empty(n, dtype=cp.uint8)
    back_mem = cp.cuda.alloc_pinned_memory(n)
    back = np.frombuffer(back_mem, dtype=np.uint8, count=n)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page())
        for size in (1, 4097, 64 << 10, n):
            back[:size] = 0
            assert direct.copy(dev, src, size) == size
            assert direct.copy(back, dev, size) == size
            assert np.array_equal(back[:size], src[:size]), size
        # a pair, resolved once, with offsets inside both buffers; and what does not fit is refused
        up, down = direct.pair(dev, src), direct.pair(back, dev)
        back[:] = 0
        up.copy(4096, dst_offset=100, src_offset=7)
        down.copy(4096, dst_offset=9, src_offset=100)
        assert np.array_equal(back[9 : 9 + 4096], src[7 : 7 + 4096])
        with pytest.raises(InvalidRequest, match="do not fit"):
            up.copy(n, dst_offset=1)
        st = c.status()["direct"]
        assert sum(st["copies"].values()) == 10 and st["held"] == []
        direct.close()


def test_direct_copies_under_daemon_bulk_keep_both_copies_whole(gpu_daemon: DaemonProcess) -> None:
    """Bulk through the daemon in both directions while direct copies cut in: every byte of both."""
    import cupy as cp

    rng = np.random.default_rng(12)
    n = 1 * MiB
    host = cp.cuda.alloc_pinned_memory(n)
    src = np.frombuffer(host, dtype=np.uint8, count=n)
    dev = cp.empty(n, dtype=cp.uint8)
    back_mem = cp.cuda.alloc_pinned_memory(n)
    back = np.frombuffer(back_mem, dtype=np.uint8, count=n)

    async def bulk() -> None:
        async with await priod.connect(gpu_daemon.socket_path) as b:
            nb = 256 * MiB
            h, d, h2 = await b.alloc_host(nb), await b.alloc_device(nb), await b.alloc_host(nb)
            assert h.array is not None and h2.array is not None
            h.array[:] = rng.integers(0, 256, nb, dtype=np.uint8)
            for _ in range(4):
                await b.copy(d, h, priority="bulk")
                await b.copy(h2, d, priority="bulk")
            assert np.array_equal(h2.array, h.array)

    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page())
        loop = asyncio.new_event_loop()
        task = loop.run_in_executor(None, asyncio.run, bulk())
        copies = 0
        while not task.done() or copies < 20:
            src[:] = rng.integers(0, 256, n, dtype=np.uint8)
            direct.copy(dev, src)
            direct.copy(back, dev)
            assert np.array_equal(back, src)
            copies += 1
            loop.run_until_complete(asyncio.sleep(0.002))
        loop.run_until_complete(task)
        loop.close()
        assert sum(c.status()["direct"]["copies"].values()) >= 2 * copies
        direct.close()


@pytest.mark.parametrize("batch_path", ["kernel", "dma", "fastest"])
def test_a_direct_batch_lands_every_block_where_its_table_says(gpu_daemon: DaemonProcess, batch_path: str) -> None:
    """256 scattered 64 KiB blocks host to device and back, by the copy kernel (blocks under
    KERNEL_BLOCK_MAX), by batched DMA, and by the faster of the two: every block where its
    table says."""
    import cupy as cp

    rng = np.random.default_rng(13)
    blocks, block = 256, 64 << 10
    n = 2 * blocks * block
    host_mem, back_mem = cp.cuda.alloc_pinned_memory(n), cp.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(host_mem, dtype=np.uint8, count=n)
    back = np.frombuffer(back_mem, dtype=np.uint8, count=n)
    host[:] = rng.integers(0, 256, n, dtype=np.uint8)
    dev = cp.zeros(n, dtype=cp.uint8)
    cp.cuda.Device().synchronize()  # the zeros go on CuPy's stream, not ordered before a direct copy's
    table = np.stack(
        [
            rng.choice(2 * blocks, blocks, replace=False) * block,
            rng.choice(2 * blocks, blocks, replace=False) * block,
            np.full(blocks, block),
        ],
        axis=1,
    )
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page(), batch_path=batch_path)
        assert direct.pair(dev, host).copy_batch(table) == blocks * block
        back_table = table[:, [1, 0, 2]]  # each block back to where it came from
        back[:] = 0
        assert direct.pair(back, dev).copy_batch(back_table) == blocks * block
        on_gpu = cp.asnumpy(dev)
        for d_off, s_off, size in table.tolist():
            assert np.array_equal(on_gpu[d_off : d_off + size], host[s_off : s_off + size])
            assert np.array_equal(back[s_off : s_off + size], host[s_off : s_off + size])
        with pytest.raises(InvalidRequest, match="does not fit"):
            direct.pair(dev, host).copy_batch([[n - 10, 0, 64]])
        with pytest.raises(InvalidRequest, match=r"below 2\*\*62"):  # an offset that would wrap past 2**64
            direct.pair(dev, host).copy_batch(np.array([[2**64 - 64, 0, 128]], dtype=np.uint64))
        with pytest.raises(InvalidRequest, match="offsets >= 0"):
            direct.pair(dev, host).copy_batch([[0, -64, 64]])
        with pytest.raises(InvalidRequest, match="nbytes >= 1"):
            direct.pair(dev, host).copy_batch([[0, 0, 64], [64, 64, 0]])
        # One bad row among 255 good ones, fresh bytes at the source: the table is refused
        # whole (by the copy kernel's own check, or the host's) and not one block lands.
        host[:] = rng.integers(0, 256, n, dtype=np.uint8)
        before = cp.asnumpy(dev)
        for row, column, value, why in (
            (255, 0, n - block // 2, "does not fit"),
            (0, 1, -block, "offsets >= 0"),
            (128, 2, 0, "nbytes >= 1"),
        ):
            bad = table.copy()
            bad[row, column] = value
            with pytest.raises(InvalidRequest, match=why):
                direct.pair(dev, host).copy_batch(bad)
            assert np.array_equal(cp.asnumpy(dev), before)
        assert direct.pair(dev, host).copy_batch(table) == blocks * block  # and the next good one lands
        assert not np.array_equal(cp.asnumpy(dev), before)
        direct.close()


@pytest.mark.parametrize(
    ("batch_path", "per_call"),
    [("kernel", 300), ("kernel", 150), ("dma", 300)],
    ids=["kernel-host-checked", "kernel-checked", "dma"],
)
def test_a_direct_batch_of_odd_blocks_at_odd_offsets_is_exact(
    gpu_daemon: DaemonProcess, batch_path: str, per_call: int
) -> None:
    """Blocks of 1 byte to 100 KB at unaligned offsets, each in its own 128 KiB slot, both ways:
    every byte of every block lands, and nothing around them changes. 300 rows in one call go
    past one kernel launch (checked on the host, two tables); 150 a call, the kernel checks them."""
    import cupy as cp

    rng = np.random.default_rng(17)
    blocks, slot = 300, 128 << 10
    n = blocks * slot
    sizes = rng.integers(1, 100_000, blocks)
    dst_offs = rng.permutation(blocks) * slot + rng.integers(0, slot - sizes)
    src_offs = rng.permutation(blocks) * slot + rng.integers(0, slot - sizes)
    table = np.stack([dst_offs, src_offs, sizes], axis=1)
    host_mem, back_mem = cp.cuda.alloc_pinned_memory(n), cp.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(host_mem, dtype=np.uint8, count=n)
    back = np.frombuffer(back_mem, dtype=np.uint8, count=n)
    host[:] = rng.integers(0, 256, n, dtype=np.uint8)
    back[:] = 7
    dev = cp.full(n, 3, dtype=cp.uint8)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page(), batch_path=batch_path)
        for first in range(0, blocks, per_call):
            part = table[first : first + per_call]
            assert direct.pair(dev, host).copy_batch(part) == int(part[:, 2].sum())
            assert direct.pair(back, dev).copy_batch(part[:, [1, 0, 2]]) == int(part[:, 2].sum())
        direct.close()
    want_dev = np.full(n, 3, dtype=np.uint8)
    want_back = np.full(n, 7, dtype=np.uint8)
    for d_off, s_off, size in table.tolist():
        want_dev[d_off : d_off + size] = host[s_off : s_off + size]
        want_back[s_off : s_off + size] = host[s_off : s_off + size]
    assert np.array_equal(cp.asnumpy(dev), want_dev)
    assert np.array_equal(back, want_back)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_torch_tensors_of_any_dtype_copy_directly(gpu_daemon: DaemonProcess, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    x = torch.randn(4096, 64).to(dt).pin_memory()
    g = torch.empty_like(x, device="cuda")
    y = torch.empty_like(x).pin_memory()
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page())
        direct.copy(g, x)
        direct.copy(y, g)
        assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
        direct.close()


def test_pageable_host_memory_is_refused_with_the_fix(gpu_daemon: DaemonProcess) -> None:
    import cupy as cp

    dev = cp.empty(4096, dtype=cp.uint8)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        direct = DirectCopies(c.hold_page())
        with pytest.raises(InvalidRequest, match="pinned host memory"):
            direct.copy(dev, np.zeros(4096, dtype=np.uint8))
        direct.close()


def test_pin_host_lets_a_direct_copy_use_a_host_region_the_daemon_holds(gpu_daemon: DaemonProcess) -> None:
    """A host region the daemon allocated, pinned in this process with pin_host: a direct batch
    reads it (the bytes land), the daemon's own copy of it still works beside, pinning it twice
    or pinning GPU memory is refused with the reason, and once unpinned a direct copy refuses it."""
    import cupy as cp

    from priod.client.direct import pin_host

    rng = np.random.default_rng(23)
    blocks, block = 64, 16 << 10
    n = 2 * blocks * block
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        h = c.alloc_host(n)
        assert h.array is not None
        h.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        dev = cp.zeros(n, dtype=cp.uint8)
        cp.cuda.Device().synchronize()  # as above: CuPy's zeros are not ordered before a direct copy
        table = np.stack(
            [
                rng.choice(2 * blocks, blocks, replace=False) * block,
                rng.choice(2 * blocks, blocks, replace=False) * block,
                np.full(blocks, block),
            ],
            axis=1,
        )
        direct = DirectCopies(c.hold_page())
        with pin_host(h):
            with pytest.raises(InvalidRequest, match="pinned here already"):
                pin_host(h.array)
            assert direct.pair(dev, h.array).copy_batch(table) == blocks * block
            d = c.alloc_device(n)
            assert c.copy(d, h).nbytes == n  # the daemon's copy of the same region, beside
            c.free(d)
        got = cp.asnumpy(dev)
        for d_off, s_off, size in table.tolist():
            assert np.array_equal(got[d_off : d_off + size], h.array[s_off : s_off + size])
        with pytest.raises(InvalidRequest, match="GPU memory"):
            pin_host(dev)
        with pytest.raises(InvalidRequest, match="pinned host memory"):
            direct.pair(dev, h.array)
        direct.close()
