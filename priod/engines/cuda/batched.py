"""DMA for a batch's chunk: one ``cuMemcpyBatchAsync`` where the driver has it, else a loop.

A chunk of a batch (priod/batch.py) is many (dst, src, nbytes) copies that may run in any
order. ``cuMemcpyBatchAsync`` (CUDA 12.8) enqueues all of them in one call, which costs the
daemon one driver call per chunk instead of one per segment and lets the driver pack the
descriptors. It needs:

- cuda-bindings >= 12.8 (the function exists in ``cuda.bindings.driver``; 13.x drops its
  ``failIdx`` result, which `check` takes either way), and
- a driver that supports CUDA 12.8 or newer (R570+), as ``cuDriverGetVersion`` reports.

Where either is missing, or the driver refuses the first batched call (a platform without
it), each segment is one ``cudaMemcpyAsync`` on the same stream: the same bytes in the same
FIFO, at a few microseconds of Python per segment. `BatchedDma.error` says which path runs
and why, and `priod status` shows it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from priod.errors import CudaError

from ._driver import bindings, check

__all__ = ["BATCH_MIN_DRIVER", "BatchedDma"]

BATCH_MIN_DRIVER = 12080
"""``cuDriverGetVersion`` of the first driver with ``cuMemcpyBatchAsync`` (CUDA 12.8)."""

U64 = npt.NDArray[np.uint64]


class BatchedDma:
    """Enqueues a batch's chunk on a stream: one batched call, or one copy per segment."""

    def __init__(self) -> None:
        rt, drv = bindings()
        self._memcpy = rt.cudaMemcpyAsync
        self._batch: Any = getattr(drv, "cuMemcpyBatchAsync", None)
        self._ptr = drv.CUdeviceptr
        self._proven = False
        """A batched call has succeeded: from then on its errors are the copy's, not the API's."""
        self.error: str | None = None
        """Why chunks go segment by segment (None: cuMemcpyBatchAsync is used)."""
        if self._batch is None:
            self.error = "cuda-bindings has no cuMemcpyBatchAsync (it needs cuda-bindings >= 12.8): one cudaMemcpyAsync per segment"
            return
        version = int(check(drv.cuDriverGetVersion()))
        if version < BATCH_MIN_DRIVER:
            self.error = (
                f"the driver supports CUDA {version // 1000}.{version % 1000 // 10}; cuMemcpyBatchAsync needs 12.8 "
                "(driver R570 or newer): one cudaMemcpyAsync per segment"
            )
            return
        attrs = drv.CUmemcpyAttributes()
        # Stream order: a chunk's sources may have been written by the chunk ahead of it.
        attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs = [attrs]

    def copy(self, dst: int, src: int, dst_offsets: U64, src_offsets: U64, sizes: U64, kind: Any, stream: Any) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src + src_offsets[i]`` to ``dst + dst_offsets[i]``
        for each i on ``stream`` (``kind``: the runtime's cudaMemcpyKind, for the loop)."""
        count = len(sizes)
        if count > 1 and self.error is None:
            dsts = list(map(self._ptr, (dst_offsets + np.uint64(dst)).tolist()))
            srcs = list(map(self._ptr, (src_offsets + np.uint64(src)).tolist()))
            try:
                check(self._batch(dsts, srcs, sizes.tolist(), count, self._attrs, [0], 1, stream))
                self._proven = True
                return
            except (CudaError, TypeError) as exc:
                if self._proven:
                    raise
                # The first call failed: this driver or platform does not take batched copies
                # (or the bindings' signature differs). Segment by segment works everywhere.
                self.error = f"cuMemcpyBatchAsync failed on first use ({exc}): one cudaMemcpyAsync per segment"
        memcpy = self._memcpy
        for d, s_, n in zip((dst_offsets + np.uint64(dst)).tolist(), (src_offsets + np.uint64(src)).tolist(), sizes.tolist(), strict=True):
            check(memcpy(d, s_, n, kind, stream))
