"""The message vocabulary as types: one frozen dataclass per request and per reply.

docs/protocol.md is the specification. Each request type has one `decode` (the daemon's side,
where every field is checked once, with an error that names the fix) and one `encode` (the
client's side); each reply type the same the other way round. File descriptors never travel
inside a message: the transport hands them over beside it, and handlers take and return them
as separate values.

The envelope (``id`` and ``op`` on requests, ``id`` and ``ok`` on replies) is added and read
here too, so the rest of the daemon and the client see only these types.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass
from typing import Any, ClassVar, Self, Union, cast, get_args, get_origin, get_type_hints

from .errors import InvalidRequest, PriodError, error_for_code
from .gpus import uuid_key
from .ipc_event import check_handle

__all__ = [
    "PROGRESS_SIGNAL_RECORDED",
    "PROTOCOL_VERSION",
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
    "Ping",
    "RegionReply",
    "RegisterDevice",
    "RegisterHost",
    "Request",
    "Share",
    "StatusReply",
    "StatusRequest",
    "decode_request",
    "error_of",
    "is_progress",
    "progress_frame",
    "request_id",
]

PROTOCOL_VERSION = 1
MAX_ID = (1 << 63) - 1
MAX_DEADLINE_MS = 3_600_000
"""A copy's ``deadline_ms`` is within [0, this]: one hour (Copy.check)."""

Message = dict[str, Any]
_MISSING: Any = object()


class _Wire:
    """Shared by every message type: a field table read once per class, and the checks."""

    __slots__ = ()
    op: ClassVar[str] = ""
    _field_table: ClassVar[tuple[tuple[str, tuple[type, ...], Any], ...]]

    @classmethod
    def _fields(cls) -> tuple[tuple[str, tuple[type, ...], Any], ...]:
        """(name, accepted types, default or _MISSING) per field, built on first use."""
        table: tuple[tuple[str, tuple[type, ...], Any], ...] | None = cls.__dict__.get("_field_table")
        if table is None:
            hints = get_type_hints(cls)
            table = tuple(
                (f.name, _kinds(hints[f.name]), _MISSING if f.default is dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            )
            cls._field_table = table
        return table

    @classmethod
    def _read(cls, msg: Message) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kinds, default in cls._fields():
            value = msg.get(name, _MISSING)
            if value is _MISSING or (value is None and default is None):
                if default is _MISSING:
                    raise InvalidRequest(f"field '{name}' is missing from '{cls.op}'; see docs/protocol.md")
                out[name] = default
                continue
            if type(value) not in kinds:  # exact types: bool is no int here (msgpack keeps them apart)
                if float in kinds and type(value) is int:
                    value = float(value)
                else:
                    names = " or ".join(k.__name__ for k in kinds if k is not type(None))
                    raise InvalidRequest(f"field '{name}' must be {names}, got {type(value).__name__}")
            out[name] = value
        return out

    def _fields_dict(self) -> Message:
        return {name: getattr(self, name) for name, _, _ in self._fields()}


def _kinds(hint: Any) -> tuple[type, ...]:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return tuple(a for a in get_args(hint) if isinstance(a, type))
    return (origin if origin is not None else hint,)


# -- requests ---------------------------------------------------------------------------------


class _Request(_Wire):
    __slots__ = ()
    takes_fds: ClassVar[int] = 0
    """How many fds must come with this request (only register_host takes one)."""

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
            raise InvalidRequest(f"protocol version {self.v} is not supported; this daemon speaks version {PROTOCOL_VERSION}: upgrade the client library")


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


@dataclass(frozen=True, slots=True)
class AllocDevice(_Request):
    """``device_uuid``, when given, names the GPU and ``device`` (the daemon's ordinal) is ignored."""

    op: ClassVar[str] = "alloc_device"
    nbytes: int
    device: int = 0
    device_uuid: str | None = None

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")
        _need_uuid(self.device_uuid)


@dataclass(frozen=True, slots=True)
class RegisterDevice(_Request):
    """``device_uuid``, when given, names the GPU and ``device`` (the daemon's ordinal) is ignored."""

    op: ClassVar[str] = "register_device"
    handle: bytes
    nbytes: int
    offset: int = 0
    device: int = 0
    device_uuid: str | None = None

    def check(self) -> None:
        _need_size(self.nbytes, "a region holds")
        _need_offset("offset", self.offset)
        _need_uuid(self.device_uuid)


@dataclass(frozen=True, slots=True)
class Free(_Request):
    op: ClassVar[str] = "free"
    region: int


@dataclass(frozen=True, slots=True)
class Share(_Request):
    op: ClassVar[str] = "share"
    region: int
    uid: int


@dataclass(frozen=True, slots=True)
class Copy(_Request):
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
        if self.deadline_ms is not None:
            msg["deadline_ms"] = self.deadline_ms
        if self.wait_event is not None:
            msg["wait_event"] = self.wait_event
        if self.signal_event is not None:
            msg["signal_event"] = self.signal_event
        return msg

    def check(self) -> None:
        _need_size(self.nbytes, "copy")
        _need_offset("dst_offset", self.dst_offset)
        _need_offset("src_offset", self.src_offset)
        _check_deadline(self.deadline_ms)
        check_handle("wait_event", self.wait_event)
        check_handle("signal_event", self.signal_event)


def _check_deadline(deadline_ms: float | None) -> None:
    if deadline_ms is not None:
        if not math.isfinite(deadline_ms):
            raise InvalidRequest(f"deadline_ms = {deadline_ms} is invalid; give a finite number of milliseconds, or leave it out")
        # A deadline orders only its own connection's copies (scheduler.py), but an absurd
        # one is a client bug or an attempt to jump a queue: refuse it. One hour at most.
        if not 0 <= deadline_ms <= MAX_DEADLINE_MS:
            raise InvalidRequest(
                f"deadline_ms = {deadline_ms} is invalid; give 0 <= deadline_ms <= {MAX_DEADLINE_MS} (milliseconds from now), or leave it out"
            )


@dataclass(frozen=True, slots=True)
class CopyBatch(_Request):
    """Many copies between two regions as one request: ``segments`` is the wire form of a
    segment table (priod/batch.py: little-endian uint64 triples ``dst_offset, src_offset,
    nbytes``). Its structure is checked at decode, its bounds against the regions in the session."""

    op: ClassVar[str] = "copy_batch"
    dst: int
    src: int
    segments: bytes
    priority: str = "normal"
    deadline_ms: float | None = None
    wait_event: bytes | None = None
    signal_event: bytes | None = None

    def check(self) -> None:
        _check_deadline(self.deadline_ms)
        check_handle("wait_event", self.wait_event)
        check_handle("signal_event", self.signal_event)


@dataclass(frozen=True, slots=True)
class Cancel(_Request):
    op: ClassVar[str] = "cancel"
    target: int


Request = Hello | Ping | StatusRequest | AllocHost | RegisterHost | AllocDevice | RegisterDevice | Free | Share | Copy | CopyBatch | Cancel

REQUEST_TYPES: dict[str, type[_Request]] = {
    t.op: t for t in (Hello, Ping, StatusRequest, AllocHost, RegisterHost, AllocDevice, RegisterDevice, Free, Share, Copy, CopyBatch, Cancel)
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
    if request_id(msg) == 0:
        raise InvalidRequest("every request needs an integer 'id' between 1 and 2**63-1; see docs/protocol.md")
    op = msg.get("op")
    kind = REQUEST_TYPES.get(op) if isinstance(op, str) else None
    if kind is None:
        raise InvalidRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(REQUEST_TYPES))}")
    if not greeted and kind is not Hello:
        raise InvalidRequest("send 'hello' with your protocol version before any other request")
    if fds != kind.takes_fds:
        if kind.takes_fds:
            raise InvalidRequest(f"'{op}' takes exactly one memfd with the frame, got {fds}")
        raise InvalidRequest(f"'{op}' takes no file descriptors, but {fds} came with it; they were closed")
    req = cast(Request, kind.decode(msg))
    req.check()
    return req


