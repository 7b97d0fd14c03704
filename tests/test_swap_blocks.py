"""priod.client.swap.BlockSwapper, vLLM's ``swap_blocks`` op through priod: on the sim engine (its
device regions are memfds, so ``Region.torch`` gives CPU tensors; skipped without torch) every
swap lands the bytes plain torch indexing gives (``ref[dst_idx] = src[src_idx]``) for bf16, fp16
and fp8, host pool to device cache and back, through the daemon and the direct path; the paged
K/V form goes as one batch; what it cannot do is refused saying what to do. The ``gpu`` tests do
the same with PyTorch's own CUDA tensors, and check that a swap waits for the caller's stream."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import priod
from priod.client.swap import BlockSwapper
from priod.errors import InvalidRequest
from priod.testing import DaemonProcess

torch: Any = pytest.importorskip("torch")

BLOCK = (4, 2, 8)  # block_size, kv heads, head dim: one block is BLOCK's elements
DEVICE_BLOCKS, HOST_BLOCKS = 12, 20
DTYPES = ["bfloat16", "float16", "float8_e4m3fn"]
MAPPING = [[3, 0], [7, 11], [0, 5], [19, 2]]
"""(source block, destination block) rows: host ids up to 19, device ids up to 11."""


def _random_bytes(t: Any, seed: int) -> None:
    """Fill ``t`` with random bytes (every bit pattern, NaNs too: a swap moves bytes)."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, tuple(raw.shape), dtype=np.uint8)))


def _bytes(t: Any) -> bytes:
    return bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def _pools(c: priod.SyncClient, dtype: Any, planes: tuple[int, ...] = ()) -> tuple[Any, Any]:
    """A "device" cache (a sim device region) and a host pool, random bytes in both."""
    size = torch.empty((), dtype=dtype).element_size()
    dev_shape, host_shape = (*planes, DEVICE_BLOCKS, *BLOCK), (*planes, HOST_BLOCKS, *BLOCK)
    dev = c.alloc_device(math.prod(dev_shape) * size).torch(dtype, dev_shape)
    host = c.alloc_host(math.prod(host_shape) * size).torch(dtype, host_shape)
    _random_bytes(dev, 1)
    _random_bytes(host, 2)
    return dev, host


def _reference(src: Any, dst: Any, mapping: Any, block_dim: int = 0) -> tuple[bytes, bytes]:
    """What the swap must leave in ``dst`` (plain torch indexing) and in ``src`` (unchanged)."""
    m = torch.as_tensor(mapping, dtype=torch.int64)
    ref = dst.clone()
    if block_dim == 0:
        ref[m[:, 1]] = src[m[:, 0]]
    else:
        ref[:, m[:, 1]] = src[:, m[:, 0]]
    return _bytes(ref), _bytes(src)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
@pytest.mark.parametrize(("priority", "copy_path"), [("urgent", "daemon"), ("bulk", "auto"), ("urgent", "auto")])
def test_swap_blocks_lands_what_torch_indexing_gives(
    daemon: DaemonProcess, dtype: str, direction: str, priority: str, copy_path: str
) -> None:
    """Each mapped block lands whole at its destination; every other byte of both sides stays."""
    dt = getattr(torch, dtype)
    with priod.SyncClient(daemon.socket_path, copy_path=copy_path) as c:  # type: ignore[arg-type]
        dev, host = _pools(c, dt)
        mapping = MAPPING if direction == "host_to_device" else [[d, s] for s, d in MAPPING]
        src, dst = (host, dev) if direction == "host_to_device" else (dev, host)
        want_dst, want_src = _reference(src, dst, mapping)
        swapper = BlockSwapper(c, priority=priority)
        swapper.swap_blocks(src, dst, torch.tensor(mapping, dtype=torch.int64))
        assert _bytes(dst) == want_dst
        assert _bytes(src) == want_src
        [result] = swapper.last_results
        assert result.segments == len(mapping)
        assert result.nbytes == len(mapping) * math.prod(BLOCK) * dst.element_size()
        # urgent copies take the direct path by themselves (nothing here sends a wait_event on the sim)
        assert (result.path == "direct") == (copy_path == "auto" and priority == "urgent")


