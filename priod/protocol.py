"""Wire format: length-prefixed msgpack frames and the message vocabulary. No I/O here.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of msgpack, whose
top level is a map. Requests carry ``id`` (a client-chosen integer, unique among that
connection's pending requests) and ``op``; each reply carries the same ``id`` and ``ok``.
Replies may come back in any order: an urgent copy overtakes a bulk one. docs/protocol.md is
the full specification; this module is its executable half.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import InvalidRequest, ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "HEADER",
    "OPS",
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "encode",
    "error_reply",
    "require",
]

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20
"""Requests are small (copies name memory, they never carry it): 1 MiB is generous."""

OPS = frozenset(
    {
        "hello",
        "ping",
        "alloc_host",
        "register_host",
        "alloc_device",
        "register_device",
        "free",
        "share",
        "copy",
        "cancel",
        "status",
    }
)
"""Every operation a client may send; anything else is answered with ``unknown_op``."""

Message = dict[str, Any]


def encode(msg: Message) -> bytes:
    """One frame: header and msgpack body."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream into messages, one `feed` at a time.

    A header announcing more than ``max_frame`` bytes raises `ProtocolError` at once, before
    any of the body is buffered, so a peer cannot make the daemon hold an oversize frame. After
    any `ProtocolError` the stream is out of step and the connection must be closed.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once its header is in

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return out
                (length,) = HEADER.unpack_from(self._buf)
                if length > self.max_frame:
                    raise ProtocolError(
                        f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame}; "
                        "requests name memory regions and never carry data, so keep frames small"
                    )
                del self._buf[: HEADER.size]
                self._need = length
            if len(self._buf) < self._need:
                return out
            body = bytes(self._buf[: self._need])
            del self._buf[: self._need]
            self._need = None
            out.append(decode_body(body))


def decode_body(body: bytes) -> Message:
    """Unpack one frame body; it must be a msgpack map with string keys."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=1 << 20, max_str_len=1 << 16)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame body is not valid msgpack ({type(exc).__name__}); encode each frame as one msgpack map") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame body is a msgpack {type(msg).__name__}, expected a map with 'id' and 'op'")
    return msg


def error_reply(req_id: int, code: str, message: str, **extra: Any) -> Message:
    """The reply for a failed request: ``{"id", "ok": False, "error": {"code", "message", ...}}``."""
    return {"id": req_id, "ok": False, "error": {"code": code, "message": message, **extra}}


_MISSING = object()


def require(msg: Message, key: str, kind: type | tuple[type, ...], *, default: Any = ...) -> Any:
    """Read a field of a request, checking its type; raise InvalidRequest naming the fix.

    bool is not accepted where int is asked (msgpack keeps them apart, Python does not).
    """
    value = msg.get(key, _MISSING)
    if type(value) is kind:  # the common case first: a copy request reads six fields
        return value
    if value is _MISSING:
        if default is not ...:
            return default
        raise InvalidRequest(f"field '{key}' is missing from '{msg.get('op')}'; see docs/protocol.md")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise InvalidRequest(f"field '{key}' must be {names}, got {type(value).__name__}")
    return value
