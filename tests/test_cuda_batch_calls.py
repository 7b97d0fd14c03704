"""The CUDA engine's batch calls against the fake CUDA (`priod.testing.FakeCuda`), on any machine: which driver call a
batch's chunk becomes (one cuMemcpyBatchAsync, or one cudaMemcpyAsync per segment, and why), and
how the express kernel's table form packs segments into launches. Whether the bytes land is
tests/test_gpu_batch.py's (marker gpu)."""

from __future__ import annotations

import ctypes
import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from priod.common.cuda.batched import CALL_SEGMENTS, BatchedDma
from priod.common.cuda.express import TABLE_MAX, ExpressKernel
from priod.errors import CudaError
from priod.testing import FakeCuda

BATCH_PROTO = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)
"""cuMemcpyBatchAsync as CUDA 12.8 declares it: what `BatchedDma` calls through ctypes."""


class Attributes:
    """CUmemcpyAttributes: a field to set and the address `getPtr` gives the driver."""

    def __init__(self) -> None:
        self.srcAccessOrder: Any = None
        self.block = ctypes.create_string_buffer(24)

    def getPtr(self) -> int:  # cuda.bindings' name
        return ctypes.addressof(self.block)


class Bindings:
    """The fake CUDA (`FakeCuda`) as far as the batch calls go, every copy and launch logged in
    ``calls`` by a short name, beside the batched call's.

    The batched call is a real C entry point (a ctypes callback whose address
    ``cuGetProcAddress`` hands out), so the test sees the C arrays the driver would read; the
    int it returns becomes the fake's ``CUresult``, as the real one's does.
    """

    def __init__(self, version: int = 13000, batch: bool = True) -> None:
        self.cuda = FakeCuda()
        self.calls: list[tuple[Any, ...]] = []
        self.batch_result = 0
        self._entry = BATCH_PROTO(self._batch)  # kept alive while its address is out
        self.proc_lookups: list[tuple[bytes, int]] = []
        self.rt, self.drv = self.cuda.runtime, self.cuda.driver
        self.rt.script(cudaMemcpyAsync=self._call("memcpy"))
        self.drv.script(
            cuDriverGetVersion=self.drv.ok(version), cuGetProcAddress=self._lookup, cuLaunchKernel=self._call("launch")
        )
        self.drv.set(CUmemcpySrcAccessOrder=types.SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM="stream-order"))
        if batch:
            self.drv.set(CUmemcpyAttributes=Attributes)

    def _call(self, name: str) -> Any:
        def call(*args: Any) -> tuple[Any, ...]:
            self.calls.append((name, *args))
            return self.drv.ok()

        return call

    def _lookup(self, symbol: bytes, version: int, flags: int) -> tuple[Any, ...]:
        self.proc_lookups.append((symbol, version))
        return self.drv.ok(ctypes.cast(self._entry, ctypes.c_void_p).value, "found")

    def _batch(
        self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, idxs: int, nattrs: int, fail: int, stream: int
    ) -> int:
        def read(address: int, n: int) -> list[int]:
            return list((ctypes.c_uint64 * n).from_address(address))

        self.calls.append(
            (
                "batch",
                read(dsts, count),
                read(srcs, count),
                read(sizes, count),
                count,
                attrs,
                read(idxs, nattrs),
                nattrs,
                stream,
            )
        )
        return self.batch_result


@pytest.fixture
def fake() -> Iterator[Bindings]:
    b = Bindings()
    with b.cuda:
        yield b


def u64(*values: int) -> Any:
    return np.array(values, dtype=np.uint64)


