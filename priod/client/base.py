"""What both clients share: regions, copy options, the request builders and reply checks.

`client.py` (asyncio) and `sync_client.py` (blocking) speak the same protocol with the same
requests; this module builds those requests and reads what comes back, with no I/O of its own
beyond mapping a region's memory.
"""

from __future__ import annotations

import asyncio
import importlib
import mmap
import operator
import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import numpy as np
import numpy.typing as npt

from priod.client.direct import HoldPage
from priod.common.socket_path import find_socket
from priod.errors import Cancelled, ConnectionClosed, CopyTimeout, InvalidRequest, PermissionDenied, ProtocolError
from priod.wire.batch import encode_segments
from priod.wire.ipc_event import event_handle
from priod.wire.messages import (
    DEVICE_FORMS,
    PROTOCOL_VERSION,
    AllocDevice,
    Copy,
    CopyBatch,
    CopyBatchReply,
    CopyReply,
    HelloReply,
    HoldPageReply,
    Message,
    RegionReply,
    RegisterDevice,
    RegisterHost,
    Request,
    error_of,
    gpu_target,
)
from priod.wire.transport import peer_credentials

__all__ = [
    "BATCH_FRAME_SLACK",
    "BUSY_WAIT_S",
    "RECONNECT_MAX_SLEEP_S",
    "BatchOptions",
    "BatchResult",
    "CopyOptions",
    "CopyResult",
    "Region",
    "RegionsLostWarning",
    "Reply",
    "alloc_device_request",
    "batch_request",
    "check_owner",
    "check_regions",
    "check_server",
    "close_fds",
    "copy_lost",
    "copy_request",
    "cuda_register_request",
    "discover",
    "hold_page",
    "no_daemon",
    "no_permission",
    "progress",
    "raise_if_cancelled",
    "reconnect_sleep",
    "regions_lost",
    "reregister_request",
]


BUSY_WAIT_S = 0.5
"""How long a connect retries while the daemon's listen backlog is full (EAGAIN), at least:
a burst of connections fills it for a moment, and a client should not fail for that."""


CopyResult = CopyReply
"""What the daemon measured for one finished copy (microseconds, daemon clock)."""
BatchResult = CopyBatchReply
"""What the daemon measured for one finished batch: total bytes, segments, timings."""
R = TypeVar("R", CopyReply, CopyBatchReply)

BATCH_FRAME_SLACK = 256
"""Bytes of a copy_batch frame besides its segment table (header, keys, ids, class name)."""


class CopyOptions(TypedDict, total=False):
    """The optional settings of a copy (docs/protocol.md, ``copy``)."""

    dst_offset: int
    src_offset: int
    priority: str
    """A class from the daemon's ``hello`` reply; default ``normal``."""
    deadline_ms: float | None
    """Orders work within its class, earliest first; a miss is counted, not an error."""
    wait_event: Any
    """An event the copy waits for before it starts (GPU-side ordering, docs/protocol.md):
    handle bytes, a ``torch.cuda.Event(interprocess=True)``, `priod.client.cuda_ipc.ipc_event()`, or
    under sim a `priod.wire.ipc_event.SimEvent`. Record it behind your producing kernel first."""
    signal_event: Any
    """An event of yours (as for ``wait_event``) the daemon records right behind the copy: once
    the handle's ``recorded()`` returns, ``stream.wait_event`` on it orders your next kernel
    after the copy with no host synchronisation."""


class BatchOptions(TypedDict, total=False):
    """The optional settings of a batch (docs/protocol.md, ``copy_batch``)."""

    priority: str
    deadline_ms: float | None
    wait_event: Any
    """As `CopyOptions.wait_event`."""
    signal_event: Any
    """As `CopyOptions.signal_event`."""


