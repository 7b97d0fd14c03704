"""The wire form of the events a copy may name for GPU-side ordering (``wait_event``,
``signal_event``; docs/protocol.md), shared by the client library and the daemon.

On the cuda engine a handle is the 64 bytes of a ``cudaIpcEventHandle_t``. The sim engine has
no CUDA, so its "event" is one byte of a device region the client allocated (a memfd both sides
map): 0 while work recorded before it is pending, nonzero once it has completed. Its handle is
64 bytes too, ``PRIODSIM``, the region id and the byte's offset (little-endian uint64 each),
then zeros; `SimEvent` makes one and plays the client's side of it.

Pure: no I/O, no CUDA; imports nothing of priod's but the errors.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from priod.errors import InvalidRequest

__all__ = ["HANDLE_BYTES", "SIM_MAGIC", "SimEvent", "check_handle", "event_handle", "parse_sim_handle", "sim_handle"]

HANDLE_BYTES = 64
"""``sizeof(cudaIpcEventHandle_t)``; sim handles are as long, so every check is the same."""
SIM_MAGIC = b"PRIODSIM"
_SIM = struct.Struct("<8sQQ")


def check_handle(name: str, value: bytes | None) -> None:
    """Refuse (InvalidRequest, naming the fix) an event handle of the wrong length."""
    if value is not None and len(value) != HANDLE_BYTES:
        raise InvalidRequest(
            f"{name} holds {len(value)} bytes; send the {HANDLE_BYTES} bytes of a cudaIpcEventHandle_t "
            "(cudaIpcGetEventHandle of an event made with cudaEventInterprocess | cudaEventDisableTiming; "
            "priod.client.cuda_ipc.ipc_event() makes one, torch.cuda.Event(interprocess=True).ipc_handle() gives one)"
        )


def sim_handle(region: int, offset: int) -> bytes:
    """The handle of a sim event: byte ``offset`` of device region ``region``."""
    return _SIM.pack(SIM_MAGIC, region, offset).ljust(HANDLE_BYTES, b"\0")


def parse_sim_handle(handle: bytes) -> tuple[int, int]:
    """``(region, offset)`` of a sim event handle; InvalidRequest if it is not one."""
    if len(handle) != HANDLE_BYTES or not handle.startswith(SIM_MAGIC) or any(handle[_SIM.size :]):
        raise InvalidRequest(
            "this is not a sim event handle: the sim engine takes events made by priod.wire.ipc_event.SimEvent "
            "(a byte of one of your device regions), not CUDA IPC handles"
        )
    _, region, offset = _SIM.unpack_from(handle)
    return region, offset


class _HasHandle(Protocol):
    def ipc_handle(self) -> Any: ...


def event_handle(event: bytes | bytearray | memoryview | _HasHandle | Any) -> bytes:
    """The 64 handle bytes of whatever names an event: the bytes themselves, a
    ``torch.cuda.Event(interprocess=True)`` (its ``ipc_handle()``), or an object with a
    ``handle`` attribute (`priod.client.cuda_ipc.CudaIpcEvent`, `SimEvent`)."""
    if isinstance(event, (bytes, bytearray, memoryview)):
        raw = bytes(event)
    elif hasattr(event, "ipc_handle"):
        raw = bytes(event.ipc_handle())
    elif hasattr(event, "handle"):
        raw = bytes(event.handle)
    else:
        raise TypeError(
            f"{type(event).__name__} does not name an event: pass handle bytes, a torch.cuda.Event(interprocess=True), "
            "priod.client.cuda_ipc.ipc_event() or a priod.wire.ipc_event.SimEvent"
        )
    check_handle("the event handle", raw)
    return raw


class _SimRegion(Protocol):
    id: int
    device: int | None
    array: npt.NDArray[np.uint8] | None


class SimEvent:
    """A sim engine event: byte ``offset`` of a device region of yours (``alloc_device`` under
    sim maps it). Pass it as ``wait_event`` or ``signal_event``.

    `record` marks it pending (as recording a CUDA event behind unfinished work does) and
    `complete` marks that work done; the daemon does the same with a ``signal_event``, setting
    it on the copy engine's thread right after the copy's last byte has landed.
    """

    def __init__(self, region: _SimRegion, offset: int = 0) -> None:
        if region.array is None or region.device is None:
            raise ValueError(
                "a sim event lives in a device region allocated under the sim engine (its .array is mapped)"
            )
        if not 0 <= offset < len(region.array):
            raise ValueError(f"offset {offset} is outside the region's {len(region.array)} bytes")
        self._flag = region.array[offset : offset + 1]
        self.handle = sim_handle(region.id, offset)

    def record(self) -> None:
        """Pending: a copy waiting on it does not start."""
        self._flag[0] = 0

    def complete(self) -> None:
        """Done: a copy waiting on it may start."""
        self._flag[0] = 1

    def query(self) -> bool:
        """True once completed (by `complete`, or by the daemon after a signalled copy)."""
        return bool(self._flag[0])
