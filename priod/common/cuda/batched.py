"""DMA for a batch's chunk: one ``cuMemcpyBatchAsync`` where the driver has it, else a loop.

A chunk of a batch (priod/wire/batch.py) is many (dst, src, nbytes) copies that may run in any
order. ``cuMemcpyBatchAsync`` (CUDA 12.8) enqueues all of them in one call, which costs the
daemon one driver call per chunk instead of one per segment and lets the driver pack the
descriptors. It is called through ctypes with the chunk's numpy arrays as its C arrays: the
bindings' own wrapper takes Python lists of ``CUdeviceptr`` objects, and building them costs
about 0.3 us of the 1.2 us per segment the call takes that way on the H200 (0.6-0.9 us through
ctypes, the driver's own work; a bulk batch of 64 KiB blocks moves one in 1.2 us, so with the
wrapper the daemon's loop, pushing descriptors, holds it to 0.67 of the link). ctypes also lets go of the
GIL for the call. It needs:

- cuda-bindings >= 12.8 (``CUmemcpyAttributes`` and ``cuGetProcAddress``, which gives the
  entry point of the 12.8 ABI, the one with a ``failIdx`` argument, whatever the driver's
  version), and
- a driver that supports CUDA 12.8 or newer (R570 or newer), as ``cuDriverGetVersion`` reports.

Where either is missing, or the driver refuses the first batched call (a platform without
it), each segment is one ``cudaMemcpyAsync`` on the same stream: the same bytes in the same
FIFO, at a few microseconds of Python per segment. `BatchedDma.error` says which path runs
and why, and `priod status` shows it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from priod.common.cuda.driver import bindings, check, error
from priod.errors import CudaError

__all__ = ["BATCH_MIN_DRIVER", "BULK_CALL_SEGMENTS", "CALL_SEGMENTS", "GATED_CALL_SEGMENTS", "BatchedDma"]

BATCH_MIN_DRIVER = 12080
"""``cuDriverGetVersion`` of the first driver with ``cuMemcpyBatchAsync`` (CUDA 12.8)."""

CALL_SEGMENTS = 64
"""Most segments one batched call takes; a longer chunk is several calls. No byte of a call
moves before the call returns, and the driver takes 0.6-1.1 us a segment plus ~15 us a call
(H200 probe): one call of 256 scattered 64 KiB blocks took
553 us p50 where one contiguous copy of the same 16 MiB took 320, eight calls of 32 took 399, 32
calls of 8 took 748, and calls of 16, 32, 64, 128 458 (each waited for the next to be enqueued).
At 64 a call takes about as long to enqueue as its 64 KiB blocks take to copy, so the engine
copies one call's blocks while the next is enqueued."""

BULK_CALL_SEGMENTS = 256
"""Most segments one batched call of a *bulk* chunk takes (the pusher's thread makes them). A
bulk chunk's latency does not matter, its rate does, and each call ends with a wait for the GIL
(the event loop may hold it), so bulk calls are longer. A/B on the H200, bulk batches of 64 KiB
blocks, GB/s, two rounds: calls of 64 / 256 ran at
35.7, 31.0 / 42.3, 36.5 with a 1 ms in-flight bound; 44.1, 48.9 / 46.8, 54.6 with 4 ms."""

GATED_CALL_SEGMENTS = 128
"""Most segments one batched call of a *gated* bulk chunk takes (a chunk the lane's gate can
stop, pump.py), each call behind a wait on the gate of its own. The gate stops a chunk only where
the GPU meets its wait, and a chunk's calls reach the GPU as the pusher's thread makes them, at
the driver's ~1 us a segment: a chunk of 64 KiB blocks whose one wait passed on an idle stream
went on copying into a direct urgent copy's hold as its calls came, up to the whole chunk. With
a wait before each call, a hold that closes the gate stops the chunk at its next call, so an
urgent copy waits for one call's blocks (128 x 64 KiB: ~150 us on the link) at most; a wait costs
the link ~1.5 us (device.py, `Gates`), and a call the driver ~15 us beside its segments. H200,
direct 64 KiB copies beside bulk batches of 4,096 x 64 KiB: p99 122-176 us with a wait per call,
162-318 with one per chunk, the bulk rate the same (see docs/design.md, Defaults)."""

U64 = npt.NDArray[np.uint64]


