"""The replies as types: one frozen dataclass per reply, and the progress frame.

The daemon builds them and calls `encode`; the client decodes the frame with the type it expects
(`error_of` first, since any request may be refused). The client trusts the daemon, so `decode`
here checks nothing: the checking is on the requests' side (messages.py), where the peer is not
trusted. Re-exported by messages.py, which callers import them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from priod.errors import PriodError, error_for_code
from priod.wire.fields import MISSING, Message, Wire

__all__ = [
    "PROGRESS_SIGNAL_RECORDED",
    "CancelReply",
    "CopyBatchReply",
    "CopyReply",
    "Empty",
    "ErrorReply",
    "HelloReply",
    "HoldPageReply",
    "RegionReply",
    "RingReply",
    "StatusReply",
    "error_of",
    "is_progress",
    "progress_frame",
]


class _Reply(Wire):
    __slots__ = ()

    @classmethod
    def decode(cls, msg: Message) -> Self:
        """The client's side: the daemon is trusted to send what docs/protocol.md says."""
        return cls(
            **{name: msg.get(name, default if default is not MISSING else None) for name, _, default in cls._fields()}
        )

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
    ring: int = 0
    """The copy ring's layout version this daemon makes (`priod.wire.ring`); 0: none."""


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
        msg = {
            "id": req_id,
            "ok": True,
            "region": self.region,
            "nbytes": self.nbytes,
            "kind": self.kind,
            "device": self.device,
        }
        if self.export is not None:
            msg["export"] = self.export
        if self.device_uuid is not None:
            msg["device_uuid"] = self.device_uuid
        return msg


@dataclass(frozen=True, init=False)
class CopyReply(_Reply):
    """A copy that finished: daemon-clock timings in microseconds.

    One per copy on the daemon's loop: no slots, and an ``__init__`` that fills the instance
    dict at once, as `priod.wire.messages.Copy` (0.69 -> 0.3 us)."""

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

    def __init__(
        self,
        nbytes: int,
        queued_us: float,
        transfer_us: float,
        total_us: float,
        path: str,
        missed_deadline: bool = False,
        event_wait_us: float | None = None,
    ) -> None:
        d = self.__dict__
        d["nbytes"], d["queued_us"], d["transfer_us"], d["total_us"] = nbytes, queued_us, transfer_us, total_us
        d["path"], d["missed_deadline"], d["event_wait_us"] = path, missed_deadline, event_wait_us

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
            msg["nbytes"],
            msg["queued_us"],
            msg["transfer_us"],
            msg["total_us"],
            msg["path"],
            msg.get("missed_deadline", False),
            msg.get("event_wait_us"),
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
class HoldPageReply(_Reply):
    """The hold page's layout: slot ``i`` (16 bytes at ``16 * i``: ``begun``, ``ended``, both
    uint64, little-endian) is ``lanes[i]``, a dict of ``device`` (the daemon's ordinal),
    ``device_uuid`` and ``direction`` (``h2d`` or ``d2h``). The page's memfd comes beside it."""

    lanes: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class RingReply(_Reply):
    """The copy ring's size; its memfd, the client's doorbell and the daemon's wake-up come beside it."""

    entries: int
    version: int


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