# -- replies ----------------------------------------------------------------------------------


class _Reply(_Wire):
    __slots__ = ()

    @classmethod
    def decode(cls, msg: Message) -> Self:
        """The client's side: the daemon is trusted to send what docs/protocol.md says."""
        return cls(**{name: msg.get(name, default if default is not _MISSING else None) for name, _, default in cls._fields()})

    def encode(self, req_id: int) -> Message:
        return {"id": req_id, "ok": True, **self._fields_dict()}


@dataclass(frozen=True, slots=True)
class HelloReply(_Reply):
    v: int
    server: str
    version: str
    backend: str
    max_frame_bytes: int
    classes: list[str]
    peer: dict[str, int]


@dataclass(frozen=True, slots=True)
class RegionReply(_Reply):
    """A region made by alloc_* or register_*. alloc_host (and alloc_device on the sim engine)
    comes with one fd beside it; ``export`` says how to reach a daemon-allocated device region."""

    region: int
    nbytes: int
    kind: str
    device: int | None = None
    """The daemon's ordinal of the region's GPU (None for host memory)."""
    export: dict[str, Any] | None = None
    device_uuid: str | None = None
    """The region's GPU by UUID: what the client maps to its own ordinal (None for host memory)."""

    def encode(self, req_id: int) -> Message:
        msg = {"id": req_id, "ok": True, "region": self.region, "nbytes": self.nbytes, "kind": self.kind, "device": self.device}
        if self.export is not None:
            msg["export"] = self.export
        if self.device_uuid is not None:
            msg["device_uuid"] = self.device_uuid
        return msg


