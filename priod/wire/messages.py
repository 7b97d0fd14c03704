"""The message vocabulary as types: one frozen dataclass per request, checked at decode.

docs/protocol.md is the specification. Each request type has one `decode` (the daemon's side,
where every field is checked once, with an error that names the fix) and one `encode` (the
client's side); the replies (replies.py) are the same the other way round, and are re-exported
here so that callers find the whole vocabulary in one place. File descriptors never travel
inside a message: the transport hands them over beside it, and handlers take and return them
as separate values.

The envelope (``id`` and ``op`` on requests, ``id`` and ``ok`` on replies) is added and read
here too, so the rest of the daemon and the client see only these types. How a field is read
and type-checked is fields.py's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar, Self

from priod.common.gpus import uuid_key
from priod.errors import InvalidRequest
from priod.wire.fields import Message as Message
from priod.wire.fields import Wire
from priod.wire.ipc_event import check_handle
from priod.wire.replies import (
    PROGRESS_SIGNAL_RECORDED,
    CancelReply,
    CopyBatchReply,
    CopyReply,
    Empty,
    ErrorReply,
    HelloReply,
    HoldPageReply,
    RegionReply,
    RingReply,
    StatusReply,
    error_of,
    is_progress,
    progress_frame,
)

__all__ = [
    "DEVICE_FORMS",
    "POOL_EXPORT_BYTES",
    "PROGRESS_SIGNAL_RECORDED",
    "PROTOCOL_VERSION",
    "REGISTER_FDS",
    "REGISTER_KINDS",
    "REQUEST_TYPES",
    "AllocDevice",
    "AllocHost",
    "Cancel",
    "CancelReply",
    "Copy",
    "CopyBatch",
    "CopyBatchReply",
    "CopyReply",
    "Empty",
    "ErrorReply",
    "Free",
    "Hello",
    "HelloReply",
    "HoldPageReply",
    "OpenHoldPage",
    "OpenRing",
    "Ping",
    "RegionReply",
    "RegisterDevice",
    "RegisterHost",
    "Request",
    "RingReply",
    "Share",
    "StatusReply",
    "StatusRequest",
    "decode_request",
    "error_of",
    "gpu_target",
    "is_progress",
    "progress_frame",
    "request_id",
]

PROTOCOL_VERSION = 2
MAX_ID = (1 << 63) - 1
MAX_DEADLINE_MS = 3_600_000
"""A copy's ``deadline_ms`` is within [0, this]: one hour (Copy.check)."""


class _Request(Wire):
    __slots__ = ()
    takes_fds: ClassVar[int] = 0
    """How many fds must come with this request (register_host takes one; register_device of
    kind vmm_fd or pool_fd one, `decode_request`)."""

    @classmethod
    def decode(cls, msg: Message) -> Self:
        return cls(**cls._read(msg))

    def check(self) -> None:
        """Range checks beyond types; raise InvalidRequest naming the fix."""

    def encode(self, req_id: int) -> Message:
        body = {k: v for k, v in self._fields_dict().items() if v is not None}
        return {"id": req_id, "op": self.op, **body}


def _need_size(nbytes: int, what: str) -> None:
    if nbytes < 1:
        raise InvalidRequest(f"nbytes = {nbytes} is invalid; {what} at least 1 byte")


def _need_offset(name: str, value: int) -> None:
    if value < 0:
        raise InvalidRequest(f"{name} = {value} is invalid; it must be >= 0")


@dataclass(frozen=True, slots=True)
class Hello(_Request):
    op: ClassVar[str] = "hello"
    v: int
    client: str = ""

    def check(self) -> None:
        if self.v != PROTOCOL_VERSION:
            raise InvalidRequest(
                f"protocol version {self.v} is not supported; this daemon speaks version {PROTOCOL_VERSION}: upgrade the client library"
            )


@dataclass(frozen=True, slots=True)
class Ping(_Request):
    op: ClassVar[str] = "ping"


@dataclass(frozen=True, slots=True)
class StatusRequest(_Request):
    op: ClassVar[str] = "status"


@dataclass(frozen=True, slots=True)
class AllocHost(_Request):
    op: ClassVar[str] = "alloc_host"
    nbytes: int

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")


