"""Wire format: length-prefixed msgpack frames and the message vocabulary. No I/O here.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of msgpack, whose
top level is a map. Requests carry ``id`` (a client-chosen integer, unique among that
connection's pending requests) and ``op``; each reply carries the same ``id`` and ``ok``.
Replies may come back in any order: an urgent copy overtakes a bulk one. docs/protocol.md is
the full specification; this module is its executable half.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from priod.errors import InvalidRequest, ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "HEADER",
    "OPS",
    "PROTOCOL_VERSION",
    "REPLY_LIMITS",
    "REQUEST_LIMITS",
    "DecodeLimits",
    "FrameDecoder",
    "FrameEncoder",
    "Nested",
    "decode_body",
    "encode",
    "error_reply",
    "require",
]

PROTOCOL_VERSION = 2
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
        "copy_batch",
        "cancel",
        "status",
    }
)
"""Every operation a client may send; anything else is answered with ``unknown_op``."""

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one frame body may hold, checked while msgpack decodes it, before anything beyond
    the limit is built: the length of each string, bin, ext, array and map, and the nesting.

    ``max_frame_bytes`` alone does not bound the work: a 1 MiB body of a million empty maps
    (one byte each) decodes into a million dicts (hundreds of MiB, tens of milliseconds of the
    loop). Lengths alone do not either (an array of 16 arrays of 16 ... is a million objects five
    levels down), so the daemon's requests are also ``flat``: one map whose values are scalars.
    That bounds a request to ``1 + 2 * max_map_len`` objects whatever its size.
    """

    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_ext_len: int
    flat: bool = False
    """The body is one map whose values are nil, bool, int, float, str or bin. A value that is
    an array or a map of at most ``max_map_len`` of those is a mistyped field, not a broken
    frame: it decodes to a `Nested` (its items are read and dropped), which the request's own
    checks refuse (``bad_request``, naming the field) on a connection that goes on. Anything
    deeper, or longer, is refused as a frame (nesting depth 2 at most)."""

    def describe(self) -> str:
        shape = "one flat map (no array or map inside it)" if self.flat else "a map"
        return (
            f"{shape} of at most max_map_len={self.max_map_len} keys; max_str_len={self.max_str_len}, "
            f"max_bin_len={self.max_bin_len}, max_array_len={self.max_array_len}, max_ext_len={self.max_ext_len} bytes or items"
        )


REQUEST_LIMITS = DecodeLimits(
    max_str_len=1024, max_bin_len=1 << 24, max_array_len=0, max_map_len=32, max_ext_len=0, flat=True
)
"""What the daemon decodes a client's frame with (docs/protocol.md, "Frames"). Every request is
a flat map of fewer than 16 keys whose longest values are a client name or class name (str) and
a bin: a 64-byte CUDA IPC handle, or a batch's segment table (24 bytes a segment). A bin is one
object however long, and the frame size bounds it, so its limit is loose: a table with too
many segments is then refused as a request (``bad_request``, naming the cap), not as a frame
that closes the connection. No request holds an array, a map or an ext."""

REPLY_LIMITS = DecodeLimits(
    max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 20, max_map_len=1 << 20, max_ext_len=1 << 20
)
"""What a client decodes the daemon's replies with: generous (a status reply nests lists of
lanes and clients), bounded by the frame size anyway."""

_SMALL_BODY = 4096
"""Flat bodies up to this size are decoded in one msgpack call with hooks that refuse nesting
(a hook runs once per container, so a flat request pays one call, ~0.2 us); larger ones (no
real request comes near that size) item by item, so nesting is refused at its first header
instead of after msgpack has built up to 1024 levels of partial maps (~2 ms for a 100 KB frame)."""


class Nested:
    """What a flat request holds where a field's value was an array or a map (of scalars): its
    kind and length, not its items. No request field takes one, so the request is refused as a
    mistyped field (``bad_request``), like a str where an int belongs, and the connection goes
    on: the frame was whole and in step. ``wire_name`` is the type an error names."""

    __slots__ = ("kind", "length")

    def __init__(self, kind: str, length: int) -> None:
        self.kind = kind
        self.length = length

    @property
    def wire_name(self) -> str:
        return self.kind

    def __repr__(self) -> str:
        return f"<{self.kind} of {self.length} items>"


class _Nested(Exception):
    """A flat body held an array or a map: on the small path anywhere (the item path then reads
    the body again), on the item path inside a field's array or map, or as a key."""


class _LongField(Exception):
    """A flat body's field held an array or a map of more than ``max_map_len`` items."""

    def __init__(self, key: str, kind: str, length: int) -> None:
        super().__init__(key, kind, length)
        self.key, self.kind, self.length = key, kind, length


_MAP_HEADS = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})
_ARRAY_HEADS = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})
"""The first byte of a msgpack map and of an array (fix, 16 and 32-bit lengths)."""


def _reread(exc: Exception) -> bool:
    """Whether the small path's refusal may be a field holding an array or a map, which the item
    path reads again (and then takes, or refuses naming the limit)."""
    if isinstance(exc, _Nested | msgpack.StackError):
        return True
    text = str(exc)
    return "exceeds max_array_len" in text or "exceeds max_map_len" in text