def test_a_chunk_is_one_batched_call_with_stream_ordered_sources(fake: Bindings) -> None:
    """Several segments: one cuMemcpyBatchAsync with absolute addresses, sizes, one attribute
    (sources in stream order) for all; a single segment: one cudaMemcpyAsync."""
    dma = BatchedDma()
    assert dma.error is None
    assert fake.proc_lookups == [(b"cuMemcpyBatchAsync", 12080)]  # the 12.8 ABI, the one BATCH_PROTO declares
    dma.copy(1000, 5000, u64(0, 64), u64(8, 200), u64(16, 32), "h2d", 77)
    name, dsts, srcs, sizes, count, attrs, idxs, nattrs, stream = fake.calls[-1]
    assert (name, dsts, srcs, sizes, count, idxs, nattrs, stream) == (
        "batch",
        [1000, 1064],
        [5008, 5200],
        [16, 32],
        2,
        [0],
        1,
        77,
    )
    assert attrs == dma._attrs.getPtr() and dma._attrs.srcAccessOrder == "stream-order"
    # offsets that are strided views (columns of an (N, 3) table) reach the driver as the right values
    table = np.array([[0, 8, 16], [64, 200, 32]], dtype=np.uint64)
    dma.copy(1000, 5000, table[:, 0], table[:, 1], table[:, 2], "h2d", 77)
    assert fake.calls[-1][1:4] == ([1000, 1064], [5008, 5200], [16, 32])
    dma.copy(1000, 5000, u64(3), u64(4), u64(5), "h2d", 77)
    assert fake.calls[-1] == ("memcpy", 1003, 5004, 5, "h2d", 77)


def test_a_long_chunk_is_enqueued_in_calls_of_call_segments(fake: Bindings) -> None:
    """150 segments: calls of 64, 64 and 22 (the copy engine starts on the first 64 while the
    rest is enqueued), each with its own slice of the arrays, every segment once, in order."""
    dma = BatchedDma()
    n = 150
    dst_offsets = np.arange(n, dtype=np.uint64) * np.uint64(4096)
    src_offsets = dst_offsets[::-1].copy()
    sizes = np.arange(1, n + 1, dtype=np.uint64)
    dma.copy(10_000, 20_000, dst_offsets, src_offsets, sizes, "h2d", 5)
    calls = [c for c in fake.calls if c[0] == "batch"]
    assert [c[4] for c in calls] == [CALL_SEGMENTS, CALL_SEGMENTS, n - 2 * CALL_SEGMENTS]
    assert [v for c in calls for v in c[1]] == (dst_offsets + 10_000).tolist()
    assert [v for c in calls for v in c[2]] == (src_offsets + 20_000).tolist()
    assert [v for c in calls for v in c[3]] == sizes.tolist()


def test_a_gated_chunk_waits_on_its_gate_before_every_call(fake: Bindings) -> None:
    """A gated bulk chunk: what ``each_call`` enqueues (the gate's wait) comes before each
    batched call of ``call_segments``, so a gate closed mid-chunk stops it at its next call;
    segment by segment (no batched call), once before the copies."""
    dma = BatchedDma()
    n = 300

    def wait() -> None:
        fake.calls.append(("wait",))

    offsets = np.arange(n, dtype=np.uint64) * np.uint64(65536)
    dma.copy(
        0, 1 << 30, offsets, offsets, np.full(n, 65536, dtype=np.uint64), "h2d", 5, each_call=wait, call_segments=128
    )
    assert [(c[0], c[4]) if c[0] == "batch" else (c[0],) for c in fake.calls] == [
        ("wait",),
        ("batch", 128),
        ("wait",),
        ("batch", 128),
        ("wait",),
        ("batch", 44),
    ]
    fake.calls.clear()
    dma.error = "no batched call here"
    dma.copy(0, 1 << 30, u64(0, 4096), u64(0, 4096), u64(16, 16), "h2d", 5, each_call=wait)
    assert [c[0] for c in fake.calls] == ["wait", "memcpy", "memcpy"]


