"""`DeviceScope` against a stand-in runtime, on any machine: with one GPU visible it makes no
CUDA call at all (a direct copy's hot path; the device count is asked once per process), and
with several it makes the wanted device current and gives the caller's back."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from priod.common.cuda import driver as _driver
from priod.common.cuda.driver import DeviceScope, one_gpu

OK = "ok"


class Runtime:
    """cuda.bindings.runtime, as far as `DeviceScope` uses it; every call recorded."""

    def __init__(self, count: int, current: int = 0) -> None:
        self.count, self.current = count, current
        self.calls: list[tuple[Any, ...]] = []
        self.cudaError_t = types.SimpleNamespace(cudaSuccess=OK, cudaErrorNoDevice="no-device", cudaErrorInsufficientDriver="old-driver")

    def cudaGetDeviceCount(self) -> tuple[str, int]:
        self.calls.append(("count",))
        return OK, self.count

    def cudaGetDevice(self) -> tuple[str, int]:
        self.calls.append(("get",))
        return OK, self.current

    def cudaSetDevice(self, device: int) -> tuple[str]:
        self.calls.append(("set", device))
        self.current = device
        return (OK,)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def install(count: int) -> Runtime:
        rt = Runtime(count)
        for name, value in (("_rt", rt), ("_drv", types.SimpleNamespace()), ("_RT_OK", OK), ("_DRV_OK", object())):
            monkeypatch.setattr(_driver, name, value)
        return rt

    one_gpu.cache_clear()
    yield install
    one_gpu.cache_clear()  # the next test, or the real bindings, ask again


def test_one_gpu_scope_makes_no_call_and_counts_once(runtime: Any) -> None:
    rt = runtime(1)
    for _ in range(3):
        with DeviceScope(0):
            pass
    assert rt.calls == [("count",)]
    assert rt.current == 0


def test_several_gpus_scope_switches_and_restores(runtime: Any) -> None:
    rt = runtime(2)
    with DeviceScope(1):
        assert rt.current == 1
    assert rt.current == 0
    assert rt.calls == [("get",), ("set", 1), ("set", 0)]  # not device 0: no count asked
    rt.calls.clear()
    with DeviceScope(0):  # already current: asked, not set
        pass
    assert rt.calls == [("count",), ("get",)]


def test_one_gpu_scope_for_another_ordinal_still_asks(runtime: Any) -> None:
    """An ordinal past the only GPU is not skipped: the runtime gets to refuse it."""
    rt = runtime(1)
    with DeviceScope(1):
        pass
    assert rt.calls == [("get",), ("set", 1), ("set", 0)]