class _NotAMap(Exception):
    """A large flat body whose top level is not a map."""


class _BodyDecoder:
    """`decode_body` for one set of limits; keeps the per-body count the flat hooks need."""

    __slots__ = ("_flat_kw", "_kw", "_maps", "limits")

    def __init__(self, limits: DecodeLimits) -> None:
        self.limits = limits
        self._maps = 0
        self._kw: dict[str, Any] = {
            "raw": False,
            "strict_map_key": True,
            "max_str_len": limits.max_str_len,
            "max_bin_len": limits.max_bin_len,
            "max_array_len": limits.max_array_len,
            "max_map_len": limits.max_map_len,
            "max_ext_len": limits.max_ext_len,
        }
        """msgpack's keyword arguments for these limits, built once (one decode per request)."""
        # The hooks are bound once: a bound method made per body costs ~40 ns.
        self._flat_kw = {**self._kw, "object_hook": self._on_map, "list_hook": self._on_list}

    def _on_map(self, m: dict[str, Any]) -> dict[str, Any]:
        # Called once per map, innermost first; the top-level map is the last. A second call
        # means a map inside the request: refuse before msgpack builds any more of the frame.
        self._maps += 1
        if self._maps > 1:
            raise _Nested
        return m

    @staticmethod
    def _on_list(_items: list[Any]) -> list[Any]:
        raise _Nested  # only an empty array gets here (max_array_len refused the others)

    def __call__(self, body: bytes) -> Message:
        lim = self.limits
        try:
            if not lim.flat:
                msg = msgpack.unpackb(body, **self._kw)
            elif len(body) <= _SMALL_BODY:
                self._maps = 0
                try:
                    msg = msgpack.unpackb(body, **self._flat_kw)
                except (_Nested, ValueError) as exc:  # not a request's usual path: no cost to it
                    if not _reread(exc):
                        raise
                    msg = self._flat_items(body)
            else:
                msg = self._flat_items(body)
        except (_Nested, msgpack.StackError) as exc:
            if not lim.flat:
                raise ProtocolError(
                    "frame body nests deeper than msgpack's 1024 levels; send one map with 'id' and 'op'"
                ) from None
            raise ProtocolError(
                f"frame body nests {'an array or a map' if isinstance(exc, _Nested) else 'containers'} inside a field's "
                "array or map, or as a key (nesting limit: depth 2); a request is one flat map whose values are nil, bool, "
                "int, float, str or bin; see docs/protocol.md"
            ) from None
        except _LongField as exc:
            raise ProtocolError(
                f"frame body's field {exc.key!r} holds {'an array' if exc.kind == 'array' else 'a map'} of {exc.length} items, "
                f"more than a mistyped field is read for (max_map_len={lim.max_map_len}); a request is one flat map whose "
                "values are nil, bool, int, float, str or bin; see docs/protocol.md"
            ) from None
        except _NotAMap:
            raise ProtocolError("frame body is not a msgpack map, expected a map with 'id' and 'op'") from None
        except ValueError as exc:
            if "exceeds max_" not in str(exc):
                raise ProtocolError(
                    f"frame body is not valid msgpack ({type(exc).__name__}); encode each frame as one msgpack map"
                ) from exc
            raise ProtocolError(
                f"frame body exceeds a decoding limit ({exc}); accepted: {lim.describe()}; see docs/protocol.md"
            ) from None
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(
                f"frame body is not valid msgpack ({type(exc).__name__}); encode each frame as one msgpack map"
            ) from exc
        if not isinstance(msg, dict):
            raise ProtocolError(f"frame body is a msgpack {type(msg).__name__}, expected a map with 'id' and 'op'")
        return msg

    def _flat_items(self, body: bytes) -> Any:
        """A flat body one item at a time (a large one, or a small one that holds an array or a
        map): a field's array or map is read by `_nested_field`, and any array or map header
        deeper fails at once (their limits are 0 here; the lengths of the top-level map and of
        a field's array or map are checked by hand)."""
        lim = self.limits
        up = msgpack.Unpacker(
            raw=False,
            max_buffer_size=len(body),
            max_str_len=lim.max_str_len,
            max_bin_len=lim.max_bin_len,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=lim.max_ext_len,
        )
        up.feed(body)
        try:
            n = up.read_map_header()
        except ValueError:
            raise _NotAMap from None
        if n > lim.max_map_len:
            raise ValueError(f"{n} exceeds max_map_len({lim.max_map_len})")
        msg: Message = {}
        try:
            for _ in range(n):
                key = up.unpack()
                if type(key) is not str:
                    raise TypeError(f"{type(key).__name__} is not allowed for map key")
                at = up.tell()  # where the value begins: its first byte says whether it is a container
                if at < len(body) and (body[at] in _MAP_HEADS or body[at] in _ARRAY_HEADS):
                    msg[key] = self._nested_field(up, key, body[at] in _MAP_HEADS)
                    continue
                msg[key] = up.unpack()
        except ValueError as exc:
            # An array or a map inside: "nests", as the small path says (which lets arrays up to
            # max_array_len through msgpack and refuses them in its hook).
            if "exceeds max_map_len(0)" in str(exc) or (
                "exceeds max_array_len(0)" in str(exc) and lim.max_array_len > 0
            ):
                raise _Nested from None
            raise
        if up.tell() != len(body):
            raise msgpack.ExtraData(msg, body[up.tell() :])
        return msg

    def _nested_field(self, up: msgpack.Unpacker, key: str, is_map: bool) -> Nested:
        """The field ``key``'s array or map, as a `Nested`: at most ``max_map_len`` items, each
        a scalar, read and dropped (what a field may hold is bounded as for a flat request)."""
        n = up.read_map_header() if is_map else up.read_array_header()
        kind = "map" if is_map else "array"
        if n > self.limits.max_map_len:
            raise _LongField(key, kind, n)
        for _ in range(2 * n if is_map else n):
            try:
                item = up.unpack()  # an array or a map inside fails at its header (limits 0)
            except ValueError as exc:
                if "exceeds max_map_len(0)" in str(exc) or "exceeds max_array_len(0)" in str(exc):
                    raise _Nested from None
                raise
            if type(item) is dict or type(item) is list:
                raise _Nested  # an empty one
        return Nested(kind, n)


