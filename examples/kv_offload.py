"""Offload and reload the paged KV cache of a toy attention layer through priod.

    python examples/kv_offload.py                      # starts its own daemon (cuda if a GPU is here, else sim)
    python examples/kv_offload.py --socket /run/priod/priod.sock --dtype float8_e4m3fn
    python examples/kv_offload.py --backend cuda --register   # the cache is PyTorch's own tensor
    python examples/kv_offload.py --backend cuda --direct     # the urgent reload by this process's own copy

A decode step of one attention layer reads a sequence's K and V through its block table, as
paged attention does. The example computes that step, offloads the sequence's blocks to a host
pool as one bulk ``copy_batch`` (``copy_blocks``), lets other work overwrite those device
blocks, then reloads them urgently into other free blocks while a bulk offload of another
sequence is still running, and checks that the step's output is bitwise the same as before.

The KV cache is a device region priod allocated, viewed with ``Region.torch()`` (CUDA tensors
on the cuda engine; CPU tensors on the sim engine, whose "device" memory is host memory), or
with ``--register`` a tensor from PyTorch's caching allocator given to ``register_device``.
With ``--direct`` the urgent reload is this process's own copy (``priod.client.direct``: the copy
kernel over the host pool, pinned here with ``pin_host``), which the daemon makes room for by
holding B's bulk offload back meanwhile; the pool stays the daemon's region for the offloads.
Exit status 0 when every check passed; the last line says ``ok``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

# Run from a checkout, this checkout's priod goes first, for the daemon it starts too (as in
# scripts/); installed, it is found anyway.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

import priod
from priod.client.torch_face import block_segments

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 64, 16


def _attention(cache: Any, q: Any, table: list[int], seq_len: int, dtype: Any) -> Any:
    """One decode step of paged attention: gather the sequence's blocks by its block table,
    softmax(q K^T / sqrt(d)) V in float32. Blocks are gathered as bytes and only then seen as
    ``dtype``, since index kernels do not cover every dtype (fp8)."""
    import torch

    idx = torch.tensor(table, device=cache.device)
    raw = cache.view(torch.uint8).index_select(1, idx)  # (2, blocks, block_size, heads, dim * size)
    kv = raw.view(dtype).float().reshape(2, -1, HEADS, HEAD_DIM)[:, :seq_len]
    scores = torch.einsum("hd,thd->ht", q, kv[0]) / math.sqrt(HEAD_DIM)
    return torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), kv[1])


def _fill(cache: Any, ids: list[int], dtype: Any, gen: Any) -> None:
    """Write random K and V (normal values, no NaNs) into blocks ``ids``, through a byte view."""
    import torch

    values = torch.randn((2, len(ids), *cache.shape[2:]), generator=gen).to(dtype).to(cache.device)
    u8 = cache.view(torch.uint8)
    u8[:, torch.tensor(ids, device=cache.device)] = values.view(torch.uint8)


def _sync(t: Any) -> None:
    """Wait for the kernels that wrote ``t``: priod's copies read memory, not streams (yet)."""
    import torch

    if t.is_cuda:
        torch.cuda.synchronize(t.device)


@contextlib.contextmanager
def _daemon(args: argparse.Namespace) -> Iterator[str]:
    if args.socket:
        yield args.socket
        return
    from priod.testing import daemon_process

    backend = args.backend
    if backend == "auto":
        from priod.common.cuda.driver import gpu_available

        backend = "cuda" if gpu_available() else "sim"
    print(f"starting a {backend} daemon for this run")
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend=backend, start_timeout=120) as d:
        yield d.socket_path