def import_torch() -> Any:
    """PyTorch, imported on first use: ``import priod`` never needs it."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError(
            f"priod's tensor helpers need PyTorch, which is not installed ({exc}): pip install torch"
        ) from exc


class Region:
    """A host or device region this connection made. ``array`` maps it where that is possible."""

    def __init__(self, reply: RegionReply, fds: list[int], generation: int) -> None:
        self.id = reply.region
        self.nbytes = reply.nbytes
        self.kind = reply.kind
        self.device = reply.device
        """The daemon's ordinal of the region's GPU; yours may differ (CUDA_VISIBLE_DEVICES)."""
        self.device_uuid = reply.device_uuid
        """The region's GPU by UUID (``GPU-...``), the same in every process; None for host memory."""
        self.export: Message = reply.export or {}
        self.generation = generation
        self._mapping: mmap.mmap | None = None
        self.array: npt.NDArray[np.uint8] | None = None
        self._view: Any = None
        """The `CudaBuffer` that `device_view` opened (torch views of the region use it)."""
        self._held: Any = None
        """A ``register_device``'d buffer, held so its allocator cannot reuse the memory meanwhile."""
        self._held_pointer: int | None = None
        self._fd: int | None = None
        """A dup of the region's fd (a host region's memfd, a sim device region's memfd, a CUDA
        device region's ``cuMemCreate`` export), kept to register the same memory again with a
        restarted daemon: the bytes stay in it whatever the daemon does."""
        self.shared_with: set[int] = set()
        """The uids this region was shared with (`share`), shared again after a reconnect."""
        self.lost: str | None = None
        """Why this region did not come back after a daemon restart (its client reconnected
        but could not register it again); None while it is held. A lost region raises that
        reason when used."""
        if fds and self.export.get("kind") == "vmm_fd":
            # CUDA memory the daemon allocated: the fd keeps it alive, mapped on the GPU by `cuda`.
            self._fd, fds = fds[0], fds[1:]
            for fd in fds:
                os.close(fd)
        elif fds:
            try:
                self._mapping = mmap.mmap(fds[0], self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self.array = np.frombuffer(self._mapping, dtype=np.uint8)
                self._fd, fds = fds[0], fds[1:]
            finally:
                for fd in fds:
                    os.close(fd)

    def cuda(self) -> Any:
        """Open a daemon-allocated device region in this process (cuda engine only).

        Returns an object with ``__cuda_array_interface__`` (uint8, ``nbytes``): pass it to
        ``cupy.asarray`` or ``torch.as_tensor(..., device="cuda")``. Call its ``close()`` when done.
        """
        if self.export.get("kind") != "vmm_fd":
            raise InvalidRequest("this region has no CUDA export (host region, or the sim engine: use .array)")
        if self._fd is None:
            raise InvalidRequest(f"{self!r} is not held by this process any more (freed, or its connection closed)")
        from priod.client.cuda_ipc import local_ordinal, open_device_fd

        # Opened on this process's ordinal of the GPU, found by UUID: the daemon's ordinal names
        # another GPU here, or none, when CUDA_VISIBLE_DEVICES differs between the two processes.
        device = local_ordinal(self.device_uuid) if self.device_uuid else self.device or 0
        return open_device_fd(self._fd, int(self.export["size"]), int(self.export["offset"]), self.nbytes, device)

    def holding(self, obj: Any) -> Region:
        """Remember ``obj``, the client's own device buffer this region was registered from:
        tensors viewing it are then found by `priod.client.torch_face.where`, and holding it keeps a
        caching allocator (PyTorch's, CuPy's) from handing its memory out again before `free`."""
        from priod.client.cuda_ipc import device_span

        self._held, self._held_pointer = obj, device_span(obj)[0]
        return self

    def address(self, on_gpu: bool) -> int | None:
        """The region's first byte in this process, where it is mapped here: on the GPU
        (``on_gpu``: `device_view` opened, or a registered buffer) or the host (``array``)."""
        if not on_gpu:
            return None if self.array is None else int(self.array.ctypes.data)
        if self._held_pointer is not None:
            return self._held_pointer
        return None if self._view is None else int(self._view.pointer)

    def device_view(self) -> Any:
        """This region's device memory as an object with ``__cuda_array_interface__`` (uint8),
        opened once and kept until `free` (see `cuda` for one you close yourself)."""
        if self._held is not None:
            from priod.client.cuda_ipc import DeviceBytes, local_ordinal

            device = local_ordinal(self.device_uuid) if self.device_uuid else self.device or 0
            return DeviceBytes(self._held, self._held_pointer or 0, self.nbytes, device)
        if self._view is None:
            self._view = self.cuda()
        return self._view

    def torch(self, dtype: Any = None, shape: Any = None) -> Any:
        """A torch tensor viewing this region (no copy), of ``dtype`` (default ``torch.uint8``)
        and ``shape`` (default 1-D; one entry may be -1). Host regions (and sim device regions) are
        viewed through ``array``, device regions of the cuda engine through their CUDA IPC mapping
        (opened on first use, closed by ``free``), a ``register_device``'d buffer as itself. The
        region's size must be a multiple of the element size; the view is valid until the region
        is freed or its connection closed."""
        torch = import_torch()
        dtype = torch.uint8 if dtype is None else dtype
        if self.array is not None:
            flat = torch.from_numpy(self.array)
        elif self.kind == "host" or self.export.get("kind") == "memfd":
            raise InvalidRequest(f"{self!r} is not mapped in this process any more (freed, or its connection closed)")
        else:
            buf = self.device_view()
            # the buffer's own GPU: a bare "cuda" is the current device, and torch would copy to it
            flat = torch.as_tensor(buf, device=f"cuda:{buf.device}")
        size = torch.empty((), dtype=dtype).element_size()
        if self.nbytes % size:
            raise InvalidRequest(
                f"{self!r} holds {self.nbytes} bytes, not a whole number of {dtype} elements ({size} bytes each)"
            )
        view = flat.view(dtype)
        if shape is None:
            return view
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        try:
            return view.view(shape)
        except RuntimeError as exc:
            raise InvalidRequest(
                f"{self!r} as {dtype} has {view.numel()} elements, which shape {shape} does not fit: {exc}"
            ) from None

    def __dlpack__(self, **kwargs: Any) -> Any:
        """DLPack export of the region's bytes (uint8, 1-D): ``torch.from_dlpack(region)``,
        ``np.from_dlpack(region)`` for host regions."""
        if self.array is not None:
            return self.array.__dlpack__(**kwargs)
        return self.torch().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.array is not None:
            return (1, 0)  # kDLCPU
        from priod.client.cuda_ipc import local_ordinal

        return (2, local_ordinal(self.device_uuid) if self.device_uuid else self.device or 0)  # kDLCUDA

    def renew(self, reply: RegionReply, generation: int) -> None:
        """This region, registered again with a restarted daemon: the same memory, a new id."""
        self.id, self.generation, self.lost = reply.region, generation, None

    def unmap(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._held = self._held_pointer = None
        if self._view is not None:
            view, self._view = self._view, None
            view.close()
        self.array = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when that view goes
            self._mapping = None

    def __repr__(self) -> str:
        return f"<priod.Region {self.id} {self.kind} {self.nbytes} bytes>"


RECONNECT_MAX_SLEEP_S = 1.0
"""The longest sleep between two reconnect attempts (backoff doubles from 50 ms up to this, each
sleep jittered down by up to half): a restarted daemon is found within about a second."""


class RegionsLostWarning(UserWarning):
    """Warned when a reconnected client could not register some of its regions again (the
    restarted daemon's limits, or memory it cannot take back); the message lists them, each
    Region's ``lost`` says why, and using one raises that."""


def reconnect_sleep(attempt: int) -> float:
    """Seconds to sleep before reconnect attempt ``attempt`` (1, 2, ...): jittered exponential backoff."""
    return float(min(0.05 * 2.0 ** min(attempt - 1, 30), RECONNECT_MAX_SLEEP_S) * random.uniform(0.5, 1.0))


def check_server(server: HelloReply, path: str) -> HelloReply:
    """Refuse a daemon that speaks another protocol version than this library."""
    if server.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the priod daemon at {path} speaks protocol version {server.v}, this client library version {PROTOCOL_VERSION}; "
            "use a client library of the daemon's version (or upgrade the daemon)"
        )
    return server


def check_regions(generation: int, *regions: Region) -> None:
    """Refuse regions this connection does not hold: lost in a reconnect, or of an earlier one."""
    for r in regions:
        if r.lost is not None:
            raise ConnectionClosed(f"{r!r} did not come back after the daemon restarted: {r.lost}")
        if r.generation != generation:
            raise InvalidRequest(f"{r!r} belongs to an earlier connection; allocate it again after reconnect()")


def reregister_request(region: Region) -> tuple[Request, tuple[int, ...]] | str:
    """The request that registers ``region``'s memory again with a restarted daemon, and the fds
    to send beside it (a dup the caller then owns); or why it cannot come back."""
    if region._fd is not None and region.kind == "host":
        return RegisterHost(region.nbytes), (os.dup(region._fd),)
    if region._fd is not None and region.export.get("kind") == "memfd":
        size = os.fstat(region._fd).st_size
        req = RegisterDevice(b"", region.nbytes, 0, region.device or 0, region.device_uuid, kind="memfd", size=size)
        return req, (os.dup(region._fd),)
    if region._fd is not None and region.export.get("kind") == "vmm_fd":
        size = int(region.export["size"])
        offset = int(region.export.get("offset", 0))
        req = RegisterDevice(
            b"", region.nbytes, offset, region.device or 0, region.device_uuid, kind="vmm_fd", size=size
        )
        return req, (os.dup(region._fd),)
    if region._held is not None:
        try:
            return cuda_register_request(region._held)
        except Exception as exc:  # the buffer is gone, or CUDA refuses it: reported, not raised
            return f"registering its buffer again failed: {exc!r}"
    return "this client holds no fd of its memory"


def regions_lost(path: str, lost: list[Region]) -> str:
    """The message that reports regions that did not come back after a reconnect."""
    listed = "; ".join(f"{r!r}: {r.lost}" for r in lost)
    return f"reconnected to priod at {path}, but {len(lost)} region(s) could not be registered again: {listed}"


def copy_lost(req_id: int, path: str, reconnected: str) -> ConnectionClosed:
    """The error of a copy that was sent and had no reply when the connection was lost."""
    return ConnectionClosed(
        f"copy {req_id} was sent to priod at {path} and the connection was lost before its reply: it may have moved "
        "some or all of its bytes, or none, and did not report success. Re-submitting it is safe when its source and "
        f"destination do not overlap (always so between a host and a device region). {reconnected}"
    )


def copy_unsent(req_id: int, path: str, outcome: str) -> ConnectionClosed:
    """The error of a copy published on the ring that the daemon never read before the
    connection was lost (its head never passed it), when the client does not send it again."""
    return ConnectionClosed(
        f"connection to priod at {path} lost: copy {req_id} never reached the daemon, and no byte of it moved. {outcome}"
    )


def no_permission(path: str) -> PermissionDenied:
    return PermissionDenied(
        f"cannot connect to {path}: permission denied by the socket's mode; "
        "ask an administrator to add your user to the socket's group (priod; see docs/operations.md)"
    )


def no_daemon(path: str, exc: OSError) -> ConnectionClosed:
    return ConnectionClosed(
        f"no priod daemon at {path} ({exc.strerror}); start one with 'priod serve' or pass its socket path"
    )


async def discover(deadline: float) -> str:
    """`find_socket`, tried again until ``deadline`` (``time.monotonic()``): a daemon that is
    starting has not made its socket yet."""
    while True:
        try:
            return find_socket()
        except ConnectionClosed:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.05)