@dataclass(frozen=True, slots=True)
class RegisterHost(_Request):
    """Comes with one memfd beside it, sealed against shrinking."""

    op: ClassVar[str] = "register_host"
    takes_fds: ClassVar[int] = 1
    nbytes: int

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")


def _need_uuid(device_uuid: str | None) -> None:
    if device_uuid is not None:
        uuid_key(device_uuid)  # raises InvalidRequest showing the expected form


_GPU_NAME = re.compile(r"gpu([0-9]{1,9})", re.IGNORECASE)
"""A GPU as `priod status` names it: ``gpu`` and the daemon's ordinal."""

DEVICE_FORMS = (
    "the daemon's ordinal as an int (0), its name as `priod status` shows it ('gpu0'), "
    "or the GPU's UUID as nvidia-smi -L prints it (GPU-5f3c0e1a-9b7d-4e2f-8a61-0c4d2b9e7f13)"
)
"""The three ways a request names a GPU, for the messages that refuse any other."""


def gpu_target(device: str) -> tuple[int, str | None]:
    """The GPU a string names: ``gpuN`` (the daemon's ordinal N, as `priod status` shows it),
    as ``(N, None)``; a UUID as ``(0, uuid)`` (the daemon maps it to its own ordinal).

    Raises:
        InvalidRequest: any other string; the message lists the three forms.
    """
    text = device.strip()
    if (m := _GPU_NAME.fullmatch(text)) is not None:
        return int(m.group(1)), None
    try:
        uuid_key(text)
    except InvalidRequest:
        raise InvalidRequest(f"device {device[:80]!r} names no GPU; give {DEVICE_FORMS}") from None
    return 0, text


@dataclass(frozen=True, slots=True)
class AllocDevice(_Request):
    """``device``: the daemon's ordinal (an int, or ``gpuN`` as `priod status` names it) or the
    GPU's UUID. ``device_uuid``, when given, names the GPU and ``device`` is ignored."""

    op: ClassVar[str] = "alloc_device"
    nbytes: int
    device: int | str = 0
    device_uuid: str | None = None

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")
        _need_uuid(self.device_uuid)
        self.target()

    def target(self) -> tuple[int, str | None]:
        """The GPU this names: (the daemon's ordinal, None), or (0, its UUID) when named by UUID,
        which the daemon maps to its own ordinal. Raises InvalidRequest for a string ``device``
        that names no GPU."""
        if isinstance(self.device, str):
            ordinal, uuid = gpu_target(self.device)
        else:
            ordinal, uuid = self.device, None
        return (ordinal, uuid) if self.device_uuid is None else (0, self.device_uuid)


REGISTER_KINDS = ("cuda_ipc", "vmm_fd", "pool_fd", "memfd")
"""How a register_device request names the client's allocation: a legacy CUDA IPC handle
(``cudaMalloc`` memory), a POSIX fd of a ``cuMemCreate`` allocation passed beside the frame, a
POSIX fd of a stream-ordered pool passed beside the frame with the allocation's export data, or
(sim engine only) the memfd of a sim device region, passed beside the frame: how a client
registers a sim device region again after a daemon restart."""

REGISTER_FDS = {
    "vmm_fd": "the allocation's POSIX fd",
    "pool_fd": "the pool's POSIX fd",
    "memfd": "the sim device region's memfd",
}
"""The register_device kinds that take one fd beside the frame, and what that fd is."""

POOL_EXPORT_BYTES = 64
"""The size of a ``CUmemPoolPtrExportData``, the ``handle`` of kind pool_fd."""


