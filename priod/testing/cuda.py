"""A fake CUDA for tests on any machine: stand-ins for cuda.bindings' ``runtime`` and
``driver`` modules that answer what the test scripts and record every call.

priod reaches CUDA only through `priod.common.cuda.driver` (its `bindings`, `check`,
`status_codes`), so a `FakeCuda` installed there with `use_bindings` answers the engine, the
client's CUDA IPC helpers and its direct copies alike, and a test touches no private name::

    with FakeCuda(device_count=2) as cuda:
        rt = cuda.runtime
        rt.script(cudaMalloc=lambda nbytes: rt.ok(0x1000 * (cuda.device + 1)))
        rt.script(cudaFree=rt.ok())
        ...  # code under test
        assert [c.device for c in cuda.calls_to("cudaMalloc")] == [0, 1]

A result is what cuda-python returns, ``(status, value...)``: scripted as a tuple (returned for
every call) or a callable (given the call's arguments, returns the tuple). `FakeApi.ok` builds a
success; errors are members of `RuntimeStatus` (``cudaError_t``) and `DriverStatus`
(``CUresult``), IntEnums with the real numbers, so `priod.common.cuda.driver.check` raises
`CudaError` named after them (the fake has no explanations: the message is the bare name). A
call neither scripted nor a default is missing (AttributeError), as one that older bindings
lack is.

Defaults, each replaceable by `FakeApi.script`: the current device (`FakeCuda.device`, set by
``cudaSetDevice``, read by ``cudaGetDevice``) and the count (``cudaGetDeviceCount``,
``cuDeviceGetCount``; `FakeCuda.device_count`), ``cuInit``, ``cudaGetLastError`` and the
error-naming calls; and the attributes ``cudaError_t``, ``CUresult``, ``cudaMemcpyKind``, the
IPC handle types (`FakeHandle`) and a few flags with their real values. `FakeApi.set` adds
other attributes (enums, structs) a test needs.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

from priod.common.cuda.driver import BindingsOverride, use_bindings

__all__ = ["DriverStatus", "FakeApi", "FakeCall", "FakeCuda", "FakeHandle", "MemcpyKind", "Result", "RuntimeStatus"]


class RuntimeStatus(enum.IntEnum):
    """The fake runtime's ``cudaError_t``: some of the real codes, with their numbers."""

    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101
    cudaErrorPeerAccessUnsupported = 217
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600
    cudaErrorIllegalAddress = 700
    cudaErrorPeerAccessAlreadyEnabled = 704
    cudaErrorPeerAccessNotEnabled = 705
    cudaErrorSetOnActiveProcess = 708
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorNotSupported = 801
    cudaErrorUnknown = 999


class DriverStatus(enum.IntEnum):
    """The fake driver's ``CUresult``: some of the real codes, with their numbers (``CUresult(n)``
    turns a C entry point's int into one, as priod's batched call does)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class MemcpyKind(enum.IntEnum):
    """The fake runtime's ``cudaMemcpyKind``."""

    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


_RUNTIME_FLAGS: dict[str, int] = {
    "cudaStreamNonBlocking": 1,
    "cudaEventDisableTiming": 2,
    "cudaEventInterprocess": 4,
    "cudaIpcMemLazyEnablePeerAccess": 1,
    "cudaHostRegisterPortable": 1,
    "cudaHostRegisterMapped": 2,
    "cudaHostAllocPortable": 1,
    "cudaHostAllocMapped": 2,
    "cudaDeviceScheduleSpin": 1,
    "cudaDeviceMapHost": 8,
}
"""Flags of cuda.bindings.runtime, with the real values."""


class FakeHandle:
    """A cuda-python handle struct (``cudaIpcMemHandle_t``, ``cudaIpcEventHandle_t``,
    ``CUmemPoolPtrExportData``): bytes at the address ``getPtr`` gives, which is how priod reads
    and writes them (`handle_to_bytes`, `handle_from_bytes`). ``bytes(handle)`` reads them here."""

    def __init__(self, data: bytes = bytes(64)) -> None:
        self._buffer = ctypes.create_string_buffer(data, len(data))

    def getPtr(self) -> int:  # cuda.bindings' name
        return ctypes.addressof(self._buffer)

    def __bytes__(self) -> bytes:
        return self._buffer.raw

    def __repr__(self) -> str:
        return f"FakeHandle({bytes(self)!r})"


class FakeCall(NamedTuple):
    """One call the fake answered: its name, positional arguments, and `FakeCuda.device` when it
    was made (a call before a ``cudaSetDevice`` sees the device that was current)."""

    name: str
    args: tuple[Any, ...]
    device: int