def check_owner(sock: socket.socket, path: str, expect_uid: int | None) -> None:
    """Refuse a daemon that does not run as ``expect_uid`` (SO_PEERCRED: who called listen())."""
    if expect_uid is None:
        return
    uid = peer_credentials(sock).uid
    if uid != expect_uid:
        raise PermissionDenied(
            f"the socket {path} is served by a process of uid {uid}, not of uid {expect_uid} as expected (expect_uid); "
            "another user may have taken the socket path: check which process listens there before sending it your data"
        )


def _with_handles(options: Any) -> Any:
    """``options`` with its events as handle bytes (whatever names them: `event_handle`)."""
    if options.get("wait_event") is None and options.get("signal_event") is None:
        return options
    out = dict(options)
    for key in ("wait_event", "signal_event"):
        if out.get(key) is not None:
            out[key] = event_handle(out[key])
    return out


def copy_request(dst: Region, src: Region, nbytes: int | None, options: CopyOptions) -> Copy:
    if nbytes is None:
        nbytes = min(dst.nbytes - options.get("dst_offset", 0), src.nbytes - options.get("src_offset", 0))
    return Copy(dst.id, src.id, nbytes, **_with_handles(options))


def batch_request(dst: Region, src: Region, segments: Any, options: BatchOptions, max_frame: int) -> CopyBatch:
    raw = encode_segments(segments)
    if len(raw) + BATCH_FRAME_SLACK > max_frame:
        raise InvalidRequest(
            f"{len(raw) // 24} segments make a frame of about {len(raw) + BATCH_FRAME_SLACK} bytes, over the daemon's "
            f"max_frame_bytes = {max_frame}; split them into batches of at most {(max_frame - BATCH_FRAME_SLACK) // 24} segments"
        )
    return CopyBatch(dst.id, src.id, raw, **_with_handles(options))