def test_block_mapping_forms_and_the_registration_cache(daemon: DaemonProcess) -> None:
    """A mapping may be a list, a numpy array or an int32 tensor; N = 0 does nothing; each tensor
    is resolved once and found by (data_ptr, nbytes, device) after, including a fresh view."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev, host = _pools(c, torch.bfloat16)
        swapper = BlockSwapper(c, priority="bulk")
        for mapping in (MAPPING, np.array(MAPPING, dtype=np.int32), torch.tensor(MAPPING, dtype=torch.int32)):
            want, _ = _reference(host, dev, mapping)
            swapper.swap_blocks(host, dev, mapping)
            assert _bytes(dev) == want
        assert len(swapper._cache) == 2
        swapper.swap_blocks(host[:], dev.view(DEVICE_BLOCKS, -1), [[1, 1]])  # new views, same (ptr, nbytes)
        assert len(swapper._cache) == 2
        before = _bytes(dev)
        empties: list[Any] = [[], np.zeros((0, 2), dtype=np.int64), torch.empty((0, 2), dtype=torch.int64)]
        for empty in empties:
            swapper.swap_blocks(host, dev, empty)
            assert swapper.last_results == []
        assert _bytes(dev) == before
        # a slice of the pool (blocks 10.. of it) is found in the same region, at its offset
        want, _ = _reference(host[10:], dev, [[0, 4], [9, 6]])
        swapper.swap_blocks(host[10:], dev, [[0, 4], [9, 6]])
        assert _bytes(dev) == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_kv_blocks_stacked_and_pairs(daemon: DaemonProcess, dtype: str) -> None:
    """A stacked (2, num_blocks, ...) cache (blocks along dimension 1) and a (K, V) pair of its
    views go as one batch, K and V of each block; K and V in separate regions go as two."""
    dt = getattr(torch, dtype)
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev, host = _pools(c, dt, planes=(2,))
        swapper = BlockSwapper(c, priority="bulk")
        want_dev, want_host = _reference(host, dev, MAPPING, block_dim=1)
        swapper.swap_kv_blocks(host, dev, MAPPING)
        assert (_bytes(dev), _bytes(host)) == (want_dev, want_host)
        [result] = swapper.last_results
        assert result.segments == 2 * len(MAPPING)

        back = [[d, s] for s, d in MAPPING[:2]]
        want_host, want_dev = _reference(dev, host, back, block_dim=1)
        swapper.swap_kv_blocks((dev[0], dev[1]), [host[0], host[1]], torch.tensor(back))
        assert (_bytes(dev), _bytes(host)) == (want_dev, want_host)
        [result] = swapper.last_results
        assert result.segments == 4

        # K and V caches that are separate regions (on both sides): one batch per pair of regions
        k_dev, k_host = _pools(c, dt)
        want_k, _ = _reference(k_host, k_dev, MAPPING)
        want_v, _ = _reference(host[1], dev[1], MAPPING)
        swapper.swap_kv_blocks([k_host, host[1]], [k_dev, dev[1]], MAPPING)
        assert (_bytes(k_dev), _bytes(dev[1])) == (want_k, want_v)
        assert [r.segments for r in swapper.last_results] == [len(MAPPING)] * 2


def test_a_large_swap_goes_as_several_batches(daemon: DaemonProcess) -> None:
    """More segments than one batch may hold (32,768) go as several, each of whole blocks."""
    blocks, block_bytes = 20_000, 16
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev = c.alloc_device(2 * blocks * block_bytes).torch(torch.float16, (2, blocks, block_bytes // 2))
        host = c.alloc_host(2 * blocks * block_bytes).torch(torch.float16, (2, blocks, block_bytes // 2))
        _random_bytes(dev, 3)
        _random_bytes(host, 4)
        mapping = np.stack([np.arange(blocks), np.random.default_rng(5).permutation(blocks)], axis=1)
        want, _ = _reference(host, dev, mapping, block_dim=1)
        swapper = BlockSwapper(c, priority="bulk")
        swapper.swap_kv_blocks(host, dev, mapping)
        assert _bytes(dev) == want
        assert len(swapper.last_results) == 2
        assert sum(r.segments for r in swapper.last_results) == 2 * blocks
        assert all(r.segments % 2 == 0 for r in swapper.last_results)


def test_bad_block_mappings_are_refused(daemon: DaemonProcess) -> None:
    """Shape, dtype, ids out of range and a destination written twice: InvalidRequest naming
    the row, and nothing copied."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev, host = _pools(c, torch.bfloat16)
        before = _bytes(dev)
        swapper = BlockSwapper(c)
        cases = [
            ([[1, 2, 3]], r"^block_mapping must be an \(N, 2\) array .*got shape \(1, 3\)"),
            ([1, 2], r"^block_mapping must be an \(N, 2\) array .*got shape \(2,\)"),
            (np.zeros((2, 2, 1), dtype=np.int64), r"got shape \(2, 2, 1\)"),
            (np.array([[1.0, 2.0]]), r"^block_mapping must hold integer block ids \(int64\), got float64"),
            (torch.tensor([[True, False]]), r"must hold integer block ids \(int64\), got bool"),
            (
                [[0, 1], [20, 2]],
                r"^block_mapping row 1 names block 20 in column 0 \(source\), outside src's blocks 0\.\.19",
            ),
            (
                [[0, -1]],
                r"^block_mapping row 0 names block -1 in column 1 \(destination\), outside dst's blocks 0\.\.11",
            ),
            ([[0, 12]], r"block 12 in column 1 \(destination\), outside dst's blocks 0\.\.11 \(shape \(12, 4, 2, 8\)"),
            ([[0, 3], [1, 4], [2, 3]], r"^block_mapping writes destination block 3 twice \(rows 0 and 2\)"),
            ([["a", "b"]], r"^block_mapping must hold integer block ids"),
        ]
        for mapping, match in cases:
            with pytest.raises(InvalidRequest, match=match):
                swapper.swap_blocks(host, dev, mapping)
        assert _bytes(dev) == before


