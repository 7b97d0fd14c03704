"""Framing and message decoding, with bytes only: no sockets, no daemon."""

from __future__ import annotations

import struct

import msgpack
import pytest

from priod.errors import InvalidRequest, ProtocolError
from priod.wire.frames import HEADER, FrameDecoder, FrameEncoder, encode, require


def test_round_trip_one_frame() -> None:
    """A message encoded into a frame decodes back to the same message."""
    msg = {"id": 7, "op": "copy", "dst": 1, "src": 2, "nbytes": 4096, "handle": b"\x00\x01"}
    assert FrameDecoder().feed(encode(msg)) == [msg]


def test_round_trip_byte_by_byte() -> None:
    """Frames split at every byte boundary still decode, in order, each exactly once."""
    msgs = [{"id": i, "op": "ping", "pad": "x" * i} for i in range(1, 6)]
    stream = b"".join(encode(m) for m in msgs)
    dec = FrameDecoder()
    out = []
    for i in range(len(stream)):
        out += dec.feed(stream[i : i + 1])
    assert out == msgs
    assert dec.buffered == 0


def test_many_frames_in_one_feed() -> None:
    """Several frames arriving in one read all come out of one feed."""
    msgs = [{"id": i, "op": "ping"} for i in range(1, 100)]
    assert FrameDecoder().feed(b"".join(encode(m) for m in msgs)) == msgs


def test_truncated_frame_waits_for_the_rest() -> None:
    """A frame cut short yields nothing (and no error) until its remaining bytes arrive."""
    frame = encode({"id": 1, "op": "ping"})
    dec = FrameDecoder()
    assert dec.feed(frame[:-3]) == []
    assert dec.feed(frame[-3:]) == [{"id": 1, "op": "ping"}]


def test_oversize_frame_rejected_from_its_header() -> None:
    """A header announcing more than max_frame is refused before any body byte is buffered."""
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(ProtocolError, match=r"^frame of 1025 bytes exceeds max_frame_bytes=1024; "):
        dec.feed(HEADER.pack(1025))
    assert dec.buffered <= HEADER.size  # the header only: no body byte was kept


def test_not_msgpack_is_a_protocol_error() -> None:
    """A body that is not msgpack raises ProtocolError naming the fix."""
    body = b"\xc1\xc1\xc1"  # 0xc1 is never used by msgpack
    with pytest.raises(ProtocolError, match=r"^frame body is not valid msgpack"):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_body_must_be_a_map() -> None:
    """A valid msgpack value that is not a map is refused."""
    body = msgpack.packb([1, 2, 3])
    with pytest.raises(ProtocolError, match=r"^frame body is a msgpack list, expected a map"):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_map_keys_must_be_strings() -> None:
    """Integer map keys (which a hostile client could use to confuse lookups) are refused."""
    body = msgpack.packb({1: 2})
    with pytest.raises(ProtocolError, match=r"^frame body is not valid msgpack"):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_require_checks_types() -> None:
    """require() returns a field of the asked type and refuses others, bool included for int."""
    msg = {"op": "copy", "nbytes": 5, "flag": True, "name": "x"}
    assert require(msg, "nbytes", int) == 5
    assert require(msg, "missing", int, default=3) == 3
    with pytest.raises(InvalidRequest, match=r"^field 'flag' must be int, got bool$"):
        require(msg, "flag", int)
    with pytest.raises(InvalidRequest, match=r"^field 'name' must be int, got str$"):
        require(msg, "name", int)
    with pytest.raises(InvalidRequest, match=r"^field 'missing' is missing from 'copy'; see docs/protocol.md$"):
        require(msg, "missing", int)


def test_whole_frames_and_a_partial_one_in_one_read() -> None:
    """A read of whole frames and the beginning of the next (header cut, or body cut) yields the
    whole ones at once and the rest when it arrives; the split may fall anywhere."""
    msgs = [{"id": i, "op": "ping", "pad": "y" * i} for i in range(1, 4)]
    stream = b"".join(encode(m) for m in msgs)
    second = len(encode(msgs[0]))
    for cut in range(second, len(stream)):
        dec = FrameDecoder()
        got = dec.feed(stream[:cut])
        assert got == [
            m for m, end in zip(msgs, (second, second + len(encode(msgs[1])), len(stream)), strict=True) if end <= cut
        ]
        got += dec.feed(stream[cut:])
        assert got == msgs and dec.buffered == 0


def test_oversize_header_behind_a_whole_frame_is_refused() -> None:
    """The refusal of an oversize header holds in the middle of a read as at its start."""
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(ProtocolError, match=r"^frame of 4096 bytes exceeds max_frame_bytes=1024; "):
        dec.feed(encode({"id": 1, "op": "ping"}) + HEADER.pack(4096) + b"x" * 8)


def test_a_frame_encoder_writes_what_encode_writes() -> None:
    """`FrameEncoder` (a packer kept for reuse) makes the same bytes as `encode`, call after call."""
    enc = FrameEncoder()
    msgs = [
        {"id": 1, "ok": True, "nbytes": 64, "queued_us": 3.125, "path": "dma", "missed_deadline": False},
        {"id": 2, "handle": b"\x00" * 64, "n": None},
    ]
    for msg in msgs * 2:
        assert enc(msg) == encode(msg)


def test_is_one_frame_only_for_exactly_one_whole_frame_at_a_boundary() -> None:
    """The transport decodes a read at once, whatever its size, when it is exactly one frame
    (a batch's table): not a frame and a bit, not part of one, not after a partial frame."""
    frame = encode({"id": 1, "op": "copy_batch", "segments": bytes(24 * 512)})
    dec = FrameDecoder()
    assert dec.is_one_frame(frame)
    assert (
        not dec.is_one_frame(frame[:-1]) and not dec.is_one_frame(frame + frame[:2]) and not dec.is_one_frame(frame[:3])
    )
    assert dec.feed(frame[:10]) == []
    assert not dec.is_one_frame(frame)  # the decoder holds a partial frame: ``frame`` is not at a boundary
    assert dec.feed(frame[10:]) == [msgpack.unpackb(frame[HEADER.size :])]
    assert dec.is_one_frame(frame)