@dataclass(frozen=True, slots=True)
class RegisterDevice(_Request):
    """``device_uuid``, when given, names the GPU and ``device`` (the daemon's ordinal) is ignored.

    ``kind`` ``cuda_ipc`` (the default, also when absent): ``handle`` is the allocation's
    ``cudaIpcMemHandle_t``. ``vmm_fd``: one fd comes beside the frame, the allocation's
    ``cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)``; ``size`` is the whole allocation's
    size (the daemon maps all of it) and ``handle`` is empty. ``pool_fd``: one fd comes beside
    the frame, the stream-ordered pool's ``cuMemPoolExportToShareableHandle(POSIX_FILE_DESCRIPTOR)``;
    ``handle`` is the 64 bytes of the allocation's ``cuMemPoolExportPointer`` and ``size`` the
    allocation's size.
    """

    op: ClassVar[str] = "register_device"
    handle: bytes
    nbytes: int
    offset: int = 0
    device: int = 0
    device_uuid: str | None = None
    kind: str | None = None
    size: int | None = None

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")
        _need_offset("offset", self.offset)
        _need_uuid(self.device_uuid)
        if self.kind is not None and self.kind not in REGISTER_KINDS:
            raise InvalidRequest(
                f"kind = {self.kind!r} is invalid; register_device takes kind {' or '.join(map(repr, REGISTER_KINDS))}"
            )
        if self.kind in REGISTER_FDS:
            if self.size is None or self.size < 1:
                raise InvalidRequest(
                    f"size = {self.size} is invalid; kind {self.kind!r} needs the whole allocation's size in bytes (at least 1)"
                )
            if self.offset + self.nbytes > self.size:
                raise InvalidRequest(
                    f"offset {self.offset} + nbytes {self.nbytes} is past the allocation's size {self.size}; the buffer must lie within it"
                )
        if self.kind == "pool_fd" and len(self.handle) != POOL_EXPORT_BYTES:
            raise InvalidRequest(
                f"handle is {len(self.handle)} bytes; kind 'pool_fd' needs the allocation's {POOL_EXPORT_BYTES}-byte CUmemPoolPtrExportData "
                "(what cuMemPoolExportPointer gives) as its handle"
            )


@dataclass(frozen=True, slots=True)
class Free(_Request):
    op: ClassVar[str] = "free"
    region: int


MAX_UID = (1 << 32) - 2
"""The largest Unix user id: uid_t is 32 bits, and its all-ones value means no user."""


@dataclass(frozen=True, slots=True)
class Share(_Request):
    op: ClassVar[str] = "share"
    region: int
    uid: int

    def check(self) -> None:
        if not 0 <= self.uid <= MAX_UID:
            raise InvalidRequest(f"uid = {self.uid} is invalid; give the Unix user id to share with, 0 .. {MAX_UID}")


@dataclass(frozen=True, init=False)
class Copy(_Request):
    """One per copy on the daemon's loop, so like `priod.daemon.sched.records.Chunk` it has no slots and its
    ``__init__`` fills the instance dict at once: the generated one of a frozen dataclass calls
    ``object.__setattr__`` per field (0.87 -> 0.4 us). Setting a field afterwards still raises."""

    op: ClassVar[str] = "copy"
    dst: int
    src: int
    nbytes: int
    dst_offset: int = 0
    src_offset: int = 0
    priority: str = "normal"
    deadline_ms: float | None = None
    wait_event: bytes | None = None
    """A client's IPC event handle: the copy starts only once the event has completed."""
    signal_event: bytes | None = None
    """A client's IPC event handle, recorded right after the copy's last chunk."""

    def __init__(
        self,
        dst: int,
        src: int,
        nbytes: int,
        dst_offset: int = 0,
        src_offset: int = 0,
        priority: str = "normal",
        deadline_ms: float | None = None,
        wait_event: bytes | None = None,
        signal_event: bytes | None = None,
    ) -> None:
        d = self.__dict__
        d["dst"], d["src"], d["nbytes"], d["dst_offset"], d["src_offset"] = dst, src, nbytes, dst_offset, src_offset
        d["priority"], d["deadline_ms"], d["wait_event"], d["signal_event"] = (
            priority,
            deadline_ms,
            wait_event,
            signal_event,
        )

    @classmethod
    def decode(cls, msg: Message) -> Self:
        # The common case written out (once per copy on the daemon's loop: 0.6 us instead of
        # 2.4); anything unusual goes the general way, which names what is wrong.
        get = msg.get
        dst, src, nbytes = get("dst"), get("src"), get("nbytes")
        dst_offset, src_offset = get("dst_offset", 0), get("src_offset", 0)
        priority, deadline_ms = get("priority", "normal"), get("deadline_ms")
        if (
            type(dst) is int
            and type(src) is int
            and type(nbytes) is int
            and type(dst_offset) is int
            and type(src_offset) is int
            and type(priority) is str
            and (deadline_ms is None or type(deadline_ms) is float)
            and "wait_event" not in msg
            and "signal_event" not in msg
        ):
            return cls(dst, src, nbytes, dst_offset, src_offset, priority, deadline_ms)
        return cls(**cls._read(msg))

    def encode(self, req_id: int) -> Message:
        # Written out: this runs once per copy on the client (a generic encode costs ~3 us more).
        msg: Message = {
            "id": req_id,
            "op": "copy",
            "dst": self.dst,
            "src": self.src,
            "nbytes": self.nbytes,
            "dst_offset": self.dst_offset,
            "src_offset": self.src_offset,
            "priority": self.priority,
        }
        return _with_options(msg, self.deadline_ms, self.wait_event, self.signal_event)

    def check(self) -> None:
        if (
            self.nbytes >= 1
            and self.dst_offset >= 0
            and self.src_offset >= 0
            and self.deadline_ms is None
            and self.wait_event is None
            and self.signal_event is None
        ):
            return  # the common case in one test (once per copy on the daemon's loop); the rest names what is wrong
        _need_size(self.nbytes, "copy")
        _need_offset("dst_offset", self.dst_offset)
        _need_offset("src_offset", self.src_offset)
        _check_deadline(self.deadline_ms)
        check_handle("wait_event", self.wait_event)
        check_handle("signal_event", self.signal_event)


