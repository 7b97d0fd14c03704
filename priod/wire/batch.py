"""Segment tables: many ``(dst_offset, src_offset, nbytes)`` copies between two regions as one.

A batched copy (``copy_batch``, docs/protocol.md) carries its segments as one msgpack ``bin``
of little-endian uint64 triples, 24 bytes a segment. They are decoded with numpy as a view of
the frame's bytes (no Python loop, no per-segment object) and checked as a unit before
anything is queued (`Segments.decode`, `Segments.check_regions`). The scheduler then sees a
batch as one request of ``total`` bytes, chunked like any copy: a chunk is a byte range of the
segments laid end to end, and `Segments.piece` gives the rows (the parts of segments) it covers,
in the wire's own row layout, which is what every engine takes.

Nothing here does I/O or knows about engines; the checks cost O(N log N) numpy work for N
segments (measured by ``tests/test_batch.py::test_largest_batch_is_checked_quickly``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from priod.errors import InvalidRequest

__all__ = [
    "LARGEST",
    "MAX_SEGMENTS",
    "MAX_SEGMENTS_PER_CHUNK",
    "ROW",
    "SEGMENT_BYTES",
    "SEGMENT_COST_S",
    "SMALLEST",
    "SMALL_BLOCK_MEAN",
    "URGENT_DMA_SEGMENTS",
    "Cells",
    "Segments",
    "column_peaks",
    "encode_segments",
]

SEGMENT_BYTES = 24
"""One segment on the wire: three little-endian uint64 (dst_offset, src_offset, nbytes)."""
MAX_SEGMENTS = 32768
"""Most segments in one batch. A frame is at most ``max_frame_bytes`` (1 MiB by default: 43,690
segments), and the checks of a batch this size take a few milliseconds of the daemon's loop
(the session ends its turn after one, so other clients are served between). A batch past it is
refused with a message saying to split it."""
SEGMENT_COST_S = 0.1e-6
"""What one segment costs a copy engine beyond its bytes, as time: each is a descriptor the
engine fetches and starts. A chunk is cut so that its bytes plus this per segment stay within
the bytes the scheduler gave it, so a chunk of many small segments takes no longer than a
contiguous chunk would: the in-flight bound (what an urgent copy waits for) keeps holding.
Measured on the H200, batches of 256 scattered 64 KiB blocks back to back against one
contiguous copy: 0.03 us a segment h2d, 0.1 us d2h (1 us, the first estimate, cut bulk chunks
of 64 KiB blocks to half the bound, and the link ran dry between them)."""
SMALL_BLOCK_MEAN = 256 << 10
"""A batch whose segments average under this many bytes is one of small blocks: the driver's
~1 us of enqueueing a segment is then a good part of its time on the link (64 KiB: as long), and
its bulk chunks run under ``batch_block_us`` (policy.py). Larger blocks keep ``max_block_us``."""
MAX_SEGMENTS_PER_CHUNK = 4096
"""Most segments one chunk covers whatever their cost: bounds one engine submission's work."""
URGENT_DMA_SEGMENTS = 256
"""Most segments one DMA chunk of an urgent batch covers. An urgent batch goes by DMA in chunks
of the lane's regular size (``max_block_us``) of at most this many segments, not in chunks of
the short bound as an urgent contiguous copy does: each chunk costs the loop its cut, its rows
and its batched calls before the engine sees it (~1.2 us a segment and tens of us a chunk), and
with the short bound's chunks (~40 blocks of 64 KiB) the engine idles between them. On the
H200, through the daemon beside a GEMM process, 256 scattered blocks of 64 KiB by DMA take
1.4-1.9 ms in short-bound chunks, 0.42 as one chunk, against 0.37 for the same bytes in one
range (see docs/design.md, Defaults). One chunk of 256 is four batched calls, the engine starting
after the first (common/cuda/batched.py), and holds the loop ~300 us; another tenant's urgent
DMA copy waits behind it at most a regular chunk's time, as behind bulk."""

_WIRE = np.dtype("<u8")
_LE_INT64 = np.dtype("<i8")
ROW = np.dtype((_WIRE, (3,)))
"""A segment as one element: ``frombuffer`` with it gives the (N, 3) table at once."""
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Cells = npt.NDArray[np.uint64]
"""An (N, 3) uint64 table, C order: row i is segment i's (dst_offset, src_offset, nbytes), as on
the wire and as the copy kernel reads it."""