def cuda_register_request(obj: Any) -> tuple[RegisterDevice, tuple[int, ...]]:
    """The register_device request for a CUDA buffer, and the fds to send beside it (the
    allocation's POSIX fd for ``cuMemCreate`` memory, the pool's for a stream-ordered pool's,
    which the caller then owns)."""
    from priod.client.cuda_ipc import export_device_buffer, gpu_uuid

    buf = export_device_buffer(obj)
    try:
        # ``device`` is this process's ordinal; the UUID is what the daemon goes by (its ordinals
        # may differ). The ordinal still goes along for a daemon that predates UUIDs.
        uuid = gpu_uuid(buf.device)
    except BaseException:
        if buf.fd >= 0:
            os.close(buf.fd)
        raise
    if buf.kind != "cuda_ipc":  # vmm_fd (handle empty) or pool_fd (handle: the allocation's export data)
        req = RegisterDevice(buf.handle, buf.nbytes, buf.offset, buf.device, uuid, kind=buf.kind, size=buf.size)
        return req, (buf.fd,)
    return RegisterDevice(
        handle=buf.handle, nbytes=buf.nbytes, offset=buf.offset, device=buf.device, device_uuid=uuid
    ), ()


def alloc_device_request(nbytes: int, device: int | str) -> AllocDevice:
    """The alloc_device request for ``device``: the daemon's ordinal (an int, or ``gpuN`` as
    `priod status` names it: sent as the int, which every daemon takes) or the GPU's UUID (sent
    as ``device_uuid``). Raises InvalidRequest, listing those forms, for anything else."""
    if isinstance(device, str):
        ordinal, uuid = gpu_target(device)
        return AllocDevice(nbytes, ordinal) if uuid is None else AllocDevice(nbytes, device_uuid=uuid)
    if not isinstance(device, bool):  # True is no GPU, though Python takes it for 1
        try:
            return AllocDevice(nbytes, operator.index(device))  # an int, or a numpy integer
        except TypeError:
            pass
    raise InvalidRequest(f"device {device!r} names no GPU; give {DEVICE_FORMS}")