def run(args: argparse.Namespace) -> None:
    import torch

    dtype = getattr(torch, args.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    shape = (2, args.device_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    pool_shape = (2, args.host_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    block_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * size  # K and V of one block
    gen = torch.Generator().manual_seed(0)
    with _daemon(args) as path, priod.SyncClient(path, name="kv_offload") as c, contextlib.ExitStack() as stack:
        engine = c.server.backend
        for flag, wanted in (("--register", args.register), ("--direct", args.direct)):
            if wanted and engine != "cuda":
                raise SystemExit(
                    f"{flag} needs the cuda engine (this daemon runs {engine}): its device memory is a GPU's"
                )
        if args.register:
            cache = torch.empty(shape, dtype=dtype, device="cuda")
            cache_region = c.register_device(cache)  # PyTorch's caching allocator: an offset into one of its segments
        else:
            cache_region = c.alloc_device(math.prod(shape) * size)
            cache = cache_region.torch(dtype, shape)
        pool_region = c.alloc_host(math.prod(pool_shape) * size)
        pool = pool_region.torch(dtype, pool_shape)

        def direct_table(dst_ids: list[int], src_ids: list[int]) -> Any:
            """The byte table of a direct copy of pool slots into cache blocks: the one
            ``copy_blocks`` sends (K then V of each block), its offsets relative to the regions,
            which here are the tensors' own (each tensor starts at its region)."""
            return block_segments(cache, pool, dst_ids, src_ids, [cache_region, pool_region], block_dim=1)[2]

        direct = None
        if args.direct:
            from priod.client.direct import DirectCopies, pin_host

            stack.enter_context(pin_host(pool))  # unpinned last: after the copies, before the region goes
            copies = DirectCopies(c.hold_page())
            stack.callback(copies.close)
            direct = copies.pair(cache, pool)
        print(
            f"{engine} engine, {args.dtype}: KV cache {tuple(cache.shape)} on {cache.device}, host pool {args.host_blocks} blocks, {block_bytes} bytes a block"
        )

        # sequence A: scattered blocks, as a block allocator leaves them
        n = args.blocks
        table_a = list(range(1, 2 * n, 2))
        slots_a, new_a = list(range(n)), list(range(2 * n, 3 * n))[::-1]
        if direct is not None:
            # The first direct batch loads the copy kernel into this process (milliseconds): one
            # block here, off the measured path, into a block the reload overwrites anyway.
            direct.copy_batch(direct_table(new_a[:1], slots_a[:1]))
        seq_len = n * BLOCK_SIZE - 5
        _fill(cache, table_a, dtype, gen)
        q = torch.randn((HEADS, HEAD_DIM), generator=gen).to(cache.device)
        before = _attention(cache, q, table_a, seq_len, dtype)
        kv_a = cache.view(torch.uint8)[:, table_a].clone()
        _sync(cache)

        t0 = time.perf_counter()
        r = c.copy_blocks(pool, cache, slots_a, table_a, block_dim=1, priority="bulk")
        print(
            f"offload A: {n} blocks as one copy_batch ({r.segments} segments, {r.nbytes} bytes) in {(time.perf_counter() - t0) * 1e3:.2f} ms"
        )

        # other sequences reuse A's device blocks meanwhile
        _fill(cache, table_a, dtype, gen)
        if torch.equal(_attention(cache, q, table_a, seq_len, dtype), before):
            raise SystemExit("overwriting A's blocks did not change the output: the check below would prove nothing")

        # sequence B goes out in bulk while A comes back urgently into other free blocks
        table_b = list(range(0, 2 * n, 2))
        _fill(cache, table_b, dtype, gen)
        _sync(cache)
        slots_b = list(range(n, 2 * n))
        bulk = c.start_copy_blocks(pool, cache, slots_b, table_b, block_dim=1, priority="bulk")
        if direct is not None:
            table = direct_table(new_a, slots_a)
            t0 = time.perf_counter()
            direct.copy_batch(table)  # returns once the blocks have landed
            urgent_ms = (time.perf_counter() - t0) * 1e3
            b = bulk.wait()
            print(
                f"reload A: {len(table)} segments urgent, direct, in {urgent_ms:.2f} ms beside B's bulk offload of {b.nbytes} bytes"
            )
        else:
            t0 = time.perf_counter()
            r = c.copy_blocks(cache, pool, new_a, slots_a, block_dim=1, priority="urgent")
            urgent_ms = (time.perf_counter() - t0) * 1e3
            b = bulk.wait()
            print(
                f"reload A: {r.segments} segments urgent in {urgent_ms:.2f} ms (daemon: queued {r.queued_us:.0f} us, "
                f"total {r.total_us:.0f} us) beside B's bulk offload of {b.nbytes} bytes"
            )

        u8, pool_u8 = cache.view(torch.uint8), pool.view(torch.uint8)
        if not torch.equal(u8[:, new_a], kv_a):
            raise SystemExit("A's blocks after the reload are not the bytes that were offloaded")
        after = _attention(cache, q, new_a, seq_len, dtype)
        if not torch.equal(after, before):
            raise SystemExit(
                f"attention output after the reload differs: max |diff| {float((after - before).abs().max())}"
            )
        for slot, blk in zip(slots_b, table_b, strict=True):
            if not torch.equal(pool_u8[:, slot].cpu(), u8[:, blk].cpu()):
                raise SystemExit(f"B's block {blk} did not land in host slot {slot}")
        print("attention output after offload and reload equals the output before: ok")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--socket", help="a running daemon's socket (default: start one for this run)")
    p.add_argument(
        "--backend",
        choices=["auto", "sim", "cuda"],
        default="auto",
        help="the engine of the daemon started for this run",
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="torch dtype of the cache: bfloat16, float16, float8_e4m3fn, ..."
    )
    p.add_argument("--blocks", type=int, default=32, help="blocks of sequence A (and of B)")
    p.add_argument("--device-blocks", type=int, default=128)
    p.add_argument("--host-blocks", type=int, default=96)
    p.add_argument(
        "--register", action="store_true", help="the cache is torch.empty(device='cuda'), given to register_device"
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="reload A by this process's own copy (priod.client.direct), the pool pinned here",
    )
    args = p.parse_args(argv)
    if 3 * args.blocks > args.device_blocks or 2 * args.blocks > args.host_blocks:
        p.error("need --device-blocks >= 3 * --blocks and --host-blocks >= 2 * --blocks")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