def decode_body(body: bytes, limits: DecodeLimits = REPLY_LIMITS) -> Message:
    """Unpack one frame body within ``limits``; it must be a msgpack map with string keys.
    Raises `ProtocolError` (``bad_frame``) naming the limit a body breaks."""
    return _BodyDecoder(limits)(body)


def encode(msg: Message) -> bytes:
    """One frame: header and msgpack body."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class FrameEncoder:
    """`encode` with a msgpack packer kept for reuse: ``msgpack.packb`` makes a packer per call
    (~0.25 us of a small frame's 0.6). A packer is not thread-safe, so each owner keeps its own
    (a `FramedSocket`, used from its loop's thread only)."""

    __slots__ = ("_pack",)

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True).pack  # the same bytes as packb's

    def __call__(self, msg: Message) -> bytes:
        body: bytes = self._pack(msg)
        return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream into messages, one `feed` at a time.

    A header announcing more than ``max_frame`` bytes raises `ProtocolError` at once, before
    any of the body is buffered, so a peer cannot make the daemon hold an oversize frame; each
    body is decoded within ``limits`` (`REQUEST_LIMITS` where the daemon reads a client,
    `REPLY_LIMITS`, the default, where a client reads the daemon). After any `ProtocolError`
    the stream is out of step and the connection must be closed.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, limits: DecodeLimits = REPLY_LIMITS) -> None:
        self.max_frame = max_frame
        self.limits = limits
        self._decode = _BodyDecoder(limits)
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once its header is in

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete (0 between frames)."""
        return len(self._buf)

    def bytes_to_boundary(self, data: bytes) -> int | None:
        """How many leading bytes of ``data`` finish the frame now partly held (0 between
        frames), or None if ``data`` ends before that frame does."""
        if self._need is not None:
            n = self._need - len(self._buf)
        elif not self._buf:
            return 0
        else:
            missing = HEADER.size - len(self._buf)
            if len(data) < missing:
                return None
            (length,) = HEADER.unpack(bytes(self._buf) + data[:missing])
            n = missing + length
        return n if n <= len(data) else None

    def is_one_frame(self, data: bytes) -> bool:
        """``data`` is exactly one whole frame, beginning at a frame boundary."""
        return (
            self._need is None
            and not self._buf
            and len(data) >= HEADER.size
            and HEADER.unpack_from(data)[0] == len(data) - HEADER.size
        )

    def feed(self, data: bytes) -> list[Message]:
        out: list[Message] = []
        if self._need is None and not self._buf:
            # The usual read begins at a frame boundary and holds whole frames: their bodies are
            # cut from ``data`` itself, not copied through the buffer (~0.5 us a frame). Whatever
            # is left (a frame's beginning) goes the general way below.
            off, end = 0, len(data)
            while end - off >= HEADER.size:
                (length,) = HEADER.unpack_from(data, off)
                if length > self.max_frame:
                    raise self._too_long(length)
                start = off + HEADER.size
                if end - start < length:
                    break
                off = start + length
                out.append(self._decode(data[start:off]))
            if off == end:
                return out
            data = data[off:]
        self._buf += data
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return out
                (length,) = HEADER.unpack_from(self._buf)
                if length > self.max_frame:
                    raise self._too_long(length)
                del self._buf[: HEADER.size]
                self._need = length
            if len(self._buf) < self._need:
                return out
            body = bytes(self._buf[: self._need])
            del self._buf[: self._need]
            self._need = None
            out.append(self._decode(body))

    def _too_long(self, length: int) -> ProtocolError:
        return ProtocolError(
            f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame}; "
            "requests name memory regions and never carry data, so keep frames small"
        )


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
