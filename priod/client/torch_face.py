"""PyTorch's face of priod: tensors that are views of regions, copies named by tensors, and
paged KV blocks moved by block ids.

    cache = kv_region.torch(torch.bfloat16, (2, num_blocks, block_size, heads, dim))  # a view
    pool = host_region.torch(torch.bfloat16, (2, host_blocks, block_size, heads, dim))
    c.copy_blocks(pool, cache, host_ids, device_ids, priority="bulk")    # offload: one copy_batch
    c.copy_blocks(cache, pool, device_ids, host_ids, priority="urgent")  # reload
    c.copy_tensor(cache[:, 7], pool[:, 3], priority="urgent")            # any contiguous view

A tensor names memory by where it lies: `where` finds the region a tensor's bytes are in and
the byte offset there, from ``data_ptr()``, ``element_size()`` and the strides, so every dtype
works alike (bf16, ``float8_e4m3fn``, int8: nothing is looked up in a dtype table). Views
(`region_tensor`, ``Region.torch()``) are zero-copy: host regions through their numpy array,
device regions through their CUDA IPC mapping.

torch is imported on first use, never by ``import priod``. It is held as ``Any``: mypy then
reads this module the same with torch installed or not (CI has no torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from priod.client.base import Region
from priod.errors import InvalidRequest

__all__ = ["BlockLayout", "Span", "block_segments", "block_table", "region_tensor", "tensor_copy", "where"]


class Span(NamedTuple):
    """Where a tensor's bytes lie: ``nbytes`` from ``offset`` in ``region``."""

    region: Region
    offset: int
    nbytes: int


def _is_tensor(obj: object) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _address_range(t: Any) -> tuple[int, int]:
    """``(first byte, one past the last)`` a tensor can touch, whatever its strides."""
    start = int(t.data_ptr())
    if t.numel() == 0:
        return start, start
    size = int(t.element_size())
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    return start, start + (int(last) + 1) * size


def _region_of(t: Any, regions: Iterable[Region]) -> tuple[Region, int]:
    """The region holding ``t`` (all of it) and ``t``'s byte offset there."""
    start, end = _address_range(t)
    on_gpu = bool(t.is_cuda)
    for region in regions:
        base = region.address(on_gpu)
        if base is not None and base <= start and end <= base + region.nbytes:
            return region, start - base
    where = "GPU" if on_gpu else "host"
    raise InvalidRequest(
        f"this {where} tensor (shape {tuple(t.shape)}, {t.dtype}, at 0x{start:x}) is not inside any region of this connection: "
        "make it a view of one (Region.torch(), or a register_device'd tensor), or copy it into one first"
    )