@pytest.mark.parametrize(
    ("version", "batch", "why"),
    [
        (12060, True, r"driver supports CUDA 12\.6; cuMemcpyBatchAsync needs 12\.8"),
        (13000, False, r"cuda-bindings has no cuMemcpyBatchAsync .*>= 12\.8"),
    ],
    ids=["old-driver", "old-bindings"],
)
def test_without_the_api_each_segment_is_one_copy_and_it_says_why(version: int, batch: bool, why: str) -> None:
    """An old driver or old bindings: the same bytes go as one cudaMemcpyAsync per segment, and
    `error` names what to upgrade."""
    b = Bindings(version, batch)
    with b.cuda:
        dma = BatchedDma()
        assert dma.error is not None and re.search(why, dma.error)
        dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    assert b.calls == [("memcpy", 0, 101, 3, "k", "s"), ("memcpy", 50, 102, 4, "k", "s")]


def test_a_first_failure_falls_back_for_good_a_later_one_is_the_copy_s(fake: Bindings) -> None:
    """The driver refusing the first batched call means the platform lacks it: that chunk and
    every later one go segment by segment. Once a batched call has worked, a failure is the
    copy's own and is raised."""
    fake.batch_result = 801  # CUDA_ERROR_NOT_SUPPORTED
    dma = BatchedDma()
    dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", 9)
    assert [c[0] for c in fake.calls] == ["batch", "memcpy", "memcpy"]
    assert dma.error is not None and "failed on first use" in dma.error and "CUDA_ERROR_NOT_SUPPORTED" in dma.error
    dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", 9)
    assert [c[0] for c in fake.calls[3:]] == ["memcpy", "memcpy"]

    fake.batch_result = 0
    proven = BatchedDma()
    proven.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", 9)
    fake.batch_result = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        proven.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", 9)
    assert proven.error is None


def test_express_table_launches_hold_256_segments_each(fake: Bindings) -> None:
    """600 segments: three launches of 256, 256 and 88 rows; the parameter block holds the two
    bases, then each launch's (dst_offset, src_offset, nbytes) rows; rows share about one wave."""
    kernel = ExpressKernel()
    dev = types.SimpleNamespace(table_function="fn", sm_count=132)
    n = 600
    seen: list[Any] = []
    original = kernel._cu_launch

    def launch(*args: Any) -> Any:
        seen.append(np.ctypeslib.as_array(kernel._table).copy())
        return original(*args)

    kernel._cu_launch = launch
    cells = np.stack((u64(*range(0, n * 100, 100)), u64(*range(0, n * 7, 7)), u64(*([70_000] * n))), axis=1)
    kernel.launch_table(dev, 1 << 40, 1 << 41, cells, "stream")
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert [c[3] for c in launches] == [256, 256, 88]  # grid y: one row per segment
    # 70,000 bytes a row: 1,094 threads of four 16-byte steps, two 1024-thread blocks a row,
    # within the wave (132 SMs x 2 blocks): one a row for 256 rows, two for 88.
    assert all(c[1] == "fn" and c[5] == 1024 and c[9] == "stream" for c in launches)
    assert [c[2] for c in launches] == [1, 1, 2]
    assert seen[0][0] == 1 << 41 and seen[0][1] == 1 << 40  # src base, then dst base
    rows = seen[2][2 : 2 + 3 * 88].reshape(88, 3)
    assert rows[0].tolist() == [512 * 100, 512 * 7, 70_000] and rows[-1].tolist() == [599 * 100, 599 * 7, 70_000]
    assert TABLE_MAX == 256

    # With a side stream, every other launch goes there (two tables at once); same tables.
    fake.calls.clear()
    seen.clear()
    kernel.launch_table(dev, 1 << 40, 1 << 41, cells, "stream", "side")
    assert [c[9] for c in fake.calls if c[0] == "launch"] == ["stream", "side", "stream"]
    assert seen[2][2 : 2 + 3 * 88].reshape(88, 3)[-1].tolist() == [599 * 100, 599 * 7, 70_000]

    # A caller that knows the largest segment passes it: it sizes the grid, as the rows would.
    fake.calls.clear()
    kernel.launch_table(dev, 1 << 40, 1 << 41, cells, "stream", largest=4096)
    assert {c[5] for c in fake.calls if c[0] == "launch"} == {64}  # 4 KiB: 64 threads of four 16-byte steps