class BatchedDma:
    """Enqueues a batch's chunk on a stream: one batched call, or one copy per segment."""

    def __init__(self, call_segments: int = CALL_SEGMENTS) -> None:
        rt, drv = bindings()
        self.call_segments = call_segments
        self._memcpy = rt.cudaMemcpyAsync
        self._result = drv.CUresult
        self._batch: Any = None
        """``cuMemcpyBatchAsync`` of the 12.8 ABI, as a ctypes function; None: per segment."""
        self._proven = False
        """A batched call has succeeded: from then on its errors are the copy's, not the API's."""
        self.error: str | None = None
        """Why chunks go segment by segment (None: cuMemcpyBatchAsync is used)."""
        if not hasattr(drv, "CUmemcpyAttributes"):
            self.error = "cuda-bindings has no cuMemcpyBatchAsync (it needs cuda-bindings >= 12.8): one cudaMemcpyAsync per segment"
            return
        version = int(check(drv.cuDriverGetVersion()))
        if version < BATCH_MIN_DRIVER:
            self.error = f"the driver supports CUDA {version // 1000}.{version % 1000 // 10}; cuMemcpyBatchAsync needs 12.8 (driver R570 or newer): one cudaMemcpyAsync per segment"
            return
        attrs = drv.CUmemcpyAttributes()
        # Stream order: a chunk's sources may have been written by the chunk ahead of it.
        attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs = attrs  # kept alive: the call reads it through its address
        self._attrs_ptr = int(attrs.getPtr())
        self._attrs_index = (ctypes.c_size_t * 1)(0)
        self._fail_index = ctypes.c_size_t(0)
        found = check(drv.cuGetProcAddress(b"cuMemcpyBatchAsync", BATCH_MIN_DRIVER, 0))
        address = int(found[0] if isinstance(found, tuple) else found)  # (pfn, status) from 12.5 on
        if not address:
            self.error = "the driver has no cuMemcpyBatchAsync entry point: one cudaMemcpyAsync per segment"
            return
        # CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
        #     size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
        #     size_t *failIdx, CUstream hStream), as CUDA 12.8 declares it.
        p, n = ctypes.c_void_p, ctypes.c_size_t
        self._batch = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, n, p, p, n, p, p)(address)

    def copy(
        self,
        dst: int,
        src: int,
        dst_offsets: U64,
        src_offsets: U64,
        sizes: U64,
        kind: Any,
        stream: Any,
        *,
        each_call: Callable[[], None] | None = None,
        call_segments: int = 0,
    ) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src + src_offsets[i]`` to ``dst + dst_offsets[i]``
        for each i on ``stream`` (``kind``: the runtime's cudaMemcpyKind, for the loop).
        ``each_call``: enqueues what goes on the stream before each batched call (a gate's wait),
        and before the copies of a chunk that goes segment by segment; ``call_segments``: most
        segments a call, in place of this instance's (0: keep it)."""
        pointers = np.empty((3, len(sizes)), dtype=np.uint64)  # the three C arrays, end to end
        np.add(dst_offsets, np.uint64(dst), out=pointers[0])
        np.add(src_offsets, np.uint64(src), out=pointers[1])
        pointers[2] = sizes
        self.copy_pointers(pointers, kind, stream, each_call=each_call, call_segments=call_segments)

    def copy_pointers(
        self,
        pointers: U64,
        kind: Any,
        stream: Any,
        *,
        each_call: Callable[[], None] | None = None,
        call_segments: int = 0,
    ) -> None:
        """`copy` of a table already in the driver's form: a C-ordered (3, N) uint64 array of
        destination addresses, source addresses and sizes."""
        count = pointers.shape[1]
        per_call = call_segments or self.call_segments
        done = 0
        if count > 1 and self.error is None:
            # The arrays' addresses once per chunk, not per call: each ``.ctypes`` runs Python
            # code of numpy's, microseconds on a thread that has just woken.
            base = pointers.ctypes.data
            arrays = (base, base + 8 * count, base + 16 * count)
            while done < count:
                n = min(per_call, count - done)
                if each_call is not None:
                    each_call()
                try:
                    self._call(arrays, done, n, stream)
                except CudaError as exc:
                    if self._proven:
                        raise
                    # The first call failed: this driver or platform does not take batched
                    # copies. Segment by segment works everywhere.
                    self.error = f"cuMemcpyBatchAsync failed on first use ({exc}): one cudaMemcpyAsync per segment"
                    break
                self._proven = True
                done += n
        if done == count:
            return
        if each_call is not None:
            each_call()
        memcpy = self._memcpy
        for d, s_, n in pointers[:, done:].T.tolist():
            check(memcpy(d, s_, n, kind, stream))

    def _call(self, arrays: tuple[int, int, int], first: int, count: int, stream: Any) -> None:
        """One ``cuMemcpyBatchAsync`` of ``count`` segments from index ``first`` of three
        contiguous uint64 arrays (destinations, sources, sizes) at the addresses ``arrays``."""
        skip = first * 8  # bytes of uint64 (CUdeviceptr, size_t) ahead of the first segment
        dsts, srcs, lengths = arrays
        rc = self._batch(
            dsts + skip,
            srcs + skip,
            lengths + skip,
            count,
            self._attrs_ptr,
            ctypes.addressof(self._attrs_index),
            1,
            ctypes.byref(self._fail_index),
            int(stream),
        )
        if rc:
            raise error(self._result(rc))