def _with_options(
    msg: Message, deadline_ms: float | None, wait_event: bytes | None, signal_event: bytes | None
) -> Message:
    """``msg`` (a copy's or a batch's) with the optional fields that are set."""
    if deadline_ms is not None:
        msg["deadline_ms"] = deadline_ms
    if wait_event is not None:
        msg["wait_event"] = wait_event
    if signal_event is not None:
        msg["signal_event"] = signal_event
    return msg


def _check_deadline(deadline_ms: float | None) -> None:
    if deadline_ms is not None:
        if not math.isfinite(deadline_ms):
            raise InvalidRequest(
                f"deadline_ms = {deadline_ms} is invalid; give a finite number of milliseconds, or leave it out"
            )
        # A deadline orders only its own connection's copies (scheduler.py), but an absurd
        # one is a client bug or an attempt to jump a queue: refuse it. One hour at most.
        if not 0 <= deadline_ms <= MAX_DEADLINE_MS:
            raise InvalidRequest(
                f"deadline_ms = {deadline_ms} is invalid; give 0 <= deadline_ms <= {MAX_DEADLINE_MS} (milliseconds from now), or leave it out"
            )


@dataclass(frozen=True, slots=True)
class CopyBatch(_Request):
    """Many copies between two regions as one request: ``segments`` is the wire form of a
    segment table (batch.py: little-endian uint64 triples ``dst_offset, src_offset,
    nbytes``). Its structure is checked at decode, its bounds against the regions in the session."""

    op: ClassVar[str] = "copy_batch"
    dst: int
    src: int
    segments: bytes
    priority: str = "normal"
    deadline_ms: float | None = None
    wait_event: bytes | None = None
    signal_event: bytes | None = None

    @classmethod
    def decode(cls, msg: Message) -> Self:
        # The common case written out, as `Copy.decode`: a KV cache sends a batch per step (2.5
        # against 7.7 us, 2 ms asleep between calls, this VM); anything unusual goes the general
        # way, which names what is wrong.
        get = msg.get
        dst, src, segments = get("dst"), get("src"), get("segments")
        priority, deadline_ms = get("priority", "normal"), get("deadline_ms")
        if (
            type(dst) is int
            and type(src) is int
            and type(segments) is bytes
            and type(priority) is str
            and (deadline_ms is None or type(deadline_ms) is float)
            and "wait_event" not in msg
            and "signal_event" not in msg
        ):
            return cls(dst, src, segments, priority, deadline_ms)
        return cls(**cls._read(msg))

    def encode(self, req_id: int) -> Message:
        # Written out, as `Copy.encode`: 1.8 against 9.5 us on the client, 2 ms asleep between
        # calls (this VM).
        msg: Message = {
            "id": req_id,
            "op": "copy_batch",
            "dst": self.dst,
            "src": self.src,
            "segments": self.segments,
            "priority": self.priority,
        }
        return _with_options(msg, self.deadline_ms, self.wait_event, self.signal_event)

    def check(self) -> None:
        _check_deadline(self.deadline_ms)
        check_handle("wait_event", self.wait_event)
        check_handle("signal_event", self.signal_event)