LARGEST = np.maximum.reduce
"""A column's largest value, by the ufunc itself. ``ndarray.max()`` and ``min()`` first call a
Python function of numpy's (``_methods._amax``), and ``np.diff`` and ``np.sort`` are Python
functions too: on a batch's way through the daemon the loop has just woken, and each such layer
costs microseconds of cold code. With ufunc reductions, the array's own ``sort`` and a
subtraction in place of ``np.diff``, `Segments.decode` and `Segments.check_regions` of 64 to 4,096
blocks of one size take 0.65-0.73x the time on a thread just woken (H200, from taking a batch to
its first chunk: 149 against 183 us; docs/benchmarks.md)."""
SMALLEST = np.minimum.reduce


def column_peaks(cells: Cells) -> tuple[int, int, int]:
    """The largest of each column of an (N, 3) table, one reduction down each column: a
    reduction across the rows (``axis=0``) steps row by row, 160 against 90 us for 4,096
    rows on the H200's host, and was no faster for 256."""
    return int(LARGEST(cells[:, 0])), int(LARGEST(cells[:, 1])), int(LARGEST(cells[:, 2]))


def encode_segments(segments: object) -> bytes:
    """The wire form of ``segments``: an (N, 3) integer array or a sequence of triples.

    Client-side checks (shape, integer type) so that a mistake is reported before the frame is
    sent; the daemon checks everything again. A negative figure is refused here where the table
    is converted, and by the daemon for the usual int64 table, sent as it is: there it reads as
    2**63 or more, which `Segments.decode` refuses, naming negative figures.
    """
    arr = np.asarray(segments)
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise InvalidRequest(
            f"segments must be an (N, 3) array or a sequence of (dst_offset, src_offset, nbytes) triples, N >= 1; got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise InvalidRequest(f"segments must hold integers, got {arr.dtype}")
    if arr.shape[0] > MAX_SEGMENTS:
        raise InvalidRequest(
            f"{arr.shape[0]} segments exceed the {MAX_SEGMENTS} one batch may hold; split them into several batches"
        )
    if (arr.dtype == _WIRE or arr.dtype == _LE_INT64) and arr.flags.c_contiguous:
        # The usual table: its bytes are the wire's as they are (a non-negative int64 is its
        # uint64), so no converted copy first (256 rows: 6.4 against 8.0 us, 2 ms asleep
        # between calls, this VM), and no search for a negative figure: the first reduction
        # after the caller's other work costs tens of microseconds (512 rows after writing 16
        # MiB: 64 against 20 us for this function, this VM), and the daemon refuses one anyway.
        return arr.tobytes()
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise InvalidRequest("segments hold a negative offset or size; offsets are >= 0 and sizes >= 1")
    return np.ascontiguousarray(arr, dtype=_WIRE).tobytes()


@dataclass(eq=False, slots=True)
class Segments:
    """A checked segment table. Offsets are relative to the regions' starts.

    Each numpy call on a batch's way through the daemon costs ~10 us there, as the daemon's
    other work keeps numpy's code out of the CPU's caches (this VM and the H200's host alike).
    So `decode` takes the columns' largest values and the smallest size once, for the checks
    to read; a table of blocks of one size is checked for overlaps by a sort alone; and the
    cumulative sizes wait until a chunk or a partial count needs them. Taking a batch costs
    ~167 us for 256 segments and ~179 for 4,096, against 241 and 343 with a numpy call per
    step (H200; docs/benchmarks.md)."""

    cells: Cells
    """The table as it came (read-only, a view of the frame's bytes)."""
    size: U64
    """The sizes' column, a view of ``cells``."""
    peaks: tuple[int, int, int]
    """The largest destination offset, source offset and size."""
    total: int
    smallest: int
    """The smallest size: equal to the largest for blocks of one size, which `check_regions`
    checks for overlaps with fewer steps."""
    _ends: I64 | None = None

    def __len__(self) -> int:
        return len(self.size)

    @property
    def dst(self) -> U64:
        return self.cells[:, 0]

    @property
    def src(self) -> U64:
        return self.cells[:, 1]

    @property
    def ends(self) -> I64:
        """Cumulative sizes: segment i holds bytes [ends[i] - size[i], ends[i]) of the batch."""
        if self._ends is None:
            self._ends = np.cumsum(self.size, dtype=np.int64)
        return self._ends

    def small_blocks(self) -> bool:
        """Its segments average under `SMALL_BLOCK_MEAN` bytes."""
        return self.total < SMALL_BLOCK_MEAN * len(self.size)

    @classmethod
    def decode(cls, raw: bytes) -> Segments:
        """Read the wire form; raises InvalidRequest naming the fix. Region bounds come later."""
        n, rest = divmod(len(raw), SEGMENT_BYTES)
        if rest:
            raise InvalidRequest(
                f"segments holds {len(raw)} bytes, not a multiple of {SEGMENT_BYTES}: send little-endian uint64 (dst_offset, src_offset, nbytes) triples"
            )
        if n == 0:
            raise InvalidRequest("segments is empty; a batch holds at least one segment")
        if n > MAX_SEGMENTS:
            raise InvalidRequest(
                f"{n} segments exceed the {MAX_SEGMENTS} one batch may hold; split them into several batches"
            )
        table: Cells = np.frombuffer(raw, dtype=ROW)  # (n, 3) uint64: the row type makes the shape, no reshape call
        # Offsets and sizes past 2**62 cannot fit any region; refusing them here keeps every sum
        # below within int64 (and an overflowing sum cannot pass a bounds check).
        dst_max, src_max, largest = column_peaks(table)
        if max(dst_max, src_max, largest) >= 1 << 62:
            raise InvalidRequest(
                "a segment's offset or size is 2**62 or more, past any region (a negative figure sent as int64 reads so: offsets "
                "and sizes are >= 0); check the triples' order (dst_offset, src_offset, nbytes)"
            )
        size = table[:, 2]
        smallest = int(SMALLEST(size))
        if smallest == 0:
            i = int(np.argmin(size))
            raise InvalidRequest(f"segment {i} has nbytes = 0; every segment copies at least 1 byte")
        # Blocks of one size, a KV cache's: the total without a sum.
        total = n * largest if smallest == largest else int(np.add.reduce(size))
        return cls(table, size, (dst_max, src_max, largest), total, smallest)

    def check_regions(self, dst_nbytes: int, src_nbytes: int, shift: int | None, dst_id: int, src_id: int) -> None:
        """Every segment within its region; no two destination segments overlap; no
        destination segment overlaps a source segment when both regions are one memory.

        ``shift``: where source offsets lie in destination offsets' terms when the two regions
        share memory (0 for one region, the pointers' difference for two views of one device
        allocation), None when they cannot overlap. Sort-based, O(N log N), no Python loop.
        """
        # Every figure is below 2**62 (`decode`), so uint64 sums cannot wrap. The largest offset
        # plus the largest size within the region proves every segment fits (blocks of one size,
        # the usual batch); only where it does not are the segments' own ends compared.
        size = self.size
        dst_max, src_max, largest = self.peaks
        for name, column, peak, limit, rid in (
            ("dst", 0, dst_max, dst_nbytes, dst_id),
            ("src", 1, src_max, src_nbytes, src_id),
        ):
            if peak + largest <= limit:
                continue
            offs = self.cells[:, column]
            bad = np.flatnonzero(offs + size > limit)
            if bad.size:
                i = int(bad[0])
                raise InvalidRequest(
                    f"segment {i}: {name}_offset {int(offs[i])} + nbytes {int(size[i])} is outside region {rid} of {limit} bytes; "
                    "keep every segment within its region"
                )
        if shift is None and self.smallest == largest:
            starts = self.cells[:, 0].copy()
            starts.sort()
            if len(starts) == 1 or int(SMALLEST(starts[1:] - starts[:-1])) >= largest:
                return  # blocks of one size, none within a block's length of the next: no overlap
        # Not a stable sort: 4x faster on 4,096 segments (36 against 158 us), and two segments
        # with one start overlap whichever comes first.
        order = np.argsort(self.cells[:, 0])
        rows = self.cells[order]  # sorted by destination offset, one gather for both columns
        starts = rows[:, 0]
        clash = np.flatnonzero(starts[1:] - starts[:-1] < rows[:-1, 2])  # a start before the previous segment's end
        if clash.size:
            a, b = int(order[clash[0]]), int(order[clash[0] + 1])
            # The copies of a batch run in no set order (cuMemcpyBatchAsync promises none), so
            # two writes to one byte would leave either value: refused rather than undefined.
            raise InvalidRequest(
                f"destination segments {a} and {b} overlap; a batch writes each destination byte at most once"
            )
        if shift is None:
            return
        # Destination intervals are now sorted and disjoint, so their ends rise too: for each
        # source interval the last destination starting before its end is the only candidate.
        # In int64 here: a shift can be negative, and numpy compares uint64 with int64 as floats.
        starts = starts.astype(np.int64)
        stops = starts + rows[:, 2].astype(np.int64)
        s_start = self.src.astype(np.int64) + shift
        s_stop = s_start + self.size.astype(np.int64)
        k = np.searchsorted(starts, s_stop, side="left") - 1
        hit = np.flatnonzero((k >= 0) & (stops[np.maximum(k, 0)] > s_start))
        if hit.size:
            j = int(hit[0])
            raise InvalidRequest(
                f"source segment {j} overlaps destination segment {int(order[k[j]])} in the same memory; a copy engine does not "
                "copy overlapping ranges as memmove does: copy through another region"
            )

    def segments_done(self, bytes_done: int) -> int:
        """How many segments landed whole when the first ``bytes_done`` bytes of the batch did."""
        if bytes_done >= self.total:
            return len(self.size)  # a batch that finished: no cumulative sizes needed
        return int(np.searchsorted(self.ends, bytes_done, side="right"))

    def cut(self, offset: int, size: int, seg_cost: int, most: int = MAX_SEGMENTS_PER_CHUNK) -> int:
        """The bytes of the chunk that starts at batch byte ``offset`` and may cost ``size``:
        its bytes plus ``seg_cost`` per segment it touches, and at least the rest of the segment
        it starts in (up to ``size``); it touches at most ``most`` segments."""
        if offset == 0 and len(self.size) <= most and (seg_cost <= 0 or self.total + seg_cost * len(self.size) <= size):
            # The whole batch, or as much as fits of an express one, in a chunk: no numpy call
            # (the usual KV step within one chunk: 47 us of cumulative sums and searches, as the
            # first numpy calls after the client's other work, 512 rows on this VM).
            return min(size, self.total)
        ends = self.ends
        first = int(np.searchsorted(ends, offset, side="right"))
        last = min(len(ends), first + most)
        if seg_cost <= 0:
            return min(size, int(ends[last - 1]) - offset)
        # Candidate chunk ends at segment boundaries: the cost of ending after segment first+i.
        room = ends[first:last] - offset + seg_cost * np.arange(1, last - first + 1)
        whole = int(np.searchsorted(room, size, side="right"))  # segments that fit whole
        end = offset if whole == 0 else int(ends[first + whole - 1])
        if whole < last - first:
            # Part of the next segment, if the cost left allows (a chunk always moves a byte).
            spare = size - (end - offset) - seg_cost * (whole + 1)
            if spare > 0:
                end += min(spare, int(ends[first + whole]) - end)
        # At least the rest of the first segment (within ``size``): near a batch's end ``size``
        # is only what is left, which no segment cost should split into one-byte chunks.
        return max(end, min(int(ends[first]), offset + size)) - offset

    def piece(self, offset: int, nbytes: int) -> Cells:
        """The rows of batch bytes [offset, offset + nbytes): the table itself (read-only) for
        the whole batch, else a copy of the rows it touches, the first and last trimmed."""
        if offset == 0 and nbytes == self.total:
            return self.cells  # an express batch, or one chunk: no numpy call
        ends = self.ends
        first = int(np.searchsorted(ends, offset, side="right"))
        last = int(np.searchsorted(ends, offset + nbytes, side="left")) + 1
        rows = self.cells[first:last].copy()
        head = offset - (int(ends[first]) - int(rows[0, 2]))  # bytes of the first segment already sent
        if head:
            d, s, n = rows[0].tolist()
            rows[0] = (d + head, s + head, n - head)
        over = int(ends[last - 1]) - (offset + nbytes)  # bytes of the last segment left for later
        if over:
            rows[-1, 2] = int(rows[-1, 2]) - over
        return rows