def test_express_without_the_table_kernel_launches_per_segment(fake: Bindings) -> None:
    """A module without priod_copy_table (an older PTX): one priod_copy launch per segment."""
    kernel = ExpressKernel()
    dev = types.SimpleNamespace(table_function=None, function="one", sm_count=132)
    kernel.launch_table(dev, 1000, 2000, np.stack((u64(0, 10), u64(5, 6), u64(3, 4)), axis=1), "s")
    assert [(c[0], c[1]) for c in fake.calls] == [("launch", "one"), ("launch", "one")]


def test_a_direct_table_the_kernel_checks_rides_whole_in_its_parameters(fake: Bindings) -> None:
    """A direct batch's table of one launch goes to priod_copy_table_checked with its bytes as
    they came (a negative int64 offset reads as 2**63 or more, which the kernel refuses), the
    two buffers' sizes and a fault word of its own, the grid sized by the first row; the word comes back with `fault`, also when
    the launch fails, and with every word in use the batch is left to the host's checks."""
    from priod.client.direct import FAULT_WORDS, _BatchKernel, direct_rows
    from priod.common.cuda.express import CHECKED_TABLE_HEADER

    fake.drv.set(CUstream=lambda handle: ("cu", handle))
    kernel = _BatchKernel(0, 132)
    kernel.checked_function = "checked"
    words = (ctypes.c_uint64 * FAULT_WORDS)()
    kernel._faults, kernel._faults_on_gpu, kernel._free_faults = words, 1 << 44, list(range(FAULT_WORDS))
    seen: list[Any] = []
    original = kernel._launch

    def launch(*args: Any) -> Any:
        seen.append(np.frombuffer(bytes(kernel._checked_buf), dtype=np.uint64))
        return original(*args)

    kernel._launch = launch
    table = np.array([[0, 64, 4096], [8192, -16, 4096]], dtype=np.int64)
    word = kernel.launch_checked(1 << 40, 1 << 41, direct_rows(table), 5000, 6000, 77)
    assert word is not None and word not in kernel._free_faults
    head, rows = seen[0][:CHECKED_TABLE_HEADER], seen[0][CHECKED_TABLE_HEADER : CHECKED_TABLE_HEADER + 6]
    assert head.tolist() == [
        1 << 41,
        1 << 40,
        6000,
        5000,
        (1 << 44) + 8 * word,
    ]  # src, dst, src_bytes, dst_bytes, fault
    assert rows.tolist() == [0, 64, 4096, 8192, 2**64 - 16, 4096]
    _, function, per_row, grid_rows, _, threads, _, _, _, stream, _, _ = fake.calls[-1]
    # 4 KiB rows: 64 threads of four 16-byte steps, one block a row, a row per segment.
    assert (function, per_row, grid_rows, threads, stream) == ("checked", 1, 2, 64, ("cu", 77))
    words[word] = 2  # what the kernel writes for a bad row 1
    assert kernel.fault(word) == 2 and word in kernel._free_faults

    def fails(*args: Any) -> Any:
        raise CudaError("cuLaunchKernel failed")

    rows = direct_rows(table)
    kernel._launch = fails
    with pytest.raises(CudaError):
        kernel.launch_checked(1 << 40, 1 << 41, rows, 5000, 6000, 77)
    assert len(kernel._free_faults) == FAULT_WORDS
    kernel._launch = original
    taken = [kernel.launch_checked(1 << 40, 1 << 41, rows, 5000, 6000, 77) for _ in range(FAULT_WORDS)]
    assert None not in taken and kernel.launch_checked(1 << 40, 1 << 41, rows, 5000, 6000, 77) is None
    first = taken[0]
    assert first is not None
    kernel.fault(first)
    assert kernel.launch_checked(1 << 40, 1 << 41, rows, 5000, 6000, 77) == first
