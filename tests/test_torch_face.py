"""priod.client.torch_face on the CPU (torch's CPU build; skipped without torch), through a sim daemon:
tensors that view regions, their byte offsets, every dtype through byte views, tensor copies
and paged-block batches landing at the right bytes, and the errors for what cannot be named."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.cuda_ipc import device_span
from priod.client.torch_face import block_segments, block_table, where
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess

torch: Any = pytest.importorskip("torch")

DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _random(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    """Random bytes as ``dtype`` (every bit pattern, NaNs included: copies move bytes)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _bytes(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def test_importing_priod_does_not_import_torch() -> None:
    """priod and its torch face import without pulling torch in (a client without torch works)."""
    code = "import sys, priod, priod.client.torch_face, priod.client.sync_client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_host_view_is_the_region_memory(daemon: DaemonProcess) -> None:
    """Region.torch() of a host region is zero-copy: same address, writes show in .array both ways."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h = c.alloc_host(8192)
        assert h.array is not None
        t = h.torch(torch.bfloat16, (16, -1))
        assert t.shape == (16, 256) and t.dtype == torch.bfloat16
        assert t.data_ptr() == h.array.ctypes.data
        t[3, 5] = 1.5
        assert _bytes(t[3, 5:6]) == bytes(h.array[(3 * 256 + 5) * 2 : (3 * 256 + 6) * 2])
        h.array[:2] = [0x80, 0x3F]  # bf16 1.0, little-endian
        assert float(t[0, 0]) == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_where_gives_region_offset_and_bytes_of_sliced_views(daemon: DaemonProcess, dtype: Any) -> None:
    """Slices of a region's view map to the region, their byte offset and size, for each dtype."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        other, h = c.alloc_host(4096), c.alloc_host(1 << 16)
        t = h.torch(dtype, (32, -1))
        size = t.element_size()
        row = t.shape[1] * size
        assert where(t, [other, h]) == (h, 0, 1 << 16)
        assert where(t[3:5], [other, h]) == (h, 3 * row, 2 * row)
        assert where(t[7, 11:], [other, h]) == (h, 7 * row + 11 * size, row - 11 * size)
        assert where(t.reshape(-1).view(torch.uint8)[1:], [other, h]) == (h, 1, (1 << 16) - 1)


def test_where_refuses_what_it_cannot_name(daemon: DaemonProcess) -> None:
    """Non-contiguous views, empty tensors and tensors outside every region are refused, saying what to do."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h = c.alloc_host(4096)
        t = h.torch(torch.float32, (32, 32))
        with pytest.raises(
            InvalidRequest,
            match=r"^the tensor is not contiguous \(shape \(32, 2\), strides \(32, 1\)\): a copy names one byte range",
        ):
            where(t[:, 1:3], [h])
        with pytest.raises(InvalidRequest, match=r"^the tensor is empty: there is nothing to copy$"):
            where(t[5:5], [h])
        with pytest.raises(
            InvalidRequest,
            match=r"^this host tensor \(shape \(32, 32\), torch.float32, at 0x[0-9a-f]+\) is not inside any region of this connection",
        ):
            where(torch.zeros(32, 32), [h])
        with pytest.raises(TypeError, match=r"^expected a torch.Tensor, got ndarray$"):
            where(np.zeros(4), [h])
        with pytest.raises(
            InvalidRequest, match=r"^the destination holds 128 bytes \(\(32,\), torch.float32\) and the source 64 "
        ):
            c.copy_tensor(t[0], t[1, :16])


def test_a_freed_region_names_no_tensor(daemon: DaemonProcess) -> None:
    """After free, a tensor that viewed the region is no longer found in it (its memory is gone)."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(4096), c.alloc_device(4096)
        t = h.torch()
        c.free(h)
        with pytest.raises(InvalidRequest, match=r"^this host tensor .* is not inside any region of this connection"):
            c.copy_tensor(d.torch(), t)
        with pytest.raises(
            InvalidRequest,
            match=r"^<priod.Region \d+ host 4096 bytes> is not mapped in this process any more \(freed, or its connection closed\)$",
        ):
            h.torch()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
def test_copy_tensor_lands_at_the_right_bytes(daemon: DaemonProcess, dtype: Any) -> None:
    """copy_tensor between slices of a host view and a (sim) device view moves exactly those
    bytes, at their offsets, in both directions; nothing around them changes."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(1 << 16), c.alloc_device(1 << 16)
        assert h.array is not None and d.array is not None
        host, dev = h.torch(dtype, (64, -1)), d.torch(dtype, (64, -1))
        host.copy_(_random(tuple(host.shape), dtype, 1))
        before = d.array.copy()
        r = c.copy_tensor(dev[10:13], host[40:43], priority="urgent")
        row = host.shape[1] * host.element_size()
        assert r.nbytes == 3 * row
        assert _bytes(dev[10:13]) == _bytes(host[40:43])
        changed = np.flatnonzero(d.array != before)
        assert changed.min() >= 10 * row and changed.max() < 13 * row
        host.zero_()
        c.copy_tensor(host[0, 7:], dev[12, 7:], priority="bulk")
        assert _bytes(host[0, 7:]) == _bytes(dev[12, 7:])
        assert not host[1:].view(torch.uint8).any() and not host[0, :7].view(torch.uint8).any()


async def test_async_client_copies_tensors_and_blocks(daemon: DaemonProcess) -> None:
    """The asyncio Client has copy_tensor and copy_blocks too, with the same results."""
    async with priod.connect(daemon.socket_path, copy_path="daemon") as c:
        h, d = await c.alloc_host(1 << 15), await c.alloc_device(1 << 15)
        host, dev = h.torch(torch.bfloat16, (16, -1)), d.torch(torch.bfloat16, (16, -1))
        host.copy_(_random((16, host.shape[1]), torch.bfloat16, 2))
        r = await c.copy_tensor(dev[2], host[9])
        assert r.nbytes == host.shape[1] * 2 and _bytes(dev[2]) == _bytes(host[9])
        b = await c.copy_blocks(dev, host, [5, 6, 0], [1, 2, 3], priority="urgent")
        assert b.segments == 3
        assert torch.equal(dev[[5, 6, 0]].view(torch.int16), host[[1, 2, 3]].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copy_blocks_moves_paged_kv_blocks(daemon: DaemonProcess, dtype: Any) -> None:
    """A vLLM-style cache (2, blocks, block_size, heads, dim) offloads scattered blocks to a host
    pool of another size as one batch (K and V of each block: 2 segments a block) and back into
    other block ids; exactly those blocks change."""
    shape = (2, 24, 16, 2, 32)
    pool_shape = (2, 40, 16, 2, 32)
    size = torch.empty((), dtype=dtype).element_size()
    block = int(np.prod(shape[2:])) * size
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        d, h = c.alloc_device(int(np.prod(shape)) * size), c.alloc_host(int(np.prod(pool_shape)) * size)
        cache, pool = d.torch(dtype, shape), h.torch(dtype, pool_shape)
        cache.copy_(_random(shape, dtype, 3))
        dev_ids, host_ids = [17, 3, 9, 4, 22], [0, 39, 7, 8, 1]
        r = c.copy_blocks(pool, cache, host_ids, dev_ids, block_dim=1, priority="bulk")
        assert (r.segments, r.nbytes) == (10, 10 * block)
        for hi, di in zip(host_ids, dev_ids, strict=True):
            assert _bytes(pool[:, hi]) == _bytes(cache[:, di])
        kept = cache.clone()
        back = [0, 1, 2, 5, 6]
        c.copy_blocks(cache, pool, back, host_ids, block_dim=1, priority="urgent")
        for bi, di in zip(back, dev_ids, strict=True):
            assert _bytes(cache[:, bi]) == _bytes(kept[:, di])
        others = [i for i in range(shape[1]) if i not in back]
        assert _bytes(cache[:, others]) == _bytes(kept[:, others])


def test_copy_blocks_between_regions_by_block_bytes(daemon: DaemonProcess) -> None:
    """Regions as block arrays of block_bytes: the table is block id x block_bytes both sides."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(64 << 10), c.alloc_device(64 << 10)
        assert h.array is not None and d.array is not None
        h.array[:] = np.random.default_rng(4).integers(0, 256, h.nbytes, dtype=np.uint8)
        r = c.copy_blocks(d, h, [3, 0], [1, 15], block_bytes=4096)
        assert (r.segments, r.nbytes) == (2, 8192)
        assert np.array_equal(d.array[3 * 4096 : 4 * 4096], h.array[4096:8192])
        assert np.array_equal(d.array[:4096], h.array[15 * 4096 :])
    table = block_table([3, 0], [1, 15], 4096, dst_offset=100)
    assert table.tolist() == [[100 + 3 * 4096, 4096, 4096], [100, 15 * 4096, 4096]]


def test_block_segments_checks_before_sending(daemon: DaemonProcess) -> None:
    """Block ids out of range, unpaired id lists, mismatched block shapes and blocks that are not
    one byte range are refused before any request goes out."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h, d = c.alloc_host(1 << 16), c.alloc_device(1 << 16)
        cache, pool = d.torch(torch.bfloat16, (2, 16, 1024)), h.torch(torch.bfloat16, (2, 16, 1024))
        regions = [h, d]
        with pytest.raises(InvalidRequest, match=r"^src_ids holds block id 16, outside 0\.\.15$"):
            block_segments(pool, cache, [0], [16], regions, block_dim=1)
        with pytest.raises(InvalidRequest, match=r"^dst_ids holds block id -1, outside 0\.\.15$"):
            block_segments(pool, cache, [-1], [0], regions, block_dim=1)
        with pytest.raises(
            InvalidRequest, match=r"^dst_ids has 2 block ids and src_ids 1: they pair up, so they must match$"
        ):
            block_segments(pool, cache, [0, 1], [0], regions, block_dim=1)
        with pytest.raises(
            InvalidRequest, match=r"^the destination's blocks are 2 x 2048 bytes and the source's 1 x 4096"
        ):
            block_segments(pool, d.torch(torch.bfloat16, (1, 16, 2048)), [0], [0], regions, block_dim=1)
        with pytest.raises(
            InvalidRequest,
            match=r"^a block \(dimensions after 1 of shape \(2, 16, 512\), strides \(16384, 1024, 2\)\) is not contiguous",
        ):
            block_segments(pool[..., ::2], cache[..., ::2], [0], [0], regions, block_dim=1)
        with pytest.raises(InvalidRequest, match=r"^copy_blocks between regions needs block_bytes > 0"):
            block_segments(h, d, [0], [0], regions)
        with pytest.raises(
            InvalidRequest, match=r"^dst_ids must be a 1-D sequence of integer block ids, got shape \(2,\) of float64$"
        ):
            block_segments(pool, cache, [0.0, 1.0], [0, 1], regions, block_dim=1)
        # a block table held as a tensor works as well as a list
        _, _, table = block_segments(pool, cache, torch.tensor([2]), torch.tensor([3]), regions, block_dim=1)
        assert table.tolist() == [[2 * 2048, 3 * 2048, 2048], [16 * 2048 + 2 * 2048, 16 * 2048 + 3 * 2048, 2048]]


def test_region_dlpack_shares_memory(daemon: DaemonProcess) -> None:
    """torch.from_dlpack and np.from_dlpack of a host region view its memory without a copy."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h = c.alloc_host(4096)
        assert h.array is not None
        assert h.__dlpack_device__() == (1, 0)
        t, a = torch.from_dlpack(h), np.from_dlpack(h)
        assert t.data_ptr() == a.ctypes.data == h.array.ctypes.data and t.numel() == a.size == 4096
        t[10] = 77
        assert h.array[10] == a[10] == 77


def test_region_view_rejects_a_dtype_or_shape_that_does_not_fit(daemon: DaemonProcess) -> None:
    """A region whose size is no multiple of the dtype's, or a shape of the wrong size, is refused."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        h = c.alloc_host(4098)
        with pytest.raises(
            InvalidRequest,
            match=r"^<priod.Region \d+ host 4098 bytes> holds 4098 bytes, not a whole number of torch.float32 elements \(4 bytes each\)$",
        ):
            h.torch(torch.float32)
        with pytest.raises(
            InvalidRequest,
            match=r"^<priod.Region \d+ host 4098 bytes> as torch.bfloat16 has 2049 elements, which shape \(2, 1000\) does not fit",
        ):
            h.torch(torch.bfloat16, (2, 1000))


def test_register_device_refuses_a_cpu_tensor() -> None:
    """A CPU tensor is not device memory: the error says to use a host region's view instead."""
    with pytest.raises(
        TypeError,
        match=r"^this tensor is on cpu, not on a GPU: for host memory use alloc_host and its Region.torch\(\) view$",
    ):
        device_span(torch.zeros(4, dtype=torch.float8_e4m3fn))
