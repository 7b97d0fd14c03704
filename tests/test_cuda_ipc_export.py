"""The client's CUDA IPC export (priod.cuda_ipc) against a fake driver, so it runs without a GPU:
a caching allocator's piece of a segment is named by the segment's handle and its offset, and
memory CUDA IPC cannot share is refused with the allocator setting to change."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

import priod.cuda_ipc as cuda_ipc
from priod.cuda_ipc import POOL_HINT, VMM_HINT, _unshareable, export_device_buffer
from priod.errors import CudaError, EngineError


class _FakeDriver:
    """cuPointerGetAttribute answers as a driver would for one kind of memory."""

    def __init__(self, capable: bool, pool: int | None) -> None:
        self.CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE="ipc", CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE="pool")
        self.capable, self.pool = capable, pool

    def cuPointerGetAttribute(self, attr: str, pointer: int) -> tuple[Any, Any]:
        from priod.engines.cuda import _driver

        ok = _driver._DRV_OK
        if attr == "ipc":
            return (ok, self.capable)
        if self.pool is None:
            raise CudaError("CUDA_ERROR_INVALID_VALUE", "not a pool allocation")
        return (ok, self.pool)


@pytest.mark.parametrize(
    ("capable", "pool", "hint"),
    [(True, None, None), (False, 0xABC, POOL_HINT), (False, 0, VMM_HINT), (False, None, VMM_HINT)],
    ids=["cudaMalloc", "cudaMallocAsync-pool", "cuMemCreate", "cuMemCreate-no-pool-attribute"],
)
def test_unshareable_memory_names_the_setting_to_change(monkeypatch: pytest.MonkeyPatch, capable: bool, pool: int | None, hint: str | None) -> None:
    """Memory CUDA IPC cannot share is told apart before the handle call: pools point at
    PyTorch's allocator backend, cuMemCreate memory at expandable_segments:False."""
    from priod.engines.cuda import _driver

    monkeypatch.setattr(_driver, "_DRV_OK", object())
    monkeypatch.setattr(_driver, "_RT_OK", object())
    assert _unshareable(_FakeDriver(capable, pool), 0x1000) == hint
    assert "expandable_segments:False" in VMM_HINT and "backend:cudaMallocAsync" in POOL_HINT and "Region.torch()" in VMM_HINT


class _FakeCuda:
    """Runtime and driver as a caching allocator's segment looks to them: ``base`` .. ``base +
    size``, IPC-capable or not, and a handle call that may fail."""

    OK = object()
    BAD = SimpleNamespace(name="cudaErrorInvalidValue")

    def __init__(self, base: int, size: int, capable: bool, handle_ok: bool = True) -> None:
        self.base, self.size, self.capable, self.handle_ok = base, size, capable, handle_ok
        self.CUpointer_attribute = SimpleNamespace(
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL="ordinal", CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE="ipc", CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE="pool"
        )
        self.handle_of: int | None = None

    def cuInit(self, flags: int) -> tuple[Any]:
        return (self.OK,)

    def cuPointerGetAttribute(self, attr: str, pointer: int) -> tuple[Any, Any]:
        assert self.base <= pointer < self.base + self.size
        return (self.OK, {"ordinal": 0, "ipc": self.capable, "pool": 0}[attr])

    def cuMemGetAddressRange(self, pointer: int) -> tuple[Any, int, int]:
        return (self.OK, self.base, self.size)

    def cudaIpcGetMemHandle(self, base: int) -> tuple[Any, Any]:
        self.handle_of = base
        return (self.OK, b"h" * 64) if self.handle_ok else (self.BAD, None)


class _Cai:
    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "strides": None, "version": 3}


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """cuda_ipc's driver calls answered by a `_FakeCuda` (set its fields in the test)."""
    from priod.engines.cuda import _driver

    fake = _FakeCuda(0x7F0000000000, 2 << 20, True)
    monkeypatch.setattr(_driver, "_RT_OK", fake.OK)
    monkeypatch.setattr(_driver, "_DRV_OK", fake.OK)
    monkeypatch.setattr(_driver, "_rt", SimpleNamespace(cudaError_t=type(None)))
    monkeypatch.setattr(cuda_ipc, "bindings", lambda: (fake, fake))
    monkeypatch.setattr(cuda_ipc, "DeviceScope", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda_ipc, "handle_to_bytes", lambda handle: bytes(handle))
    return fake


def test_a_buffer_inside_a_segment_exports_the_segment_handle_and_its_offset(fake_cuda: Any) -> None:
    """A caching allocator's piece of a segment is described by the segment base's handle and
    the piece's offset in it (what the daemon opens once per segment)."""
    buf = export_device_buffer(_Cai(fake_cuda.base + 12288, 4096))
    assert fake_cuda.handle_of == fake_cuda.base
    assert buf == (b"h" * 64, 12288, 4096, 0, fake_cuda.base + 12288)


def test_memory_ipc_cannot_share_fails_before_the_handle_call(fake_cuda: Any) -> None:
    """Memory the driver calls not IPC-capable is refused with the setting to change, without
    asking for a handle; a handle call that fails anyway names both PyTorch settings."""
    fake_cuda.capable = False
    with pytest.raises(EngineError, match=r"^this buffer's memory cannot be registered with priod: it was mapped with cuMemCreate .*expandable_segments:False"):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
    assert fake_cuda.handle_of is None
    fake_cuda.capable, fake_cuda.handle_ok = True, False
    with pytest.raises(EngineError, match=r"^this buffer's memory cannot be registered with priod: cudaIpcGetMemHandle refused it .*expandable_segments:False.*backend:native"):
        export_device_buffer(_Cai(fake_cuda.base, 4096))
