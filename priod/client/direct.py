"""Direct urgent copies: this process's own DMA, while the daemon holds bulk back.

An urgent copy through the daemon costs a round trip between two Python processes (150-300 us
on the H200 host) on top of the copy. A process that owns both buffers (pinned host memory and
device memory in its own CUDA context, such as an inference process's KV-cache tensors) can
instead issue the ``cudaMemcpyAsync`` itself, on a high-priority stream of its own, and announce
it on its hold page (daemon/holds.py): the daemon submits no bulk chunk on that lane until the copy is
over, and runs the lane's short bound meanwhile. The copy engine time-slices between the two
contexts, so the urgent copy waits only for the short bulk chunks already in flight.

    page = client.hold_page()                    # once per connection (SyncClient or Client)
    direct = DirectCopies(page)
    direct.copy(gpu_tensor, pinned_cpu_tensor)    # h2d, blocking; bytes, not elements
    blocks = direct.pair(gpu_pool, pinned_pool)   # resolved once, for a loop over the same buffers
    blocks.copy(nbytes, dst_offset=..., src_offset=...)
    blocks.copy_batch(table)                      # (N, 3) (dst_offset, src_offset, nbytes): one hold

`HoldPage` is the page alone (announce, no CUDA); `DirectCopies` makes the copies. Buffers are
PyTorch tensors (any dtype, contiguous; host ones pinned), NumPy arrays in pinned memory, objects
with ``__cuda_array_interface__``, or ``(address, nbytes)`` tuples. What goes through the
daemon instead: copies between regions the daemon holds, device-to-device copies, pageable host
memory, and bulk (which the daemon paces; a direct copy is never paced).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np

from priod.client.cuda_ipc import _is_torch_tensor, device_span
from priod.common.choice import EXPLORE_EVERY, PathChooser, PathEstimate, PathFigures
from priod.common.cuda.driver import DeviceScope, bindings, check, gpu_uuid, one_gpu, status_codes
from priod.common.gpus import uuid_key
from priod.common.types import Direction, LaneKey, Path
from priod.errors import InvalidRequest
from priod.wire.batch import LARGEST, ROW, SMALLEST, Cells
from priod.wire.hold_page import CLIENT_BYTES, DAEMON_WORD, GRANTED, PAGE_BYTES, WORDS_PER_SLOT

__all__ = [
    "KERNEL_BLOCK_MAX",
    "DirectCopies",
    "DirectPair",
    "HoldPage",
    "PinnedHost",
    "direct_pointers",
    "direct_rows",
    "direct_table",
    "pin_host",
]

"""A slot's uint64 words: ``begun``, then ``ended``."""
FAULT_WORDS = 512
"""Fault words a loaded copy kernel keeps (one page of mapped host memory): as many batches the
kernel checks at once, from as many threads; past that a batch is checked on the host."""


class HoldPage:
    """This connection's hold page, as the client writes it: `begin` before a copy is issued,
    `end` once it is over (or failed); and as the daemon writes it: `refused` while this uid's
    hold budget on a lane is spent (a copy announced then runs un-held). No CUDA here: anything
    that moves bytes on its own may announce them. The daemon reads the client's counters;
    closing the connection ends every hold."""

    def __init__(self, fd: int, lanes: list[dict[str, Any]], doorbell: int | None = None) -> None:
        """``fd`` (the page's memfd, from the reply) is closed here once mapped; ``doorbell``
        (an eventfd, from the reply where the daemon has one) is written after each `begin`
        and closed with the page."""
        self._doorbell = doorbell
        try:
            if sys.byteorder != "little":  # the page's counters are little-endian words (protocol.md)
                raise InvalidRequest("direct copies need a little-endian host")
            # A daemon before the daemon's half made the client's half alone: map what there is.
            size = PAGE_BYTES if os.fstat(fd).st_size >= PAGE_BYTES else CLIENT_BYTES
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.lanes = lanes
        """``lanes[i]``: slot i's ``device`` (the daemon's ordinal), ``device_uuid``, ``direction``."""
        self._words = memoryview(self._map).cast("Q")
        """The page as uint64 words. Each counter is written by one aligned 8-byte store: the
        daemon reads the page while it is written, and `struct.pack_into` zeroes its field before
        it packs (CPython's ``s_pack_internal``), so a scan could catch a counter at 0. Measured on
        the H200: such a read made the daemon charge a 50-ms hold debt and hold nothing for the
        next ~200 ms, the ~900-us tails of the direct rows (docs/benchmarks.md)."""
        self._told = DAEMON_WORD if size >= PAGE_BYTES else None
        """Where the daemon's words start in ``_words`` (None: a page without them)."""
        self._begun = [0] * len(lanes)
        self._ended = [0] * len(lanes)
        """What this process wrote, the page's only writer (so no read back of the page)."""
        self._slots = {
            (uuid_key(ln["device_uuid"]) if ln.get("device_uuid") else ln["device"], ln["direction"]): i
            for i, ln in enumerate(lanes)
        }
        self._lock = threading.Lock()

    def slot(self, device_uuid: str | None, direction: str, device: int = 0) -> int:
        """The slot of the lane to a GPU (by UUID; by the daemon's ordinal where it has none, as
        on the sim engine) in ``direction`` (``h2d`` or ``d2h``)."""
        key = (uuid_key(device_uuid) if device_uuid else device, direction)
        try:
            return self._slots[key]
        except KeyError:
            served = ", ".join(f"{ln.get('device_uuid') or ln['device']}/{ln['direction']}" for ln in self.lanes)
            raise InvalidRequest(
                f"the daemon serves no {direction} lane of GPU {device_uuid or device} (it serves {served})"
            ) from None

    def begin(self, slot: int) -> None:
        """Announce a copy on ``slot``'s lane: the daemon holds bulk there until `end`."""
        with self._lock:  # one writer per counter: threads of this process take turns
            n = self._begun[slot] = self._begun[slot] + 1
            self._words[slot * WORDS_PER_SLOT] = n
        if self._doorbell is not None:
            # After the store: a daemon asleep reads the page at once (~1 us here) rather than
            # finding the copy on its next scan.
            try:
                os.eventfd_write(self._doorbell, 1)
            except OSError:
                pass  # full (a wake-up is pending anyway), or the connection is gone

    def end(self, slot: int) -> None:
        with self._lock:
            n = self._ended[slot] = self._ended[slot] + 1
            self._words[slot * WORDS_PER_SLOT + 1] = n

    def refused(self, slot: int) -> bool:
        """Whether the daemon says this uid's hold budget on ``slot``'s lane is spent: a copy
        announced now would not hold bulk back, so send urgent copies through the daemon until
        this reads False again (once the budget has refilled enough for a hold). The daemon
        updates its word when it looks at the pages (before it hands out chunks, and on
        status), so on an idle daemon it may stay True until the next copy through it.
        One aligned 8-byte load of the daemon's word; False on a daemon that writes none."""
        told = self._told
        return told is not None and self._words[told + slot] != GRANTED

    def close(self) -> None:
        self._words.release()
        self._map.close()
        if self._doorbell is not None:
            os.close(self._doorbell)
            self._doorbell = None