@dataclass(frozen=True, slots=True)
class CopyReply(_Reply):
    """A copy that finished: daemon-clock timings in microseconds."""

    nbytes: int
    queued_us: float
    """Arrival to first chunk submitted."""
    transfer_us: float
    """First chunk submitted to last chunk complete."""
    total_us: float
    path: str
    """``dma`` or ``express``."""
    missed_deadline: bool = False
    event_wait_us: float | None = None
    """A copy with a ``wait_event``: arrival until the daemon saw the event complete (then
    ``queued_us`` counts from there). None without one."""

    def encode(self, req_id: int) -> Message:
        # Written out: once per copy on the daemon's loop.
        msg: Message = {
            "id": req_id,
            "ok": True,
            "nbytes": self.nbytes,
            "queued_us": self.queued_us,
            "transfer_us": self.transfer_us,
            "total_us": self.total_us,
            "path": self.path,
            "missed_deadline": self.missed_deadline,
        }
        if self.event_wait_us is not None:
            msg["event_wait_us"] = self.event_wait_us
        return msg

    @classmethod
    def decode(cls, msg: Message) -> Self:
        return cls(
            msg["nbytes"], msg["queued_us"], msg["transfer_us"], msg["total_us"], msg["path"], msg.get("missed_deadline", False), msg.get("event_wait_us")
        )


@dataclass(frozen=True, slots=True)
class CopyBatchReply(_Reply):
    """A batch that finished: every segment landed. Timings as `CopyReply`'s."""

    nbytes: int
    """Total bytes of all segments."""
    segments: int
    queued_us: float
    transfer_us: float
    total_us: float
    path: str
    missed_deadline: bool = False
    event_wait_us: float | None = None
    """As `CopyReply`'s."""

    def encode(self, req_id: int) -> Message:
        msg = {"id": req_id, "ok": True, **self._fields_dict()}
        if self.event_wait_us is None:
            del msg["event_wait_us"]
        return msg


PROGRESS_SIGNAL_RECORDED = "signal_recorded"
"""A progress frame's ``progress``: the copy's ``signal_event`` is recorded behind its last
chunk, which may still be in flight; a stream may now wait on the event. The reply follows."""


def progress_frame(req_id: int, what: str) -> Message:
    """A frame that is not a copy's reply: ``{"id", "ok": true, "progress": what}``. The copy's
    own reply still comes, after it; clients skip progress frames they do not know."""
    return {"id": req_id, "ok": True, "progress": what}


def is_progress(msg: Message) -> bool:
    """True for a progress frame (`progress_frame`), which does not end its request."""
    return "progress" in msg


@dataclass(frozen=True, slots=True)
class CancelReply(_Reply):
    target: int
    state: str
    """``cancelled`` (it ended at once) or ``stopping`` (its last chunk is still in flight)."""


@dataclass(frozen=True, slots=True)
class StatusReply(_Reply):
    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Empty(_Reply):
    """The reply of ping, free and share."""


@dataclass(frozen=True, slots=True)
class ErrorReply(_Reply):
    """A failed request: its error code, a message that says what to do, and for a copy that
    ended early, how many bytes it had moved."""

    code: str
    message: str
    bytes_done: int | None = None
    segments_done: int | None = None
    """A batch that ended early: how many of its segments (the first ones) landed whole."""

    def encode(self, req_id: int) -> Message:
        err: Message = {"code": self.code, "message": self.message}
        if self.bytes_done is not None:
            err["bytes_done"] = self.bytes_done
        if self.segments_done is not None:
            err["segments_done"] = self.segments_done
        return {"id": req_id, "ok": False, "error": err}

    @classmethod
    def decode(cls, msg: Message) -> ErrorReply:
        err = msg.get("error")
        err = err if isinstance(err, dict) else {}
        done, segs = err.get("bytes_done"), err.get("segments_done")
        return cls(
            str(err.get("code", "internal")),
            str(err.get("message", "request failed")),
            done if type(done) is int else None,
            segs if type(segs) is int else None,
        )

    def exception(self) -> PriodError:
        """The exception this reply stands for (``except priod.LimitExceeded`` works client-side);
        a copy's progress (``bytes_done``, ``segments_done``) stays on it."""
        return error_for_code(self.code, self.message, self.bytes_done or 0, self.segments_done)

    @classmethod
    def of(cls, exc: PriodError, bytes_done: int | None = None) -> ErrorReply:
        return cls(exc.code, str(exc), bytes_done)


def error_of(msg: Message) -> PriodError | None:
    """The exception a reply stands for if it is an error reply, else None."""
    if msg.get("ok", True):
        return None
    return ErrorReply.decode(msg).exception()