Reply = tuple[Message, list[int]]
"""A reply as it arrived, and the fds that came beside it (the receiver owns them)."""


def hold_page(reply: Reply) -> HoldPage:
    """The `HoldPage` a ``hold_page`` reply brings (its memfd beside it, and the hold doorbell
    where the daemon has one)."""
    msg, fds = reply
    if len(fds) not in (1, 2):
        close_fds(fds)
        raise ConnectionClosed(
            f"the daemon's hold_page reply came with {len(fds)} fds instead of 1 or 2; is it a priod of this version?"
        )
    return HoldPage(fds[0], HoldPageReply.decode(msg).lanes, doorbell=fds[1] if len(fds) == 2 else None)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def raise_if_cancelled(req_id: int, timeout: float | None, msg: Message) -> None:
    """The copy's last reply after a timeout cancelled it: `CopyTimeout` if the cancel took."""
    exc = error_of(msg)
    if isinstance(exc, Cancelled):
        raise CopyTimeout(
            f"copy {req_id} did not finish within {timeout} s and was cancelled in the daemon: {exc}",
            exc.bytes_done,
            exc.segments_done,
        )


def progress(msg: Message, decode: Callable[[Message], R]) -> tuple[int, int | None]:
    """Bytes and (for a batch) whole segments moved, from the last reply of a copy that was
    asked to stop: cancelled part way, or finished meanwhile. Other errors are raised."""
    exc = error_of(msg)
    if isinstance(exc, Cancelled):
        return exc.bytes_done, exc.segments_done
    if exc is not None:
        raise exc
    result = decode(msg)
    return result.nbytes, result.segments if isinstance(result, CopyBatchReply) else None