def where(tensor: Any, regions: Iterable[Region]) -> Span:
    """The region that ``tensor`` is a view of, its byte offset there and its size in bytes.

    ``regions``: where to look (a client looks in the regions its connection made). A host
    (CPU) tensor matches a region mapped in this process (``Region.array``: host regions, and
    device regions on the sim engine); a CUDA tensor matches a device region opened here
    (``Region.torch()``, ``Region.cuda()``) or a tensor given to ``register_device``.

    Raises:
        InvalidRequest: The tensor is not contiguous (a copy names one byte range), is empty,
            or does not lie wholly inside one of ``regions``.
    """
    if not _is_tensor(tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise InvalidRequest(
            f"the tensor is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}): a copy names one byte range; "
            "copy a contiguous view, or use copy_blocks for strided block layouts"
        )
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    if nbytes == 0:
        raise InvalidRequest("the tensor is empty: there is nothing to copy")
    region, offset = _region_of(tensor, regions)
    return Span(region, offset, nbytes)


def tensor_copy(dst: Any, src: Any, regions: Iterable[Region]) -> tuple[Span, Span]:
    """The spans of a ``dst <- src`` tensor copy; both must hold the same number of bytes
    (dtypes and shapes may differ: the copy moves bytes)."""
    regions = list(regions)
    d, s = where(dst, regions), where(src, regions)
    if d.nbytes != s.nbytes:
        raise InvalidRequest(
            f"the destination holds {d.nbytes} bytes ({tuple(dst.shape)}, {dst.dtype}) and the source {s.nbytes} "
            f"({tuple(src.shape)}, {src.dtype}): a copy moves bytes, so they must match"
        )
    return d, s


class BlockLayout(NamedTuple):
    """Where block ``i`` of a paged cache lies: ``nbytes`` at ``offset + plane + i * stride`` for
    every ``plane`` (K and V, layers: the dimensions before the block dimension)."""

    region: Region
    offset: int
    planes: npt.NDArray[np.int64]
    stride: int
    nbytes: int
    blocks: int
    """How many blocks there are (ids run from 0 to blocks - 1); -1 when unknown (a region)."""


def _layout(obj: Any, block_dim: int, block_bytes: int | None, regions: list[Region]) -> BlockLayout:
    if not _is_tensor(obj):
        # a Region: blocks of block_bytes end to end from its start
        if block_bytes is None or block_bytes <= 0:
            raise InvalidRequest(
                "copy_blocks between regions needs block_bytes > 0 (with tensors it comes from their shape)"
            )
        return BlockLayout(obj, 0, np.zeros(1, dtype=np.int64), block_bytes, block_bytes, -1)
    t = obj
    ndim = t.dim()
    if not -ndim <= block_dim < ndim:
        raise InvalidRequest(f"block_dim {block_dim} is out of range for a tensor of {ndim} dimensions")
    block_dim %= ndim
    size = int(t.element_size())
    inner = t[(0,) * (block_dim + 1)] if block_dim + 1 < ndim else None
    # A block (one index of block_dim, all later dimensions) must be one byte range.
    if inner is not None and not inner.is_contiguous():
        raise InvalidRequest(
            f"a block (dimensions after {block_dim} of shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous: "
            "each block must be one byte range"
        )
    nbytes = size * math.prod(int(n) for n in t.shape[block_dim + 1 :])
    if nbytes == 0 or t.numel() == 0:
        raise InvalidRequest("the tensor is empty: there is nothing to copy")
    region, offset = _region_of(t, regions)
    planes = np.zeros(1, dtype=np.int64)
    for n, s in zip(t.shape[:block_dim], t.stride()[:block_dim], strict=True):
        planes = (planes[:, None] + np.arange(int(n), dtype=np.int64)[None, :] * int(s) * size).reshape(-1)
    return BlockLayout(region, offset, planes, int(t.stride()[block_dim]) * size, nbytes, int(t.shape[block_dim]))


def _ids(ids: Any, name: str, count: int) -> npt.NDArray[np.int64]:
    if _is_tensor(ids):
        ids = ids.detach().cpu().numpy()  # a CUDA block table: copied back once, here
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidRequest(
            f"{name} must be a 1-D sequence of integer block ids, got shape {arr.shape} of {arr.dtype}"
        )
    arr = arr.astype(np.int64)
    if arr.size and (int(arr.min()) < 0 or (count >= 0 and int(arr.max()) >= count)):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        limit = f"0..{count - 1}" if count >= 0 else ">= 0"
        raise InvalidRequest(f"{name} holds block id {bad}, outside {limit}")
    return arr


def block_table(
    dst_ids: Any, src_ids: Any, block_bytes: int, *, dst_offset: int = 0, src_offset: int = 0
) -> npt.NDArray[np.int64]:
    """The (N, 3) segment table copying block ``src_ids[i]`` to block ``dst_ids[i]``, blocks of
    ``block_bytes`` laid end to end from ``dst_offset`` / ``src_offset`` (no torch needed)."""
    d, s = _ids(dst_ids, "dst_ids", -1), _ids(src_ids, "src_ids", -1)
    if d.shape != s.shape:
        raise InvalidRequest(f"dst_ids has {d.size} block ids and src_ids {s.size}: they pair up, so they must match")
    return np.stack([dst_offset + d * block_bytes, src_offset + s * block_bytes, np.full_like(d, block_bytes)], axis=1)


def block_segments(
    dst: Any,
    src: Any,
    dst_ids: Any,
    src_ids: Any,
    regions: Iterable[Region],
    *,
    block_dim: int = 0,
    block_bytes: int | None = None,
) -> tuple[Region, Region, npt.NDArray[np.int64]]:
    """The regions and (N, 3) segment table of a ``copy_batch`` that copies block ``src_ids[i]``
    of ``src`` to block ``dst_ids[i]`` of ``dst``.

    ``dst`` and ``src`` are each a tensor (a view of a region) or a `Region`. A tensor's
    ``block_dim`` indexes blocks: a block is everything after that dimension and must be
    contiguous; dimensions before it are planes (K and V, layers), each a segment of its own.
    So a vLLM-style cache ``(2, num_blocks, block_size, heads, dim)`` with ``block_dim=1``
    moves K and V of each block. A region holds blocks of ``block_bytes`` end to end.

    Segments go block by block (every plane of a block before the next block): a batch that is
    cancelled or fails reports ``segments_done``, and whole blocks are the first ones done.
    """
    regions = list(regions)
    d = _layout(dst, block_dim, block_bytes, regions)
    s = _layout(src, block_dim, block_bytes, regions)
    if d.nbytes != s.nbytes or len(d.planes) != len(s.planes):
        raise InvalidRequest(
            f"the destination's blocks are {len(d.planes)} x {d.nbytes} bytes and the source's {len(s.planes)} x {s.nbytes}: "
            "they must match (same block shape and dtype size, same dimensions before block_dim)"
        )
    di, si = _ids(dst_ids, "dst_ids", d.blocks), _ids(src_ids, "src_ids", s.blocks)
    if di.shape != si.shape:
        raise InvalidRequest(f"dst_ids has {di.size} block ids and src_ids {si.size}: they pair up, so they must match")
    if di.size == 0:
        raise InvalidRequest("no blocks to copy")
    dst_off = (d.offset + di[:, None] * d.stride + d.planes[None, :]).reshape(-1)
    src_off = (s.offset + si[:, None] * s.stride + s.planes[None, :]).reshape(-1)
    return d.region, s.region, np.stack([dst_off, src_off, np.full_like(dst_off, d.nbytes)], axis=1)


def region_tensor(region: Region, dtype: Any = None, shape: Iterable[int] | int | None = None) -> Any:
    """A tensor viewing ``region``'s memory (no copy): the same as ``region.torch(dtype, shape)``."""
    return region.torch(dtype, shape)