@dataclass(frozen=True, slots=True)
class OpenHoldPage(_Request):
    """Ask for this connection's hold page (daemon/holds.py), for direct urgent copies; comes back
    with one fd beside the reply, two with ``doorbell``: the page and an eventfd the client writes
    after it announces a copy, so that a daemon asleep reads the page at once."""

    op: ClassVar[str] = "hold_page"
    doorbell: bool = False


@dataclass(frozen=True, slots=True)
class OpenRing(_Request):
    """Ask for this connection's copy ring (`priod.wire.ring`); comes back with three fds beside
    the reply: the ring's memfd, the client's doorbell and the daemon's wake-up (eventfds)."""

    op: ClassVar[str] = "ring"


@dataclass(frozen=True, slots=True)
class Cancel(_Request):
    op: ClassVar[str] = "cancel"
    target: int


Request = (
    Hello
    | Ping
    | StatusRequest
    | AllocHost
    | RegisterHost
    | AllocDevice
    | RegisterDevice
    | Free
    | Share
    | Copy
    | CopyBatch
    | Cancel
    | OpenHoldPage
    | OpenRing
)

REQUEST_TYPES: dict[str, type[Request]] = {
    t.op: t
    for t in (
        Hello,
        Ping,
        StatusRequest,
        AllocHost,
        RegisterHost,
        AllocDevice,
        RegisterDevice,
        Free,
        Share,
        Copy,
        CopyBatch,
        Cancel,
        OpenHoldPage,
        OpenRing,
    )
}
"""Every operation a client may send; anything else is refused with ``bad_request``."""


def request_id(msg: Message) -> int:
    """The request's ``id`` if it is valid (1 .. 2**63-1), else 0: the id an error reply carries."""
    raw = msg.get("id")
    return raw if type(raw) is int and 0 < raw <= MAX_ID else 0


def decode_request(msg: Message, *, greeted: bool = True, fds: int = 0) -> Request:
    """The typed request in ``msg``, every field checked; raises InvalidRequest naming the fix.

    ``greeted``: whether this connection has sent its hello (before that only hello is taken);
    ``fds``: how many file descriptors came beside the frame.
    """
    raw_id = msg.get("id")  # `request_id`, written out: this runs once per request
    if not (type(raw_id) is int and 0 < raw_id <= MAX_ID):
        raise InvalidRequest("every request needs an integer 'id' between 1 and 2**63-1; see docs/protocol.md")
    op = msg.get("op")
    kind = REQUEST_TYPES.get(op) if isinstance(op, str) else None
    if kind is None:
        raise InvalidRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(REQUEST_TYPES))}")
    if not greeted and kind is not Hello:
        raise InvalidRequest("send 'hello' with your protocol version before any other request")
    # Before decoding, so that fds where none belong are named whatever else is wrong; for
    # register_device its kind says (one fd with kind vmm_fd or pool_fd).
    fd_kind = msg.get("kind") if kind is RegisterDevice else None
    what = REGISTER_FDS.get(fd_kind) if isinstance(fd_kind, str) else None
    if fds != (1 if what else kind.takes_fds):
        if what:
            raise InvalidRequest(f"'{op}' of kind {fd_kind!r} takes exactly one fd ({what}) with the frame, got {fds}")
        if kind.takes_fds:
            raise InvalidRequest(f"'{op}' takes exactly one memfd with the frame, got {fds}")
        raise InvalidRequest(f"'{op}' takes no file descriptors, but {fds} came with it; they were closed")
    req = kind.decode(msg)
    req.check()
    return req
