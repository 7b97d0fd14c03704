"""The express path: a copy kernel on a highest-priority stream, beside the copy engines.

Host-to-device and device-to-host copies run FIFO on one copy engine per direction, whatever
the stream's priority, so an urgent DMA copy waits for the bulk copy ahead of it. The express
path is a copy kernel (``express.cu`` in this folder, shipped as ``express.ptx`` and loaded with
``cuModuleLoadData``, so no NVRTC is needed at run time) that reads or writes mapped host
memory through its device alias. It does not queue behind the copy engine. Measured on an H200:

- Under a whole 2 GiB copy in the same direction, 64 KiB took 27 us (h2d) / 19 us (d2h),
  1 MiB 69 / 44 us, 16 MiB 416 / 374 us, while the DMA path waited 36.5 ms.
- Stream priority matters here, for the kernel's blocks, but running blocks are not preempted:
  with every SM held by a low-priority kernel of 1 ms blocks, an express copy took 650-680 us;
  with 0.1 ms blocks, 27-45 us.
- A ``submit`` down this path costs 8-10 us of Python, of which ``cuLaunchKernel`` is 5 us.

The PTX targets compute_75 and needs a driver at least as new as the nvcc that wrote it
(``scripts/build_ptx.sh``); where the driver refuses it, the engine runs without the express
lane and says why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from priod.common.cuda.driver import bindings, check
from priod.errors import CudaError


class Device(Protocol):
    """What the kernel needs of a GPU: the daemon's per-GPU state, or a client's direct copies."""

    index: int
    sm_count: int
    module: Any
    function: Any
    table_function: Any
    kernel_registers: int


U64 = npt.NDArray[np.uint64]

__all__ = [
    "CHECKED_TABLE_HEADER",
    "CHECKED_TABLE_KERNEL_NAME",
    "EXPRESS_BLOCKS_PER_SM",
    "EXPRESS_MAX",
    "EXPRESS_MIN_H2D",
    "EXPRESS_THREADS",
    "EXPRESS_UNROLL",
    "KERNEL_NAME",
    "PTX_PATH",
    "TABLE_KERNEL_NAME",
    "TABLE_MAX",
    "ExpressKernel",
    "read_ptx",
]

EXPRESS_MAX = 64 << 20
"""Largest copy the express lane takes. Past this a kernel holds the SMs for milliseconds (16 MiB
took 340 us alone), and a bulk-sized copy belongs on the DMA path anyway."""

EXPRESS_MIN_H2D = 8 << 10
"""Host-to-device copies smaller than this go by DMA even when urgent. Small host-to-device
payloads ride in the command stream and pass a running bulk copy on *another* stream (hence the
lane's separate strict stream), need no SM, and alone beat the kernel's launch by 2-5 us.
Measured on the H200 (driver 580.159), ``submit`` to ``done()`` from Python, medians of 7-11;
DMA on the lane's strict stream, the bulk a whole 2 GiB copy on its DMA stream:

    size      alone: DMA / express     under bulk: DMA / express
    1 KiB         10.2 / 15.0 us           30.6 / 60.6 us (express: one noisy run)
    4 KiB         10.7 / 13.6              24.8 / 24.0-27.5
    8 KiB         11.7 / 13.9              49.9-68.9 / 25.7
    12-24 KiB       -                      25.7-41.4 / 25.8-27.6
    28 KiB          -                      36,395 (waits for all the bulk) / -
    32 KiB        11.7 / 14.8              36,503 / 26.1-28.2
    64 KiB        12.3 / 15.2              36,520 / 26.5-28.1
    1 MiB         30.7 / 34.6              36,808 / 67-69
    16 MiB       334.3 / 343.8             36,564 / 414-417

So under load the kernel wins from 8 KiB (and ties at 4 KiB); DMA passes the bulk only up to
24 KiB (the driver's inline limit, which may differ elsewhere), and a 1 KiB copy on the bulk's
own stream waits the whole 36.6 ms. Below 8 KiB DMA is as fast and leaves the SMs alone."""

EXPRESS_THREADS = 1024
EXPRESS_BLOCKS_PER_SM = 2
"""Grid of at most two 1024-thread blocks per SM: one full wave, as the kernel is capped at 32
registers per thread (``__launch_bounds__(1024, 2)``). Measured, median us, 1 / 2 / 4 blocks
per SM: alone h2d 1 MiB 41 / 35 / 50, 16 MiB 355 / 344 / 342; under a bulk copy h2d 16 MiB
496 / 414 / 419, d2h 16 MiB 458 / 387 / 380 (1 MiB under bulk: too noisy to rank)."""
EXPRESS_UNROLL = 4
"""Loads in flight per thread, as ``UNROLL`` in ``express.cu``; used to size small grids."""

PTX_PATH = Path(__file__).with_name("express.ptx")
KERNEL_NAME = b"priod_copy"
TABLE_KERNEL_NAME = b"priod_copy_table"
CHECKED_TABLE_KERNEL_NAME = b"priod_copy_table_checked"
"""The table kernel that checks its rows itself (a direct batch's, `priod.client.direct`)."""
CHECKED_TABLE_HEADER = 5
"""Words of ``CheckedTable`` (``express.cu``) before its rows: src, dst, src_bytes, dst_bytes, fault."""
TABLE_MAX = 256
"""Segments one ``priod_copy_table`` launch takes (``TABLE_MAX`` in ``express.cu``): its table
rides in the kernel's parameters, 6,160 bytes, within the 32 KiB of CUDA 12.1 and later (every
driver that loads the PTX)."""


def read_ptx() -> tuple[bytes | None, str | None]:
    """The PTX text, NUL-terminated as ``cuModuleLoadData`` wants it, or None and the reason."""
    try:
        return PTX_PATH.read_bytes() + b"\0", None
    except OSError as exc:
        return None, f"cannot read {PTX_PATH}: {exc}"


class ExpressKernel:
    """Loads the copy kernel into a device and launches it.

    One per engine: it keeps the argument arrays ``cuLaunchKernel`` reads through alive and
    reuses them (the driver copies the values at launch).
    """

    def __init__(self, blocks_per_sm: int = EXPRESS_BLOCKS_PER_SM) -> None:
        _, drv = bindings()
        self.blocks_per_sm = blocks_per_sm
        """Blocks per SM of the largest grid (see `EXPRESS_BLOCKS_PER_SM`)."""
        self._cu_launch = drv.cuLaunchKernel
        # cuLaunchKernel reads its arguments through an array of pointers.
        self._kargs = (ctypes.c_uint64 * 3)()
        base = ctypes.addressof(self._kargs)
        self._kptrs = (ctypes.c_uint64 * 3)(base, base + 8, base + 16)
        self._kparams = ctypes.addressof(self._kptrs)
        # priod_copy_table's one parameter, the SegmentTable struct: src, dst, then
        # (dst_offset, src_offset, nbytes) per segment, as uint64.
        self._table = (ctypes.c_uint64 * (2 + 3 * TABLE_MAX))()
        self._table_view: U64 = np.ctypeslib.as_array(self._table)
        self._table_rows: U64 = self._table_view[2:].reshape(TABLE_MAX, 3)
        """The segments' part of the struct as (TABLE_MAX, 3) rows: a table's rows go in by one assignment."""
        self._tptrs = (ctypes.c_uint64 * 1)(ctypes.addressof(self._table))
        self._tparams = ctypes.addressof(self._tptrs)

    @staticmethod
    def load(dev: Device, ptx: bytes) -> str | None:
        """Load the kernel into ``dev`` (current): fill its ``module``, ``function`` and
        ``kernel_registers``. Returns None, or why the device has no express lane."""
        _, drv = bindings()
        try:
            dev.module = check(drv.cuModuleLoadData(ptx))
            dev.function = check(drv.cuModuleGetFunction(dev.module, KERNEL_NAME))
            dev.kernel_registers = int(
                check(drv.cuFuncGetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, dev.function))
            )
            dev.table_function = check(drv.cuModuleGetFunction(dev.module, TABLE_KERNEL_NAME))
        except CudaError as exc:
            # An older driver than the PTX's ISA (CUDA_ERROR_UNSUPPORTED_PTX_VERSION) lands
            # here: the engine still works, without the express lane.
            dev.module = dev.function = dev.table_function = None
            return (
                f"loading {PTX_PATH.name} on gpu{dev.index} failed ({exc}); the driver may be older "
                "than the PTX (regenerate it with an older nvcc: scripts/build_ptx.sh)"
            )
        return None

    def launch(self, dev: Device, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Launch the copy kernel: enough threads for one unrolled step each, up to one wave."""
        mis = src ^ dst
        word = 16 if mis & 15 == 0 else 8 if mis & 7 == 0 else 4 if mis & 3 == 0 else 2 if mis & 1 == 0 else 1
        wanted = max(1, -(-(nbytes // word) // EXPRESS_UNROLL))
        threads = min(EXPRESS_THREADS, max(32, -(-wanted // 32) * 32))
        blocks = max(1, min(dev.sm_count * self.blocks_per_sm, -(-wanted // threads)))
        args = self._kargs
        args[0] = src
        args[1] = dst
        args[2] = nbytes
        check(self._cu_launch(dev.function, blocks, 1, 1, threads, 1, 1, 0, stream, self._kparams, 0))

    def launch_table(
        self, dev: Device, dst: int, src: int, cells: U64, stream: Any, side: Any = None, *, largest: int | None = None
    ) -> None:
        """Copy a batch's segments, ``cells`` an (N, 3) uint64 array of (dst_offset, src_offset,
        nbytes) rows, offsets relative to ``dst`` and ``src`` (the kernel's table layout: a
        C-ordered array goes in without a copy): one launch of
        ``priod_copy_table`` per `TABLE_MAX` of them, a row of blocks per segment, the rows
        together about one wave. Where the kernel is not loaded, one `launch` per segment.
        ``largest``: the largest segment, where the caller knows it already.

        With ``side``, a second stream, every other launch goes there, so that two tables run at
        once; the caller orders ``stream`` after ``side``'s launches (and ``side`` after the work
        before it on ``stream``, where that matters). Tables are launched one after the other
        on one stream otherwise, and a table of a wave's rows keeps the GPU's blocks busy
        only until its rows end: with 128-row tables, 256 scattered 64 KiB blocks took 501 / 612
        us (p50 / p99, h2d, with 2 GiB copies running in another process) one table after the
        other, 446 / 465 two at once (H200 probe)."""
        count = len(cells)
        if dev.table_function is None:
            for d, s_, n in cells.tolist():
                self.launch(dev, dst + d, src + s_, n, stream)
            return
        table, rows_in = self._table, self._table_rows
        table[0] = src
        table[1] = dst
        wave = dev.sm_count * self.blocks_per_sm
        # Few numpy calls: code that has not run for a few milliseconds ran several times slower
        # on the H200's host, and building this table with ``np.stack`` took ~40 us of a direct
        # batch there. One assignment of rows per
        # launch. Not ctypes.memmove from ``cells.ctypes.data``: that attribute is Python code
        # in numpy, 40-52 us cold there.
        if largest is None:
            largest = int(np.maximum.reduce(cells[:, 2]))  # the ufunc itself (wire/batch.py, LARGEST, says why)
        # Threads for one 16-byte unrolled step each of the batch's largest segment, as `launch`
        # sizes its grid; rows share the wave (a row gets at least one block).
        wanted = max(1, -(-(largest // 16) // EXPRESS_UNROLL))
        threads = min(EXPRESS_THREADS, max(32, -(-wanted // 32) * 32))
        streams = (stream, stream if side is None else side)
        for first in range(0, count, TABLE_MAX):
            rows = min(count, first + TABLE_MAX) - first
            rows_in[:rows] = cells[first : first + rows]
            per_row = max(1, min(-(-wanted // threads), wave // rows))
            on = streams[first // TABLE_MAX % 2]
            check(self._cu_launch(dev.table_function, per_row, rows, 1, threads, 1, 1, 0, on, self._tparams, 0))

    def grid(self, dev: Device) -> str:
        """The largest grid on ``dev``, for statistics."""
        return f"<= {dev.sm_count * self.blocks_per_sm} x {EXPRESS_THREADS}"
