"""`DeviceScope` against the fake CUDA (`priod.testing.FakeCuda`), on any machine: with one GPU
visible it makes no CUDA call at all (a direct copy's hot path; the device count is asked once
per process), and with several it makes the wanted device current and gives the caller's back.
Also the fake itself, and the seam it goes in by (`use_bindings`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from priod.common.cuda.driver import (
    DeviceScope,
    bindings,
    check,
    handle_from_bytes,
    handle_to_bytes,
    one_gpu,
    status_codes,
    use_bindings,
)
from priod.errors import CudaError
from priod.testing import DriverStatus, FakeCall, FakeCuda, FakeHandle, RuntimeStatus

COUNT, GET, SET = "cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice"


def made(cuda: FakeCuda) -> list[tuple[Any, ...]]:
    """The calls made, as (name, *args)."""
    return [(c.name, *c.args) for c in cuda.calls]


@pytest.fixture
def runtime() -> Iterator[Callable[[int], FakeCuda]]:
    """Installs a `FakeCuda` with that many GPUs, device 0 current, until the test ends (one_gpu's
    answer goes with it: `use_bindings` forgets it on the way in and out)."""
    with contextlib.ExitStack() as stack:
        yield lambda count: stack.enter_context(FakeCuda(device_count=count))


def test_one_gpu_scope_makes_no_call_and_counts_once(runtime: Callable[[int], FakeCuda]) -> None:
    cuda = runtime(1)
    for _ in range(3):
        with DeviceScope(0):
            pass
    assert made(cuda) == [(COUNT,)]
    assert cuda.device == 0


def test_several_gpus_scope_switches_and_restores(runtime: Callable[[int], FakeCuda]) -> None:
    cuda = runtime(2)
    with DeviceScope(1):
        assert cuda.device == 1
    assert cuda.device == 0
    assert made(cuda) == [(GET,), (SET, 1), (SET, 0)]  # not device 0: no count asked
    cuda.calls.clear()
    with DeviceScope(0):  # already current: asked, not set
        pass
    assert made(cuda) == [(COUNT,), (GET,)]


def test_one_gpu_scope_for_another_ordinal_still_asks(runtime: Callable[[int], FakeCuda]) -> None:
    """An ordinal past the only GPU is not skipped: the runtime gets to refuse it."""
    cuda = runtime(1)
    with DeviceScope(1):
        pass
    assert made(cuda) == [(GET,), (SET, 1), (SET, 0)]


# -- the fake and its seam ---------------------------------------------------------------------


def test_fake_cuda_answers_what_is_scripted_and_records_each_call() -> None:
    """Scripted results (a tuple, or a callable given the arguments) come back as cuda-python's
    do and `check` unwraps them; each call is recorded with the device current when it was made;
    an error status raises CudaError named after it, runtime or driver; a call nobody scripted is
    missing, as in bindings that lack it; a handle's bytes go through its address."""
    with FakeCuda(device_count=2) as cuda:
        rt, drv = bindings()
        assert (rt, drv) == (cuda.runtime, cuda.driver)
        assert status_codes() == (RuntimeStatus.cudaSuccess, RuntimeStatus.cudaErrorNotReady)
        cuda.runtime.script(
            cudaMalloc=lambda nbytes: cuda.runtime.ok(0x1000 * (cuda.device + 1)), cudaFree=cuda.runtime.ok()
        )
        assert check(rt.cudaMalloc(64)) == 0x1000
        check(rt.cudaSetDevice(1))
        assert (
            check(rt.cudaMalloc(32)) == 0x2000 and check(rt.cudaGetDevice()) == 1 and check(rt.cudaFree(0x2000)) is None
        )
        assert cuda.calls_to("cudaMalloc") == [FakeCall("cudaMalloc", (64,), 0), FakeCall("cudaMalloc", (32,), 1)]
        assert cuda.names() == ["cudaMalloc", "cudaSetDevice", "cudaMalloc", "cudaGetDevice", "cudaFree"]

        cuda.runtime.script(cudaMalloc=(RuntimeStatus.cudaErrorMemoryAllocation, None))
        with pytest.raises(CudaError, match=r"^cudaErrorMemoryAllocation$") as info:
            check(rt.cudaMalloc(1 << 40))
        assert info.value.name == "cudaErrorMemoryAllocation" and cuda.names()[-2:] == [
            "cudaGetErrorName",
            "cudaGetErrorString",
        ]
        cuda.driver.script(cuMemAlloc=cuda.driver.ok(7), cuMemFree=(DriverStatus.CUDA_ERROR_INVALID_VALUE,))
        assert check(drv.cuMemAlloc(8)) == 7 and check(drv.cuInit(0)) is None
        with pytest.raises(CudaError, match=r"^CUDA_ERROR_INVALID_VALUE$"):
            check(drv.cuMemFree(7))
        assert drv.CUresult(801) is DriverStatus.CUDA_ERROR_NOT_SUPPORTED

        assert not hasattr(drv, "cuMemcpyBatchAsync") and getattr(drv, "cuDeviceGetUuid_v2", None) is None
        with pytest.raises(AttributeError, match=r"no cudaMallocHost \(script it"):
            rt.cudaMallocHost(8)
        with pytest.raises(TypeError, match="a result is a"):
            cuda.runtime.script(cudaMalloc=5)  # type: ignore[arg-type]

        data = bytes(range(64))
        handle = handle_from_bytes(data)
        assert isinstance(handle, FakeHandle) and bytes(handle) == data and handle_to_bytes(handle) == data


def test_fakes_nest_and_each_restore_puts_back_what_was_before() -> None:
    """`use_bindings` puts modules in place until restored; restored in reverse order, each
    override gives back the one before, and a second restore does nothing. one_gpu asks the
    bindings in use anew."""
    with FakeCuda(device_count=1) as outer:
        assert bindings() == (outer.runtime, outer.driver) and one_gpu()
        inner = FakeCuda(device_count=2)
        override = use_bindings(inner.runtime, inner.driver)
        assert bindings() == (inner.runtime, inner.driver) and not one_gpu()
        assert status_codes()[0] is RuntimeStatus.cudaSuccess
        with FakeCuda(device_count=1) as third:
            assert bindings() == (third.runtime, third.driver) and one_gpu()
        assert bindings() == (inner.runtime, inner.driver) and not one_gpu()
        override.restore()
        override.restore()
        assert bindings() == (outer.runtime, outer.driver) and one_gpu()
        assert (
            outer.names() == ["cudaGetDeviceCount", "cudaGetDeviceCount"]
            and inner.names() == ["cudaGetDeviceCount"] * 2
        )
        with pytest.raises(ValueError, match="both modules, or neither"):
            use_bindings(inner.runtime, None)
