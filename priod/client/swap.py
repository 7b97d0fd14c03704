"""A drop-in for the ``swap_blocks`` op serving engines call to move paged KV blocks between the
GPU and a host pool, through priod (vLLM's CPU offloading: ``swap_blocks(src, dst, block_mapping)``).

    swapper = BlockSwapper(priod.SyncClient(), priority="urgent")
    ops.swap_blocks = swapper.swap_blocks                      # the engine's op, replaced in one line
    pool = client.alloc_host(nbytes).torch(dtype, (host_blocks, *block_shape))  # the host pool

It takes plain tensors. A CUDA tensor is registered with the daemon on first use (its whole
storage, so that K and V, or every layer, of one allocation share one registration); a host
tensor must be a view of a priod host region (`Region.torch`): the daemon cannot reach other
host memory. What each tensor resolved to is cached by ``(data_ptr, nbytes, device)``, so a
later call costs one dictionary look-up per tensor, the segment table, and the copy.

Each call is one ``copy_batch`` (`SyncClient.copy_batch`) per pair of regions (one, normally),
and returns when every block has landed. It is **not stream-ordered**: it first orders itself
after the work already queued on the caller's current CUDA stream, then blocks the calling
thread until the copy is done, so the caller's later kernels may read the blocks at once.

torch is imported on first use, never by ``import priod``, and held as ``Any`` (mypy reads
this module the same with torch installed or not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from priod.client.base import BATCH_FRAME_SLACK, BatchOptions, BatchResult, Region, import_torch
from priod.errors import InvalidRequest
from priod.wire.batch import MAX_SEGMENTS, SEGMENT_BYTES

if TYPE_CHECKING:
    from priod.client.sync_client import SyncClient

__all__ = ["BlockSwapper", "Ordering"]

Ordering = Literal["auto", "sync", "event"]
"""How a swap waits for the caller's queued GPU work: ``sync`` synchronises the current stream
before sending the copy; ``event`` records an interprocess event on it and sends the copy with
``wait_event`` (the daemon starts it once the event completes, polling it); ``auto``: ``sync``
for ``urgent`` copies, which may then take the direct path (a copy with ``wait_event`` always
goes through the daemon, a round trip slower), ``event`` for every other class."""

_ORDERINGS = ("auto", "sync", "event")
_CACHE_LIMIT = 4096
"""Tensors remembered at most; past that the cache starts again (registrations stay)."""


def _is_tensor(obj: object) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _describe(t: Any) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


class _StorageBytes:
    """A CUDA tensor's whole storage as flat bytes (``__cuda_array_interface__``), for
    ``register_device``; holds the storage, so the caching allocator keeps it while registered."""

    def __init__(self, t: Any) -> None:
        self.storage = t.untyped_storage()
        self.pointer = int(self.storage.data_ptr())
        self.nbytes = int(self.storage.nbytes())

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.pointer, False), "strides": None, "version": 3}


def _span(t: Any) -> tuple[int, int]:
    """``(first byte, one past the last)`` that ``t`` can touch, whatever its strides."""
    start = int(t.data_ptr())
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    return start, start + (int(last) + 1) * int(t.element_size())


def _inside(region: Region, on_gpu: bool, start: int, end: int) -> bool:
    base = region.address(on_gpu)
    return base is not None and base <= start and end <= base + region.nbytes


class BlockSwapper:
    """vLLM's ``swap_blocks`` op through priod, for one `SyncClient` connection.

    ``priority``: the class of every copy (``urgent``: KV reloads a request waits for;
    ``bulk`` for offloads nobody waits on). ``ordering``: how a swap waits for the caller's
    queued GPU work (`Ordering`). ``timeout``: seconds a copy through the daemon may take
    before it is cancelled there and `priod.CopyTimeout` raised (None: no limit).

    Not thread-safe (neither is `SyncClient`): one swapper per thread, or a lock around it.
    """

    def __init__(
        self,
        client: SyncClient,
        *,
        priority: str = "urgent",
        ordering: Ordering = "auto",
        timeout: float | None = None,
    ) -> None:
        if ordering not in _ORDERINGS:
            raise InvalidRequest(f"ordering = {ordering!r} is not one of {', '.join(repr(o) for o in _ORDERINGS)}")
        self.client = client
        self.priority = priority
        self.ordering: Ordering = ordering
        self.timeout = timeout
        self.last_results: list[BatchResult] = []
        """The daemon's (or the direct path's) result of each batch of the last call."""
        self._cache: dict[tuple[int, int, str], Region] = {}
        self._registered: dict[tuple[int, int, str], Region] = {}
        """Regions this swapper registered, by their storage's (pointer, nbytes, device)."""
        self._events: dict[int, tuple[Any, bytes]] = {}
        """Per GPU ordinal: the interprocess event a ``wait_event`` copy waits for, and its handle."""

    # -- the engine's calls -------------------------------------------------------------------
    def swap_blocks(self, src: Any, dst: Any, block_mapping: Any) -> None:
        """Copy block ``block_mapping[i, 0]`` of ``src`` to block ``block_mapping[i, 1]`` of
        ``dst`` (a block is ``src[j]``: the first dimension indexes blocks), as vLLM's op does.

        ``src``, ``dst``: one a CUDA tensor (registered on first use), the other a view of a
        priod host region (``client.alloc_host(n).torch(dtype, shape)``); on the sim engine, views
        of its device and host regions. Blocks must be contiguous and of one size in bytes on
        both sides (dtypes may differ: the copy moves bytes). ``block_mapping``: an (N, 2)
        integer tensor (CPU or CUDA) or anything numpy reads as one; N = 0 does nothing.

        Not stream-ordered: the copy starts after the work already queued on the caller's
        current CUDA stream (`Ordering`), and the call returns once every block has landed, so
        the caller's later kernels may read (or overwrite) the blocks at once.

        Raises:
            InvalidRequest: A bad ``block_mapping`` (shape, dtype, a block id out of range, a
                destination block written twice), a host tensor that is not a view of a priod
                host region, blocks that are not contiguous or differ in size, two host tensors.
            PriodError: As `SyncClient.copy_batch` (``CopyTimeout`` after ``timeout``, ...).
        """
        self._swap([(src, dst)], block_mapping, 0)

    def swap_kv_blocks(self, src_kv: Any, dst_kv: Any, block_mapping: Any) -> None:
        """`swap_blocks` for K and V (or more caches) under one block mapping, as vLLM's
        attention backends call it per layer (``swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst)``).

        ``src_kv``, ``dst_kv``: either each a stacked cache tensor whose dimension 1 indexes
        blocks, ``(2, num_blocks, ...)`` (FlashAttention's layout: K is ``[0]``, V is ``[1]``;
        any dimension 0 works, layers too), or each a sequence of caches whose dimension 0 indexes
        blocks, ``(K, V)`` (or ``(K0, V0, K1, V1, ...)``), paired in order. Caches that lie in one
        region on each side (K and V views of one allocation, or of one host pool) go as one batch,
        K and V of a block next to each other; others as one batch per pair of regions.
        Otherwise as `swap_blocks`.
        """
        if _is_tensor(src_kv) and _is_tensor(dst_kv):
            for name, t in (("src_kv", src_kv), ("dst_kv", dst_kv)):
                if t.dim() < 2:
                    raise InvalidRequest(
                        f"{name} ({_describe(t)}) is not a stacked cache: pass (2, num_blocks, ...) tensors, "
                        "or a (K, V) pair of caches"
                    )
            self._swap([(src_kv, dst_kv)], block_mapping, 1)
            return
        if _is_tensor(src_kv) or _is_tensor(dst_kv):
            raise InvalidRequest(
                "src_kv and dst_kv must be of one form: both stacked cache tensors, or both sequences of caches"
            )
        if not isinstance(src_kv, Sequence) or not isinstance(dst_kv, Sequence):
            raise TypeError(
                f"src_kv and dst_kv must be tensors or sequences of tensors, got {type(src_kv).__name__} and {type(dst_kv).__name__}"
            )
        if len(src_kv) != len(dst_kv) or not src_kv:
            raise InvalidRequest(
                f"src_kv holds {len(src_kv)} caches and dst_kv {len(dst_kv)}: they pair up in order, so give as many (at least one)"
            )
        self._swap(list(zip(src_kv, dst_kv, strict=True)), block_mapping, 0)

    def release(self) -> None:
        """Free the registrations this swapper made (the daemon lets go of those GPU buffers, and
        PyTorch may reuse their memory once nothing else holds it), and forget every tensor."""
        registered, self._registered = list(self._registered.values()), {}
        self._cache.clear()
        for region in registered:
            if region.address(True) is not None:  # not freed meanwhile (or closed with the client)
                self.client.free(region)

    # -- the work -----------------------------------------------------------------------------
    def _swap(self, pairs: list[tuple[Any, Any]], block_mapping: Any, block_dim: int) -> None:
        for src, dst in pairs:
            for name, t in (("src", src), ("dst", dst)):
                if not _is_tensor(t):
                    raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
                if t.dim() <= block_dim:
                    raise InvalidRequest(f"{name} ({_describe(t)}) has no dimension {block_dim} to index blocks by")
        src_ids, dst_ids = _mapping(block_mapping, pairs, block_dim)
        self.last_results = []
        if src_ids.size == 0:
            return
        groups: dict[tuple[int, int], tuple[Region, Region, list[npt.NDArray[np.int64]]]] = {}
        devices: set[Any] = set()
        for src, dst in pairs:
            s, d = self._region(src, "src"), self._region(dst, "dst")
            if s.kind == "host" and d.kind == "host":
                raise InvalidRequest(
                    f"src ({_describe(src)}) and dst ({_describe(dst)}) are both host memory: swap_blocks moves "
                    "blocks between a GPU cache and a host pool (host to host: copy them with torch)"
                )
            devices.update(t.device for t in (src, dst) if t.is_cuda)
            from priod.client.torch_face import block_segments

            _, _, table = block_segments(dst, src, dst_ids, src_ids, [d, s], block_dim=block_dim)
            groups.setdefault((d.id, s.id), (d, s, []))[2].append(table)
        if len(devices) > 1:
            raise InvalidRequest(
                f"the caches are on {len(devices)} GPUs ({', '.join(sorted(str(x) for x in devices))}): "
                "a swap moves blocks between one GPU and the host (or within one GPU)"
            )
        options: BatchOptions = {"priority": self.priority}
        if devices:
            event = self._order_after_stream(next(iter(devices)))
            if event is not None:
                options["wait_event"] = event
        n = len(src_ids)
        limit = min(MAX_SEGMENTS, (self.client.server.max_frame_bytes - BATCH_FRAME_SLACK) // SEGMENT_BYTES)
        for d, s, tables in groups.values():
            # block by block: the planes (K, V, layers) of one block side by side, then the next block
            table = np.concatenate([t.reshape(n, -1) for t in tables], axis=1).reshape(-1, 3)
            per_block = len(table) // n
            step = max(per_block, limit // per_block * per_block)
            for i in range(0, len(table), step):
                self.last_results.append(
                    self.client.copy_batch(d, s, table[i : i + step], timeout=self.timeout, **options)
                )

    def _region(self, t: Any, name: str) -> Region:
        """The region ``t`` lies in: cached, found among the connection's regions, or (a CUDA
        tensor) registered now."""
        on_gpu = bool(t.is_cuda)
        start, end = _span(t)
        key = (start, end - start, str(t.device))
        region = self._cache.get(key)
        if region is not None and _inside(region, on_gpu, start, end):
            return region
        # The connection's own regions, as copy_blocks searches them: host pools, daemon device
        # allocations viewed with Region.torch(), tensors the caller registered.
        for region in self.client.regions:
            if _inside(region, on_gpu, start, end):
                return self._remember(key, region)
        if not on_gpu:
            raise InvalidRequest(
                f"{name} ({_describe(t)}, at 0x{start:x}) is host memory that is not a view of a priod host region of this "
                "connection; the daemon reaches only host memory it shares with this process (registering arbitrary "
                "pageable or pinned host memory is not possible): allocate the host pool with "
                "client.alloc_host(nbytes).torch(dtype, shape) and swap into views of it"
            )
        return self._remember(key, self._register(t))

    def _register(self, t: Any) -> Region:
        """Register ``t``'s whole storage (every view of it then lies in one region), or ``t``
        alone where the storage cannot be (the caller's errors are the tensor's own)."""
        whole = _StorageBytes(t)
        skey = (whole.pointer, whole.nbytes, str(t.device))
        region = self._registered.get(skey)
        if region is not None and region.address(True) is not None:
            return region
        try:
            region = self.client.register_device(whole)
        except Exception:
            # e.g. expandable segments: a buffer must lie within one page, which the storage may not
            region = self.client.register_device(t)
            skey = (int(t.data_ptr()), region.nbytes, str(t.device))
        self._registered[skey] = region
        return region

    def _remember(self, key: tuple[int, int, str], region: Region) -> Region:
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = region
        return region

    def _order_after_stream(self, device: Any) -> bytes | None:
        """Make the copy wait for the work queued on ``device``'s current stream: synchronise it
        (returns None), or record this GPU's interprocess event there (returns its handle)."""
        torch = import_torch()
        stream = torch.cuda.current_stream(device)
        ordering = self.ordering
        if ordering == "auto":
            ordering = "sync" if self.priority == "urgent" else "event"
        if ordering == "sync":
            stream.synchronize()
            return None
        ordinal = int(device.index if device.index is not None else torch.cuda.current_device())
        got = self._events.get(ordinal)
        if got is None:
            event = torch.cuda.Event(interprocess=True)  # disable timing: interprocess events cannot time
            event.record(stream)
            got = self._events[ordinal] = (event, bytes(event.ipc_handle()))
            return got[1]
        # One event per GPU is enough: a call returns only after its copy has started, so the
        # daemon has seen this record complete before the next call records it again.
        got[0].record(stream)
        return got[1]


def _mapping(
    block_mapping: Any, pairs: list[tuple[Any, Any]], block_dim: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``block_mapping``'s source and destination block ids, checked against every pair's
    block counts; InvalidRequest saying what is wrong."""
    if _is_tensor(block_mapping):
        block_mapping = block_mapping.detach().cpu().numpy()
    try:
        arr = np.asarray(block_mapping)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"block_mapping must be an (N, 2) integer array of (source block, destination block) rows: {exc}"
        ) from None
    if arr.ndim == 1 and arr.size == 0:
        arr = arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise InvalidRequest(
            f"block_mapping must be an (N, 2) array of (source block, destination block) rows, got shape {arr.shape}"
        )
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidRequest(f"block_mapping must hold integer block ids (int64), got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    src_ids, dst_ids = np.ascontiguousarray(arr[:, 0]), np.ascontiguousarray(arr[:, 1])
    if not arr.size:
        return src_ids, dst_ids
    for column, ids, side in (("0 (source)", src_ids, 0), ("1 (destination)", dst_ids, 1)):
        name = ("src", "dst")[side]
        t = min((p[side] for p in pairs), key=lambda x: int(x.shape[block_dim]))
        count = int(t.shape[block_dim])
        bad = np.flatnonzero((ids < 0) | (ids >= count))
        if bad.size:
            i = int(bad[0])
            raise InvalidRequest(
                f"block_mapping row {i} names block {int(ids[i])} in column {column}, outside {name}'s blocks 0..{count - 1} "
                f"({_describe(t)}, blocks along dimension {block_dim})"
            )
    order = np.argsort(dst_ids, kind="stable")
    same = np.flatnonzero(dst_ids[order][1:] == dst_ids[order][:-1])
    if same.size:
        a, b = int(order[same[0]]), int(order[same[0] + 1])
        raise InvalidRequest(
            f"block_mapping writes destination block {int(dst_ids[a])} twice (rows {a} and {b}): "
            "each destination block may be written once per call"
        )
    return src_ids, dst_ids
