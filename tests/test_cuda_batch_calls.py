"""The CUDA engine's batch calls against stand-in bindings, on any machine: which driver call a
batch's chunk becomes (one cuMemcpyBatchAsync, or one cudaMemcpyAsync per segment, and why), and
how the express kernel's table form packs segments into launches. Whether the bytes land is
tests/test_gpu_batch.py's (marker gpu)."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from priod.engines.cuda import _driver
from priod.engines.cuda.batched import BatchedDma
from priod.engines.cuda.express import TABLE_MAX, ExpressKernel
from priod.errors import CudaError

OK = object()


class Bindings:
    """Stand-ins for cuda.bindings' runtime and driver modules that record every call."""

    def __init__(self, version: int = 13000, batch: bool = True) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.batch_result: Any = (OK,)
        self.rt = types.SimpleNamespace(cudaMemcpyAsync=self._call("memcpy"))
        drv: dict[str, Any] = {
            "CUdeviceptr": int,
            "cuDriverGetVersion": lambda: (OK, version),
            "CUmemcpyAttributes": types.SimpleNamespace,
            "CUmemcpySrcAccessOrder": types.SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM="stream-order"),
            "cuLaunchKernel": self._call("launch"),
        }
        if batch:
            drv["cuMemcpyBatchAsync"] = self._batch
        self.drv = types.SimpleNamespace(**drv)

    def _call(self, name: str) -> Any:
        def call(*args: Any) -> tuple[Any, ...]:
            self.calls.append((name, *args))
            return (OK,)

        return call

    def _batch(self, *args: Any) -> Any:
        self.calls.append(("batch", *args))
        return self.batch_result


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bindings]:
    b = Bindings()
    _install(monkeypatch, b)
    yield b


def _install(monkeypatch: pytest.MonkeyPatch, b: Bindings) -> None:
    for name, value in (("_rt", b.rt), ("_drv", b.drv), ("_RT_OK", OK), ("_DRV_OK", OK)):
        monkeypatch.setattr(_driver, name, value)


def u64(*values: int) -> Any:
    return np.array(values, dtype=np.uint64)


def test_a_chunk_is_one_batched_call_with_stream_ordered_sources(fake: Bindings) -> None:
    """Several segments: one cuMemcpyBatchAsync with absolute addresses, sizes, one attribute
    (sources in stream order) for all; a single segment: one cudaMemcpyAsync."""
    dma = BatchedDma()
    assert dma.error is None
    dma.copy(1000, 5000, u64(0, 64), u64(8, 200), u64(16, 32), "h2d", "stream")
    name, dsts, srcs, sizes, count, attrs, idxs, nattrs, stream = fake.calls[-1]
    assert (name, dsts, srcs, sizes, count, idxs, nattrs, stream) == ("batch", [1000, 1064], [5008, 5200], [16, 32], 2, [0], 1, "stream")
    assert attrs[0].srcAccessOrder == "stream-order"
    dma.copy(1000, 5000, u64(3), u64(4), u64(5), "h2d", "stream")
    assert fake.calls[-1] == ("memcpy", 1003, 5004, 5, "h2d", "stream")


@pytest.mark.parametrize(
    ("version", "batch", "why"),
    [(12060, True, r"driver supports CUDA 12\.6; cuMemcpyBatchAsync needs 12\.8"), (13000, False, r"cuda-bindings has no cuMemcpyBatchAsync .*>= 12\.8")],
    ids=["old-driver", "old-bindings"],
)
def test_without_the_api_each_segment_is_one_copy_and_it_says_why(monkeypatch: pytest.MonkeyPatch, version: int, batch: bool, why: str) -> None:
    """An old driver or old bindings: the same bytes go as one cudaMemcpyAsync per segment, and
    `error` names what to upgrade."""
    b = Bindings(version, batch)
    _install(monkeypatch, b)
    dma = BatchedDma()
    assert dma.error is not None and re.search(why, dma.error)
    dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    assert b.calls == [("memcpy", 0, 101, 3, "k", "s"), ("memcpy", 50, 102, 4, "k", "s")]


def test_a_first_failure_falls_back_for_good_a_later_one_is_the_copy_s(fake: Bindings) -> None:
    """The driver refusing the first batched call means the platform lacks it: that chunk and
    every later one go segment by segment. Once a batched call has worked, a failure is the
    copy's own and is raised."""
    fake.batch_result = ("CUDA_ERROR_NOT_SUPPORTED",)
    dma = BatchedDma()
    dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    assert [c[0] for c in fake.calls] == ["batch", "memcpy", "memcpy"]
    assert dma.error is not None and "failed on first use" in dma.error
    dma.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    assert [c[0] for c in fake.calls[3:]] == ["memcpy", "memcpy"]

    fake.batch_result = (OK,)
    proven = BatchedDma()
    proven.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    fake.batch_result = ("CUDA_ERROR_ILLEGAL_ADDRESS",)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        proven.copy(0, 100, u64(0, 50), u64(1, 2), u64(3, 4), "k", "s")
    assert proven.error is None


def test_express_table_launches_hold_128_segments_each(fake: Bindings) -> None:
    """300 segments: three launches of 128, 128 and 44 rows; the parameter block holds the two
    bases, then each launch's (dst_offset, src_offset, nbytes) rows; rows share about one wave."""
    kernel = ExpressKernel()
    dev = types.SimpleNamespace(table_function="fn", sm_count=132)
    n = 300
    seen: list[Any] = []
    original = kernel._cu_launch

    def launch(*args: Any) -> Any:
        seen.append(np.ctypeslib.as_array(kernel._table).copy())
        return original(*args)

    kernel._cu_launch = launch
    kernel.launch_table(dev, 1 << 40, 1 << 41, u64(*range(0, 300 * 100, 100)), u64(*range(0, 300 * 7, 7)), u64(*([70_000] * n)), "stream")  # type: ignore[arg-type]
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert [c[3] for c in launches] == [128, 128, 44]  # grid y: one row per segment
    # 70,000 bytes a row: 1,094 threads of four 16-byte steps, so two 1024-thread blocks a row.
    assert all(c[1] == "fn" and c[2] == 2 and c[5] == 1024 and c[9] == "stream" for c in launches)
    assert seen[0][0] == 1 << 41 and seen[0][1] == 1 << 40  # src base, then dst base
    rows = seen[2][2 : 2 + 3 * 44].reshape(44, 3)
    assert rows[0].tolist() == [256 * 100, 256 * 7, 70_000] and rows[-1].tolist() == [299 * 100, 299 * 7, 70_000]
    assert TABLE_MAX == 128


def test_express_without_the_table_kernel_launches_per_segment(fake: Bindings) -> None:
    """A module without priod_copy_table (an older PTX): one priod_copy launch per segment."""
    kernel = ExpressKernel()
    dev = types.SimpleNamespace(table_function=None, function="one", sm_count=132)
    kernel.launch_table(dev, 1000, 2000, u64(0, 10), u64(5, 6), u64(3, 4), "s")  # type: ignore[arg-type]
    assert [(c[0], c[1]) for c in fake.calls] == [("launch", "one"), ("launch", "one")]