def _span(obj: object) -> tuple[int, int]:
    """``(address, nbytes)`` of a buffer: an ``(address, nbytes)`` tuple, a contiguous torch
    tensor on either side, a NumPy array, or anything with ``__cuda_array_interface__``."""
    if isinstance(obj, tuple):
        address, nbytes = obj
        if not (isinstance(address, int) and isinstance(nbytes, int) and nbytes > 0):
            raise InvalidRequest(f"a buffer given as a tuple is (address, nbytes), two ints, nbytes > 0; got {obj!r}")
        return address, nbytes
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidRequest("the array is not C-contiguous: pass np.ascontiguousarray(...) of pinned memory")
        return int(obj.ctypes.data), int(obj.nbytes)
    if _is_torch_tensor(obj) and not obj.is_cuda:  # type: ignore[attr-defined]
        t: Any = obj
        if not t.is_contiguous():
            raise InvalidRequest("the tensor is not contiguous: pass .contiguous() of a pinned tensor")
        return int(t.data_ptr()), int(t.numel()) * int(t.element_size())
    return device_span(obj)


class PinnedHost:
    """Host memory pinned in this process's CUDA contexts (`pin_host`) until `close`."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes
        self._rt, _ = bindings()
        self._pinned = True

    def close(self) -> None:
        """Unpin (once; copies that use the memory must be over)."""
        if self._pinned:
            self._pinned = False
            check(self._rt.cudaHostUnregister(self.address))

    def __enter__(self) -> PinnedHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pin_host(obj: object) -> PinnedHost:
    """Pin host memory in this process's CUDA contexts (``cudaHostRegister``, mapped and portable)
    so that direct copies may use it: above all a host region the daemon allocated
    (``Client.alloc_host``, its memfd mapped here). The daemon's own copies of that region go on
    as before, so one host pool serves both ways: bulk offloads through the daemon, urgent
    reloads by this process (examples/kv_offload.py ``--direct``). ``obj``: a host `Region`, a
    CPU tensor, a NumPy array or an ``(address, nbytes)`` tuple. Pinning costs about 0.1 ms a MiB
    (once); unpin with `PinnedHost.close` or a ``with`` block before the memory goes away."""
    array = getattr(obj, "array", None)
    if getattr(obj, "kind", None) == "host" and isinstance(array, np.ndarray):
        obj = array  # a host Region: its mapping in this process
    if (
        hasattr(obj, "__cuda_array_interface__")
        or getattr(obj, "is_cuda", False)
        or getattr(obj, "kind", None) == "device"
    ):
        raise InvalidRequest("pin_host pins host memory; this is GPU memory, which a direct copy takes as it is")
    address, nbytes = _span(obj)
    rt, _ = bindings()
    (err,) = rt.cudaHostRegister(address, nbytes, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable)
    if err == rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered:
        raise InvalidRequest(
            "this host memory is pinned here already (pin_memory(), cudaHostAlloc or an earlier pin_host): use it as it is"
        )
    check((err,))
    return PinnedHost(address, nbytes)


KERNEL_BLOCK_MAX = 256 << 10
"""A direct batch whose first block is under this many bytes runs the copy kernel (where it
can): the driver's batched DMA costs about a microsecond a block beyond its bytes, a 64 KiB
block's time on the link; larger blocks keep to the copy engines and leave the SMs alone. The
first block, not the mean: a KV cache's blocks are of one size, and a sum over the table before
the launch costs ~30 us on a thread that has just woken (H200; see docs/design.md, Defaults).
Either path copies any table exactly."""
_WORD_FORMATS = frozenset({"l", "q", "L", "Q"})
"""The buffer formats of 8-byte native integers (numpy's int64 and uint64 on a 64-bit Linux)."""


def _device_address(attributes: Any) -> int:
    """The address through which a kernel reaches a pointer, from the pointer's
    ``cudaPointerGetAttributes``: a mapped host buffer's device pointer, device memory's own
    address; 0 where the GPU cannot address it (host memory pinned without a mapping)."""
    return int(attributes.devicePointer or 0)


class _BatchKernel:
    """The daemon's copy kernel (common/cuda/express.py) loaded into this process's current
    context on one GPU, launched over a batch's table on this process's urgent stream (and a
    side stream, for batches of more than one table). Holds what `ExpressKernel.load` fills and
    `ExpressKernel.launch_table` reads of a device."""

    def __init__(self, device: int, sm_count: int) -> None:
        from priod.common.cuda.express import (
            CHECKED_TABLE_HEADER,
            EXPRESS_BLOCKS_PER_SM,
            EXPRESS_THREADS,
            EXPRESS_UNROLL,
            TABLE_MAX,
            ExpressKernel,
        )

        self.index, self.sm_count = device, sm_count
        self.table_max = TABLE_MAX
        self.module: Any = None
        self.function: Any = None
        self.table_function: Any = None
        self.checked_function: Any = None
        """``priod_copy_table_checked``; None in an older PTX (every table is then checked on the host)."""
        self.kernel_registers = 0
        self._wave = sm_count * EXPRESS_BLOCKS_PER_SM
        self._threads, self._unroll = EXPRESS_THREADS, EXPRESS_UNROLL
        # The checked kernel's one parameter (``CheckedTable``): its header, then the rows, whose
        # bytes are copied in as they come (a memoryview copy, no numpy call), over a bytearray
        # so that the copy goes byte for byte whatever ctypes calls its format.
        self._header_bytes = 8 * CHECKED_TABLE_HEADER
        self._checked_buf = bytearray(self._header_bytes + 24 * TABLE_MAX)
        self._checked_bytes = memoryview(self._checked_buf)
        self._checked_head = (ctypes.c_uint64 * CHECKED_TABLE_HEADER).from_buffer(self._checked_buf)
        self._checked_ptrs = (ctypes.c_uint64 * 1)(ctypes.addressof(self._checked_head))
        self._checked_params = ctypes.addressof(self._checked_ptrs)
        self._faults: Any = None
        """`FAULT_WORDS` uint64 words of mapped pinned host memory, one per batch the kernel checks
        while it runs; `_faults_on_gpu` is their address as the GPU sees it."""
        self._faults_on_gpu = 0
        self._free_faults: list[int] = []
        self._express = ExpressKernel()
        self._launch = self._express._cu_launch
        self._launching = threading.Lock()
        """`ExpressKernel` fills one parameter block per launch, and the join event is shared:
        one batch's launches at a time."""
        rt, drv = bindings()
        self._stream_type = drv.CUstream
        self._rt = rt
        self._side: Any = None
        """A second stream, made on the first batch of more than one table."""
        self._join: Any = None
        self._as_cu: dict[int, Any] = {}
        """Each stream as the driver API's type, made once (cuda-python objects cost microseconds)."""

    @classmethod
    def load(cls, device: int) -> _BatchKernel | None:
        """The kernel loaded on ``device`` (current), or None where it cannot be (no PTX, or an
        older driver than the PTX: batches go by DMA)."""
        from priod.common.cuda.express import CHECKED_TABLE_KERNEL_NAME, ExpressKernel, read_ptx

        ptx, _why = read_ptx()
        if ptx is None:
            return None
        rt, drv = bindings()
        kernel = cls(
            device, int(check(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, device)))
        )
        if ExpressKernel.load(cast(Any, kernel), ptx) is not None:
            return None
        err, function = drv.cuModuleGetFunction(kernel.module, CHECKED_TABLE_KERNEL_NAME)
        if err == drv.CUresult.CUDA_SUCCESS:
            host = int(check(rt.cudaHostAlloc(8 * FAULT_WORDS, rt.cudaHostAllocMapped)))
            kernel._faults = (ctypes.c_uint64 * FAULT_WORDS).from_address(host)
            kernel._faults_on_gpu = int(check(rt.cudaHostGetDevicePointer(host, 0)))
            kernel._free_faults = list(range(FAULT_WORDS))
            kernel.checked_function = function
        return kernel

    def launch(self, dst: int, src: int, cells: Cells, largest: int, stream: Any) -> None:
        """Enqueue the batch, ``cells`` its (N, 3) uint64 segments row by row (C order) and
        ``largest`` the largest segment, on ``stream`` (this GPU current). Past one table, every
        other table runs on the side stream, joined back into ``stream``, so waiting for
        ``stream`` waits for the whole batch. The side stream is not ordered after ``stream``'s earlier work: every
        direct copy is waited for before it returns, so all ``stream`` can hold is another
        thread's copy, which is not ordered with this one anyway."""
        rt, express = self._rt, self._express
        with self._launching:
            main = self._cu(stream)
            if len(cells) <= self.table_max:
                express.launch_table(cast(Any, self), dst, src, cells, main, largest=largest)
                return
            if self._side is None:
                _, greatest = check(rt.cudaDeviceGetStreamPriorityRange())
                self._side = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
                self._join = check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))
            express.launch_table(cast(Any, self), dst, src, cells, main, self._cu(self._side), largest=largest)
            check(rt.cudaEventRecord(self._join, self._side))
            check(rt.cudaStreamWaitEvent(stream, self._join, 0))

    def launch_checked(
        self, dst: int, src: int, rows: memoryview, dst_bytes: int, src_bytes: int, stream: Any
    ) -> int | None:
        """Enqueue a batch of at most `table_max` rows that the kernel checks itself against
        buffers of ``dst_bytes`` and ``src_bytes`` (``priod_copy_table_checked``): every row is
        copied or none is. ``rows``: the table as `direct_rows` gives it, its bytes copied in as
        they are. Returns the fault word's index, for `fault` once the stream is done; None where
        every word is in use."""
        n = len(rows)
        # Threads for one 16-byte unrolled step each of the first row, as `launch_table` sizes
        # its grid from the largest (a longer row takes more grid-stride turns); at least one
        # block a row, the rows together about one wave.
        wanted = max(1, -(-(rows[0, 2] // 16) // self._unroll))
        threads = min(self._threads, max(32, -(-wanted // 32) * 32))
        per_row = max(1, min(-(-wanted // threads), self._wave // n))
        with self._launching:
            if not self._free_faults:
                return None
            word = self._free_faults.pop()
            self._faults[word] = 0
            head = self._checked_head
            head[0], head[1], head[2], head[3], head[4] = src, dst, src_bytes, dst_bytes, self._faults_on_gpu + 8 * word
            self._checked_bytes[self._header_bytes : self._header_bytes + 24 * n] = rows.cast("B")
            try:
                check(
                    self._launch(
                        self.checked_function,
                        per_row,
                        n,
                        1,
                        threads,
                        1,
                        1,
                        0,
                        self._cu(stream),
                        self._checked_params,
                        0,
                    )
                )
            except BaseException:
                self._free_faults.append(word)
                raise
        return word

    def fault(self, word: int) -> int:
        """What the kernel of `launch_checked` reported, its stream done: 0 (every row copied)
        or 1 + the first bad row's index (none copied). Frees the word."""
        value = int(self._faults[word])
        with self._launching:
            self._free_faults.append(word)
        return value

    def _cu(self, stream: Any) -> Any:
        """``stream`` (the runtime API's) as the driver API's ``CUstream``."""
        key = int(stream)
        cu = self._as_cu.get(key)
        if cu is None:
            cu = self._as_cu[key] = self._stream_type(key)
        return cu

    def unload(self) -> None:
        rt, drv = self._rt, bindings()[1]
        if self._side is not None:
            rt.cudaStreamDestroy(self._side)
            rt.cudaEventDestroy(self._join)
        if self._faults is not None:
            rt.cudaFreeHost(ctypes.addressof(self._faults))
        drv.cuModuleUnload(self.module)


def direct_rows(segments: object) -> memoryview:
    """A direct batch's ``segments`` as the bytes the copy kernel reads: an (N, 3) memoryview of
    8-byte native integers in C order (a negative int64 reads there as 2**63 or more, past any
    buffer), its shape and type checked (InvalidRequest otherwise). Its figures are checked by
    the copy kernel as it starts (`_BatchKernel.launch_checked`) or by `direct_table`. An int64
    or uint64 array in C order, the usual table, is taken as it is: a view, no numpy call (each
    cost 10-30 us of a thread that had just woken, H200)."""
    want = "segments must be an (N, 3) integer array of (dst_offset, src_offset, nbytes), N >= 1"
    try:
        table = np.asarray(segments)
    except ValueError as exc:  # rows of different lengths
        raise InvalidRequest(f"{want}: {exc}") from None
    if table.dtype.kind in "iu":
        rows = table.data
        shape = rows.shape or ()
        if (
            len(shape) == 2
            and shape[1] == 3
            and shape[0]
            and rows.c_contiguous
            and rows.itemsize == 8
            and rows.format in _WORD_FORMATS
        ):
            return rows
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0 or table.dtype.kind not in "iu":
        raise InvalidRequest(f"{want}; got shape {table.shape}, {table.dtype}")
    return np.ascontiguousarray(table, dtype=np.uint64).data  # a negative figure becomes 2**63 or more: refused as such


def direct_table(segments: object, dst_bytes: int, src_bytes: int) -> tuple[Cells, int, int]:
    """Check a direct batch's ``segments`` against buffers of ``dst_bytes`` and ``src_bytes``:
    the (N, 3) uint64 table row by row (C order, as the copy kernel reads it; no copy of such a
    table), its total bytes and its largest segment. Raises InvalidRequest naming the fault.

    Few numpy calls, whole-table ones: each costs microseconds, 5-10 when the process has just
    woken, and with three times as many the checks take ~110 us of a 256-block batch on the
    H200's host.
    """
    table = np.asarray(segments)
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0 or table.dtype.kind not in "iu":
        raise InvalidRequest(
            f"segments must be an (N, 3) integer array of (dst_offset, src_offset, nbytes), N >= 1; got shape {table.shape}, {table.dtype}"
        )
    # A negative int64 becomes 2**63 or more here, caught with the figures no buffer can reach.
    # Reductions over a whole array or one column: numpy's across-rows ones (axis=0) cost 4 us
    # each, against under 1.
    cells: Cells = np.ascontiguousarray(table, dtype=np.uint64)
    sizes = cells[:, 2]
    if int(cells.max()) >= 1 << 62 or not sizes.all():
        raise InvalidRequest("every segment needs offsets >= 0 and nbytes >= 1, each below 2**62")
    # Below 2**62 an offset plus a size cannot wrap. The largest offset plus the largest size
    # within the buffer proves every row fits (the common case: blocks of one size); only where
    # it does not are the rows' own ends taken.
    largest = int(sizes.max())
    if int(cells[:, 0].max()) + largest > dst_bytes or int(cells[:, 1].max()) + largest > src_bytes:
        ends = (cells[:, :2] + cells[:, 2:]).max(axis=0).tolist()
        if ends[0] > dst_bytes or ends[1] > src_bytes:
            raise InvalidRequest(
                f"a segment does not fit the buffers ({dst_bytes} bytes of destination, {src_bytes} of source)"
            )
    return cells, int(sizes.sum()), largest


def direct_pointers(rows: memoryview, dst: int, dst_bytes: int, src: int, src_bytes: int, bases: Cells) -> Cells:
    """A direct batch's ``rows`` (`direct_rows`) in the form batched DMA takes: a C-ordered
    (3, N) uint64 array of destination addresses, source addresses and sizes (the three C arrays
    of ``cuMemcpyBatchAsync``, end to end), every row checked against the buffers at ``dst`` and
    ``src`` (InvalidRequest otherwise, naming the fault as `direct_table` does). ``bases``: the
    (3, 1) uint64 column ``[dst, src, 0]``.

    Five numpy calls, where `direct_table` and `BatchedDma.copy` make about fifteen: on a thread
    that has just woken each costs microseconds, and batched DMA is the path taken while another
    process computes (`DirectCopies`). The checks read the addresses: one past ``2**64`` wraps
    below its buffer, and the smallest address of each column shows it."""
    # (N, 3) uint64 (the wire's little-endian row: native on every host CUDA runs on); a negative
    # int64 reads as 2**63 or more.
    table = np.frombuffer(rows, dtype=ROW)
    pointers: Cells = np.empty((3, len(table)), dtype=np.uint64)
    np.add(table.T, bases, out=pointers)
    low, high = (
        SMALLEST(pointers, axis=1).tolist(),
        LARGEST(pointers, axis=1).tolist(),
    )  # the ufuncs themselves (batch.LARGEST)
    dst_end, src_end = dst + dst_bytes, src + src_bytes
    fits = low[0] >= dst and low[1] >= src and low[2] >= 1 and high[2] < 1 << 62
    if fits and (high[0] + high[2] > dst_end or high[1] + high[2] > src_end):
        # The largest address plus the largest size overshoots: blocks of several sizes, or a
        # bad row. Each row's end then, where every address is inside its buffer (below 2**63,
        # so an address plus a size below 2**62 cannot wrap).
        fits = high[0] < dst_end and high[1] < src_end
        if fits:
            ends = (pointers[:2] + pointers[2]).max(axis=1).tolist()
            fits = ends[0] <= dst_end and ends[1] <= src_end
    if not fits:
        direct_table(rows, dst_bytes, src_bytes)  # raises, saying what is wrong
        raise InvalidRequest("a segment does not fit the buffers")  # not reached: the checks agree
    return pointers


class DirectPair:
    """Copies between one host buffer and one device buffer, resolved once (`DirectCopies.pair`):
    which GPU, which direction, which slot of the page. For a loop over the same buffers, such as
    a KV cache's pinned pool and its GPU blocks: each `copy` is then one ``cudaMemcpyAsync``,
    the page's two counters and the wait. The buffers must outlive the pair."""

    def __init__(
        self,
        owner: DirectCopies,
        dst: int,
        dst_bytes: int,
        src: int,
        src_bytes: int,
        device: int,
        slot: int,
        on_device: tuple[int, int] = (0, 0),
        direction: str = "h2d",
    ) -> None:
        self._owner, self._device, self._slot, self._direction = owner, device, slot, direction
        # What batches need is made by the first batch, not here: `DirectCopies.copy` makes a
        # pair per copy.
        self._bases: Cells | None = None
        """The buffers' addresses as `direct_pointers` adds them to a table's offsets."""
        self._figures_size = 0
        self._figures: PathFigures | None = None
        """The figures of `DirectCopies`'s path choice that batches of ``_figures_size`` bytes
        (the last size) read and feed, kept here: looking them up costs a batch microseconds."""
        self.dst, self.dst_bytes, self.src, self.src_bytes = dst, dst_bytes, src, src_bytes
        self.on_device = on_device
        """(dst, src) as the GPU addresses them (a mapped host buffer's device pointer; 0 where
        the host buffer is not mapped): what the copy kernel of a batch reads and writes."""

    def copy(self, nbytes: int | None = None, *, dst_offset: int = 0, src_offset: int = 0) -> int:
        """Copy ``nbytes`` (default: the whole source) from ``src + src_offset`` to ``dst +
        dst_offset``; return once they have landed. Returns ``nbytes``."""
        n = self.src_bytes - src_offset if nbytes is None else nbytes
        if (
            n <= 0
            or src_offset < 0
            or dst_offset < 0
            or src_offset + n > self.src_bytes
            or dst_offset + n > self.dst_bytes
        ):
            raise InvalidRequest(
                f"{n} bytes at source offset {src_offset} and destination offset {dst_offset} do not fit "
                f"buffers of {self.src_bytes} and {self.dst_bytes} bytes"
            )
        owner = self._owner
        if owner.one_gpu:  # nothing to make current, and no scope to pay for (`DeviceScope`)
            owner._run(self._device, self._slot, self.dst + dst_offset, self.src + src_offset, n)
        else:
            with DeviceScope(self._device):
                owner._run(self._device, self._slot, self.dst + dst_offset, self.src + src_offset, n)
        return n

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold bulk back on this pair's lane from now until the block ends, for copies about to
        come: announced ahead, the daemon has closed the lane's gate and the bulk chunk running
        then has ended by the time the copy is issued, so the copy meets an idle link instead of
        waiting for that chunk (measured on the H200 in-process: a 64 KiB copy issued 300 us
        after its hold began, p50 39-45 us against 73-100 announced with the copy).
        Copies inside announce themselves too
        (the counters nest). The hold is charged as any: each announcement restarts its
        ``direct_hold_max_ms`` (5 ms by default), and the uid's share of the lane's time bounds
        it all, so announce no earlier than the copies need."""
        page, slot = self._owner.page, self._slot
        page.begin(slot)
        try:
            yield
        finally:
            page.end(slot)

    def copy_batch(self, segments: object) -> int:
        """Copy many blocks between the two buffers as one urgent unit: ``segments`` is an
        (N, 3) integer array (or a sequence of triples) of ``(dst_offset, src_offset, nbytes)``,
        as for `priod.Client.copy_batch`. One hold, one wait; where the first block is under
        `KERNEL_BLOCK_MAX` bytes the blocks move by the copy kernel's table form on this
        process's urgent stream or by ``cuMemcpyBatchAsync``, whichever was faster of late (see
        `DirectCopies`); larger ones by ``cuMemcpyBatchAsync`` (or one ``cudaMemcpyAsync`` per
        block where the driver has no batched call). Returns the bytes copied.

        The hold begins before the table is checked: the daemon closes the lane's gate (12-45
        us after an announcement) and the bulk chunk running then drains while this process
        checks the table and builds the launch, work that takes tens of microseconds on a
        thread that has just woken (H200 under bulk, this batch minus a contiguous copy: p50 87
        against 103 us, p99 96 against 132; docs/benchmarks.md). A table that fails its checks ends the hold at once, and moves no byte.

        The copy kernel checks a table of up to 256 rows itself as it starts, so that before
        the launch this thread does only what the launch needs (H200, each batch 5 ms after the
        last: 256 blocks of 64 KiB read ~40 us over a contiguous copy of their bytes at p50,
        against 130-150 with the checks on the host; docs/benchmarks.md)."""
        owner, page, slot = self._owner, self._owner.page, self._slot
        page.begin(slot)
        try:
            rows = direct_rows(segments)
            if owner.one_gpu:
                return owner._run_batch(self, rows)
            with DeviceScope(self._device):
                return owner._run_batch(self, rows)
        finally:
            page.end(slot)


class DirectCopies:
    """Urgent copies by this process's own DMA, announced on a `HoldPage`.

    Each copy goes on a high-priority, non-blocking stream of the GPU it touches (one per GPU,
    made on first use in that GPU's primary context, the one PyTorch and CuPy use), and is
    waited for by spinning ``spin_s`` on the stream, then blocking. Thread-safe.

    A batch of small blocks (`DirectPair.copy_batch`, the first under `KERNEL_BLOCK_MAX`) runs
    the daemon's copy kernel (``express.ptx``, loaded into this process's context on the first
    such batch) on that stream, where the host buffer is mapped: the
    driver's batched DMA waits for the whole call to be enqueued and pays about a microsecond a
    block, while the kernel moves 256 blocks of 64 KiB at 0.91 (h2d) and 0.94 (d2h) of the link
    on the H200. The kernel runs in this process's own context, so it takes no time slice from
    another one; it shares the SMs with this process's own kernels at block granularity. But
    while another process computes on the GPU, the kernel waits for that process's time slice
    on the SMs: on the H200 beside a process running GEMMs, 256 blocks of 64 KiB take p50
    1.1-1.9 ms by the kernel against 0.59-0.71 by batched DMA, which the SMs do not concern
    (docs/benchmarks.md).
    So which of the two a batch takes is measured, as the daemon's urgent copies are
    (`priod.common.choice.PathChooser`, per GPU, direction and size): the kernel until batched DMA has
    been seen faster, the other looked at again once ``explore_s`` has passed and
    ``explore_every`` batches of that size have taken the faster since the last look
    (`priod.common.choice.EXPLORE_EVERY`; `path_estimates` shows the figures). ``batch_path``
    "kernel" or "dma" takes that path for every batch that it can carry instead of the faster
    ("fastest", the default).

    The stream is non-blocking, so a copy is not ordered after this process's work on other
    streams, the legacy default stream included (CuPy's ``cp.zeros`` or a PyTorch kernel): wait
    for the work that writes a copy's source or touches its destination first (e.g.
    ``torch.cuda.current_stream().synchronize()``), as with ``cudaMemcpyAsync`` on a stream of
    one's own. A copy has landed when it returns.
    """

    def __init__(
        self,
        page: HoldPage,
        *,
        spin_s: float = 0.002,
        batch_path: str = "fastest",
        explore_s: float = 2.0,
        explore_every: int = EXPLORE_EVERY,
    ) -> None:
        if batch_path not in ("fastest", "kernel", "dma"):
            raise ValueError(f"batch_path is 'fastest', 'kernel' or 'dma', not {batch_path!r}")
        self.page = page
        self.spin_s = spin_s
        self.batch_path = batch_path
        self._paths = PathChooser(explore_s, explore_every)
        """The copy kernel (`Path.EXPRESS`) or batched DMA (`Path.DMA`) for a batch whose blocks
        either can carry: their recent latencies. Not locked: threads that race here lose a
        figure at worst."""
        self._kernels: dict[int, _BatchKernel | None] = {}
        """Per GPU: the loaded copy kernel (`_BatchKernel`), or None where it could not load."""
        self._rt, _ = bindings()
        self._ok, self._not_ready = status_codes()
        self._default = self._rt.cudaMemcpyKind.cudaMemcpyDefault
        self._streams: dict[int, Any] = {}
        self._uuids: dict[int, str] = {}
        self._batched: Any = None
        """`BatchedDma`, made on the first batch."""
        self._lock = threading.Lock()
        self.one_gpu = one_gpu()
        """This process sees one GPU: a copy has no device to make current, and skips the
        `DeviceScope` (~4 us at p50 on a thread just woken; docs/benchmarks.md)."""

    def copy(self, dst: object, src: object, nbytes: int | None = None) -> int:
        """Copy ``nbytes`` (default: all of ``src``) from ``src`` to ``dst``, one on the host
        (pinned) and one on a GPU; return once the bytes have landed. Returns ``nbytes``.
        (`pair` resolves the buffers once, for a loop over the same ones.)

        Raises:
            InvalidRequest: not a host/device pair, pageable host memory, sizes that do not fit.
            CudaError: the copy failed (the hold ends either way).
        """
        return self.pair(dst, src).copy(nbytes)

    def pair(self, dst: object, src: object) -> DirectPair:
        """Resolve a destination and a source buffer once: see `DirectPair`. Buffers are torch
        tensors (contiguous; host ones pinned), NumPy arrays, ``__cuda_array_interface__``
        objects, or ``(address, nbytes)`` tuples."""
        (dst_ptr, dst_bytes), (src_ptr, src_bytes) = _span(dst), _span(src)
        device, direction, on_device = self._lane_of(dst_ptr, src_ptr)
        uuid = self._uuids.get(device) or self._uuids.setdefault(device, gpu_uuid(device))
        slot = self.page.slot(uuid, direction, device)
        return DirectPair(self, dst_ptr, dst_bytes, src_ptr, src_bytes, device, slot, on_device, direction)

    def _run(self, device: int, slot: int, dst: int, src: int, n: int) -> None:
        """One copy on ``device`` (current), announced on ``slot``, waited for."""
        stream = self._streams.get(device) or self._stream(device)
        page = self.page
        page.begin(slot)
        try:
            (err,) = self._rt.cudaMemcpyAsync(dst, src, n, self._default, stream)
            if err is not self._ok:
                check((err,))
            self._wait(stream)
        finally:
            page.end(slot)

    def _run_batch(self, pair: DirectPair, rows: memoryview) -> int:
        """A batch on the pair's GPU (current), ``rows`` its (N, 3) segments (`direct_rows`:
        shape and type checked, the figures not yet): checked, enqueued and waited for, inside
        the hold the caller began (`DirectPair.copy_batch`). Returns its bytes.

        Which path: see `DirectCopies`. A table of one copy-kernel launch is checked by the
        kernel as it starts (every row or none is copied); any other before anything is
        enqueued, by `direct_table` for the kernel and `direct_pointers` for batched DMA. Before
        the launch this thread does only what the launch needs; the sum waits until after it."""
        device = pair._device
        stream = self._streams.get(device) or self._stream(device)
        kernel = (
            self._kernel(device)
            if self.batch_path != "dma" and all(pair.on_device) and rows[0, 2] < KERNEL_BLOCK_MAX
            else None
        )
        if kernel is None:
            return self._dma_batch(pair, rows, stream)
        if self.batch_path == "kernel":
            return self._kernel_batch(kernel, pair, rows, stream)
        # Both paths can carry it: the faster of late, timed from here (the kernel loaded, so
        # its first batch's milliseconds of loading are not the path's). Sized by the first
        # block times the rows, as the sum is not taken before a launch.
        size, figures = int(rows[0, 2]) * len(rows), pair._figures
        if figures is None or size != pair._figures_size:
            figures = pair._figures = self._paths.bucket(LaneKey(device, Direction(pair._direction)), size, batch=True)
            pair._figures_size = size
        t0 = time.perf_counter()
        path = self._paths.choose_in(figures, t0)
        total = (
            self._dma_batch(pair, rows, stream) if path is Path.DMA else self._kernel_batch(kernel, pair, rows, stream)
        )
        t1 = time.perf_counter()
        self._paths.observe_in(figures, path, t1 - t0, t1)
        return total

    def path_estimates(self) -> list[PathEstimate]:
        """The figures behind each batch's choice of the copy kernel ("express") or batched DMA
        ("dma"), per GPU, direction and size bucket, in microseconds, and how often each was chosen."""
        return self._paths.estimates()

    def _dma_batch(self, pair: DirectPair, rows: memoryview, stream: Any) -> int:
        """A batch by ``cuMemcpyBatchAsync`` (or a loop of copies where the driver has none):
        checked, enqueued, waited for; the sum of its sizes taken while it runs."""
        bases = pair._bases
        if bases is None:
            bases = pair._bases = np.array([[pair.dst], [pair.src], [0]], dtype=np.uint64)
        pointers = direct_pointers(rows, pair.dst, pair.dst_bytes, pair.src, pair.src_bytes, bases)
        if self._batched is None:
            from priod.common.cuda.batched import (
                BatchedDma,  # the daemon's batched DMA helper: common.cuda.driver only, no engine state
            )

            self._batched = BatchedDma()
        self._batched.copy_pointers(pointers, self._default, stream)
        total = int(np.add.reduce(pointers[2]))
        self._wait(stream)
        return total

    def _kernel_batch(self, kernel: _BatchKernel, pair: DirectPair, rows: memoryview, stream: Any) -> int:
        """A batch by the copy kernel: checked by it where one launch takes the table, else here first."""
        if kernel.checked_function is not None and len(rows) <= kernel.table_max:
            word = kernel.launch_checked(
                pair.on_device[0], pair.on_device[1], rows, pair.dst_bytes, pair.src_bytes, stream
            )
            if word is not None:
                total = int(np.asarray(rows)[:, 2].sum())  # while the kernel runs; a bad table's may be anything
                self._wait(stream)  # should it raise, the word stays taken: the kernel may yet write it
                bad = kernel.fault(word)
                if bad:
                    direct_table(rows, pair.dst_bytes, pair.src_bytes)  # raises, saying what is wrong
                    raise InvalidRequest(
                        f"segment {bad - 1} does not fit the buffers or copies 0 bytes; nothing was copied"
                    )
                return total
        cells, total, largest = direct_table(rows, pair.dst_bytes, pair.src_bytes)
        kernel.launch(pair.on_device[0], pair.on_device[1], cells, largest, stream)
        self._wait(stream)
        return total

    def _kernel(self, device: int) -> _BatchKernel | None:
        """The copy kernel in this process's context on ``device`` (current), loaded on first
        use; None where it cannot load (an older driver than the PTX: batches go by DMA)."""
        if device in self._kernels:
            return self._kernels[device]
        with self._lock:
            if device not in self._kernels:
                self._kernels[device] = _BatchKernel.load(device)
            kernel: _BatchKernel | None = self._kernels[device]
        return kernel

    def _wait(self, stream: Any) -> None:
        query, ok, not_ready = self._rt.cudaStreamQuery, self._ok, self._not_ready
        give_up = time.perf_counter() + self.spin_s
        while True:
            (err,) = query(stream)
            if err is ok:
                return
            if err is not not_ready:
                check((err,))
            if time.perf_counter() > give_up:
                check(self._rt.cudaStreamSynchronize(stream))
                return
            # The daemon this copy's hold doorbell woke may be queued on this CPU, and it closes
            # the lane's gate: yield it the CPU between polls (`BlockingFramedSocket.receive_or_wake`).
            os.sched_yield()

    def _lane_of(self, dst: int, src: int) -> tuple[int, str, tuple[int, int]]:
        """(GPU ordinal here, direction, (dst, src) as the GPU addresses them) of a copy from
        ``src`` to ``dst``."""
        rt = self._rt
        kinds = rt.cudaMemoryType
        a_dst, a_src = check(rt.cudaPointerGetAttributes(dst)), check(rt.cudaPointerGetAttributes(src))
        on_device = (_device_address(a_dst), _device_address(a_src))
        if a_src.type == kinds.cudaMemoryTypeHost and a_dst.type == kinds.cudaMemoryTypeDevice:
            return int(a_dst.device), "h2d", on_device
        if a_src.type == kinds.cudaMemoryTypeDevice and a_dst.type == kinds.cudaMemoryTypeHost:
            return int(a_src.device), "d2h", on_device
        if kinds.cudaMemoryTypeUnregistered in (a_src.type, a_dst.type):
            raise InvalidRequest(
                "a direct copy needs pinned host memory (tensor.pin_memory(), cudaHostAlloc or cudaHostRegister): "
                "pageable memory would make it synchronous; or copy through the daemon (Client.copy)"
            )
        raise InvalidRequest(
            "a direct copy goes between pinned host memory and device memory; copy other pairs through the daemon (Client.copy)"
        )

    def _stream(self, device: int) -> Any:
        """This GPU's urgent stream, made on first use (the caller has made the GPU current)."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                rt = self._rt
                _, greatest = check(rt.cudaDeviceGetStreamPriorityRange())
                stream = self._streams[device] = check(
                    rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest)
                )
        return stream

    def close(self) -> None:
        """Destroy the streams (after the last copy); the page stays the caller's."""
        for device, stream in list(self._streams.items()):
            with DeviceScope(device):
                self._rt.cudaStreamDestroy(stream)
                kernel = self._kernels.pop(device, None)
                if kernel is not None:
                    kernel.unload()
        self._streams.clear()