def test_tensors_it_cannot_swap_are_refused(daemon: DaemonProcess) -> None:
    """Host memory outside priod's regions, host to host, blocks of different sizes, the wrong
    types, and mixed K/V forms: each refused saying what to do."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev, host = _pools(c, torch.bfloat16)
        swapper = BlockSwapper(c)
        plain = torch.zeros((HOST_BLOCKS, *BLOCK), dtype=torch.bfloat16)  # pageable, not priod's
        with pytest.raises(
            InvalidRequest,
            match=r"^src \(shape \(20, 4, 2, 8\), torch.bfloat16, on cpu, at 0x[0-9a-f]+\) is host memory that is not a view of a priod host region",
        ) as info:
            swapper.swap_blocks(plain, dev, MAPPING)
        assert "client.alloc_host(nbytes).torch(dtype, shape)" in str(info.value)
        with pytest.raises(InvalidRequest, match=r"^dst .* is host memory that is not a view of a priod host region"):
            swapper.swap_blocks(dev, plain, [[0, 1]])
        other = c.alloc_host(host.numel() * 2).torch(torch.bfloat16, host.shape)
        with pytest.raises(
            InvalidRequest, match=r"are both host memory: swap_blocks moves blocks between a GPU cache and a host pool"
        ):
            swapper.swap_blocks(host, other, [[0, 1]])
        with pytest.raises(
            InvalidRequest, match=r"^the destination's blocks are 1 x 128 bytes and the source's 1 x 64"
        ):
            swapper.swap_blocks(host.view(2 * HOST_BLOCKS, -1), dev, [[0, 1]])  # 64-byte blocks into 128-byte ones
        with pytest.raises(
            InvalidRequest, match=r"^a block \(dimensions after 0 of shape \(20, 4, 8, 2\).* is not contiguous"
        ):
            swapper.swap_blocks(host.transpose(2, 3), dev, [[0, 1]])
        with pytest.raises(TypeError, match=r"^src must be a torch.Tensor, got ndarray"):
            swapper.swap_blocks(np.zeros(4), dev, [[0, 1]])
        with pytest.raises(InvalidRequest, match=r"has no dimension 0 to index blocks by"):
            swapper.swap_blocks(torch.zeros(()), dev, [[0, 1]])
        with pytest.raises(InvalidRequest, match=r"^src_kv \(.*\) is not a stacked cache"):
            swapper.swap_kv_blocks(host[0, 0, 0], dev[0, 0, 0], [[0, 1]])
        with pytest.raises(InvalidRequest, match=r"^src_kv and dst_kv must be of one form"):
            swapper.swap_kv_blocks(host, [dev], [[0, 1]])
        with pytest.raises(InvalidRequest, match=r"^src_kv holds 2 caches and dst_kv 1"):
            swapper.swap_kv_blocks([host, host], [dev], [[0, 1]])
        with pytest.raises(InvalidRequest, match=r"^ordering = 'later' is not one of 'auto', 'sync', 'event'"):
            BlockSwapper(c, ordering="later")  # type: ignore[arg-type]


def test_a_freed_pool_is_not_used_from_the_cache(daemon: DaemonProcess) -> None:
    """A cached region that was freed is looked up again, not named: a swap into a freed pool
    is refused rather than sent."""
    with priod.SyncClient(daemon.socket_path, copy_path="daemon") as c:
        dev, _ = _pools(c, torch.bfloat16)
        size = HOST_BLOCKS * math.prod(BLOCK) * 2
        region = c.alloc_host(size)
        pool = region.torch(torch.bfloat16, (HOST_BLOCKS, *BLOCK))
        swapper = BlockSwapper(c, priority="bulk")
        swapper.swap_blocks(dev, pool, [[0, 1]])
        keep = pool.clone()
        del pool
        c.free(region)
        with pytest.raises(InvalidRequest, match=r"is host memory that is not a view of a priod host region"):
            swapper.swap_blocks(dev, keep, [[0, 1]])


# -- on a GPU: PyTorch's own CUDA tensors ---------------------------------------------------------


def _apply(before: bytes, blocks: int, src: Any, mapping: list[list[int]]) -> bytes:
    """``before`` (a cache's bytes, ``blocks`` blocks) with block ``m[1]`` replaced by ``src``'s block ``m[0]``."""
    ref = torch.frombuffer(bytearray(before), dtype=torch.uint8).view(blocks, -1)
    got = torch.frombuffer(bytearray(_bytes(src)), dtype=torch.uint8).view(src.shape[0], -1)
    m = torch.tensor(mapping)
    ref[m[:, 1]] = got[m[:, 0]]
    return bytes(ref.numpy().tobytes())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("priority", "ordering"), [("urgent", "auto"), ("bulk", "auto"), ("urgent", "event")])
def test_gpu_swap_blocks_with_torch_tensors(
    gpu_daemon: DaemonProcess, dtype: str, priority: str, ordering: str
) -> None:
    """A CUDA cache from torch.empty (registered on first use) and a host pool from alloc_host:
    both directions land what torch indexing gives, and each swap waits for the work queued on
    the caller's current stream (a ~10 ms kernel, then a write the swap must come after)."""
    dt = getattr(torch, dtype)
    shape = (64, 16, 8, 128)  # 32 KiB blocks in bf16
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        cache = torch.empty(shape, dtype=dt, device="cuda")
        cache.view(torch.uint8).random_(0, 256)
        pool = c.alloc_host(128 * math.prod(shape[1:]) * cache.element_size()).torch(dt, (128, *shape[1:]))
        _random_bytes(pool, 6)
        swapper = BlockSwapper(c, priority=priority, ordering=ordering)  # type: ignore[arg-type]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # the caller's current stream, not the default one
            for rnd in range(3):
                # offload: the block's new bytes are written by queued work the swap must wait for
                out = [[5 + rnd, 100], [63, 7 + rnd], [0, 127]]
                stream.synchronize()
                host_before = _bytes(pool)
                torch.cuda._sleep(20_000_000)
                cache.view(torch.uint8)[5 + rnd].fill_(rnd + 1)
                swapper.swap_blocks(cache, pool, torch.tensor(out))
                assert _bytes(pool) == _apply(host_before, 128, cache, out), (rnd, "offload")
                assert set(_bytes(pool[100])) == {rnd + 1}

                # reload: a queued write to a destination block must not land after the swap
                back = [[100, 1], [127, 62], [3, 30 + rnd]]
                stream.synchronize()
                dev_before = _bytes(cache)
                torch.cuda._sleep(20_000_000)
                cache.view(torch.uint8)[62].zero_()
                swapper.swap_blocks(pool, cache, np.array(back))
                assert _bytes(cache) == _apply(dev_before, 64, pool, back), (rnd, "reload")
        assert len(swapper._registered) == 1
        assert len(swapper.last_results) == 1 and swapper.last_results[0].segments == 3
        swapper.release()
        assert not swapper._registered


@pytest.mark.gpu
def test_gpu_swap_kv_blocks_one_registration(gpu_daemon: DaemonProcess) -> None:
    """K and V views of one CUDA allocation (vLLM's per-layer (2, num_blocks, ...) cache) share
    one registration (its storage) and go as one batch, stacked or as a (K, V) pair; a CUDA
    block mapping works too."""
    shape = (2, 32, 16, 8, 128)
    with priod.SyncClient(gpu_daemon.socket_path) as c:
        kv = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        kv.view(torch.uint8).random_(0, 256)
        pool = c.alloc_host(kv.numel() * 2 * 2).torch(torch.bfloat16, (2, 64, *shape[2:]))
        _random_bytes(pool, 7)
        torch.cuda.synchronize()
        for priority in ("bulk", "urgent"):
            swapper = BlockSwapper(c, priority=priority)
            mapping = [[1, 60], [31, 0], [7, 33]]
            want, _ = _reference(kv.cpu(), pool, mapping, block_dim=1)
            swapper.swap_kv_blocks(kv, pool, mapping)
            assert _bytes(pool) == want, priority
            [result] = swapper.last_results
            assert result.segments == 6
            back = [[60, 2], [0, 3]]
            want, _ = _reference(pool, kv.cpu(), back, block_dim=1)
            swapper.swap_kv_blocks((pool[0], pool[1]), (kv[0], kv[1]), torch.tensor(back, device="cuda"))
            assert _bytes(kv) == want, priority
            assert len(swapper.last_results) == 1 and len(swapper._registered) == 1
            swapper.release()