Result: TypeAlias = tuple[Any, ...] | Callable[..., tuple[Any, ...]]
"""A scripted answer: the ``(status, value...)`` tuple itself, or a callable making it from the
call's arguments."""


class FakeApi:
    """One fake module, ``runtime`` or ``driver`` of a `FakeCuda`. Its calls are the names
    scripted (`script`); its other attributes those `set`. Every call is recorded in the
    `FakeCuda`'s ``calls``."""

    def __init__(self, cuda: FakeCuda, success: enum.IntEnum) -> None:
        self._cuda = cuda
        self._results: dict[str, Result] = {}
        self.success = success
        """The success status (``cudaSuccess`` or ``CUDA_SUCCESS``), the one `check` accepts."""

    def ok(self, *values: Any) -> tuple[Any, ...]:
        """A success result carrying ``values``: ``(success, *values)``."""
        return (self.success, *values)

    def script(self, **results: Result) -> None:
        """Answer each call named with its result (a tuple, or a callable making one from the
        call's arguments), replacing what answered before."""
        for name, result in results.items():
            if not (isinstance(result, tuple) or callable(result)):
                raise TypeError(
                    f"{name}: a result is a (status, value...) tuple or a callable returning one, not {result!r}"
                )
            self._results[name] = result

    def set(self, **attributes: Any) -> None:
        """Give this module non-call attributes: enums, struct types, constants."""
        for name, value in attributes.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._results:
            raise AttributeError(
                f"the fake CUDA has no {name} (script it: FakeCuda.runtime or .driver .script({name}=...))"
            )

        def call(*args: Any) -> tuple[Any, ...]:
            cuda = self._cuda
            cuda.calls.append(FakeCall(name, args, cuda.device))
            result = self._results[name]
            return result if isinstance(result, tuple) else result(*args)

        call.__name__ = name
        return call


def _code_name(err: Any) -> bytes:
    return str(getattr(err, "name", err)).encode()


class FakeCuda:
    """Fake cuda.bindings ``runtime`` and ``driver`` (`FakeApi`), with ``device_count`` GPUs,
    device 0 current. ``with FakeCuda() as cuda:`` puts them in place of the bindings for the
    block (`install` for code that restores by itself); ``calls`` lists every call made."""

    def __init__(self, device_count: int = 1) -> None:
        self.device_count = device_count
        """What ``cudaGetDeviceCount`` and ``cuDeviceGetCount`` answer."""
        self.device = 0
        """The current device: ``cudaSetDevice`` sets it, ``cudaGetDevice`` answers it (any
        ordinal is taken: script ``cudaSetDevice`` to refuse some)."""
        self.calls: list[FakeCall] = []
        """Every call either module answered, in order."""
        self._overrides: list[BindingsOverride] = []
        self.runtime = rt = FakeApi(self, RuntimeStatus.cudaSuccess)
        self.driver = drv = FakeApi(self, DriverStatus.CUDA_SUCCESS)
        rt.set(
            cudaError_t=RuntimeStatus,
            cudaMemcpyKind=MemcpyKind,
            cudaIpcMemHandle_t=FakeHandle,
            cudaIpcEventHandle_t=FakeHandle,
            **_RUNTIME_FLAGS,
        )
        drv.set(CUresult=DriverStatus, CUmemPoolPtrExportData=FakeHandle)
        rt.script(
            cudaGetDeviceCount=lambda: rt.ok(self.device_count),
            cudaGetDevice=lambda: rt.ok(self.device),
            cudaSetDevice=self._set_device,
            cudaGetLastError=rt.ok(),
            cudaGetErrorName=lambda err: rt.ok(_code_name(err)),
            cudaGetErrorString=lambda err: rt.ok(b""),
        )
        drv.script(
            cuInit=drv.ok(),
            cuDeviceGetCount=lambda: drv.ok(self.device_count),
            cuGetErrorName=lambda err: drv.ok(_code_name(err)),
            cuGetErrorString=lambda err: drv.ok(b""),
        )

    def _set_device(self, device: int) -> tuple[Any, ...]:
        self.device = device
        return self.runtime.ok()

    def calls_to(self, name: str) -> list[FakeCall]:
        """The calls of ``name``, in order."""
        return [c for c in self.calls if c.name == name]

    def names(self) -> list[str]:
        """The names of the calls made, in order."""
        return [c.name for c in self.calls]

    def install(self) -> BindingsOverride:
        """Put this fake in place of the bindings now (`use_bindings`); restore the returned
        override to put back what was there."""
        return use_bindings(self.runtime, self.driver)

    def __enter__(self) -> FakeCuda:
        self._overrides.append(self.install())
        return self

    def __exit__(self, *exc: object) -> None:
        self._overrides.pop().restore()
