"""The typed messages: each request and reply survives encode then decode, and every field is
checked once, at decode, with an error that says what to do."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from priod.daemon.copies import _reply_us
from priod.errors import Cancelled, EngineError, InvalidRequest, LimitExceeded
from priod.wire.messages import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    AllocDevice,
    AllocHost,
    Cancel,
    CancelReply,
    Copy,
    CopyBatch,
    CopyBatchReply,
    CopyReply,
    Empty,
    ErrorReply,
    Free,
    Hello,
    HelloReply,
    HoldPageReply,
    Ping,
    RegionReply,
    RegisterDevice,
    RegisterHost,
    Request,
    Share,
    StatusReply,
    StatusRequest,
    decode_request,
    error_of,
)

REQUESTS: list[Request] = [
    Hello(PROTOCOL_VERSION, "me"),
    Ping(),
    StatusRequest(),
    AllocHost(4096),
    RegisterHost(4096),
    AllocDevice(4096, 1),
    RegisterDevice(b"\x01" * 64, 4096, 128, 0),
    Free(3),
    Share(3, 1000),
    Copy(1, 2, 4096, 8, 16, "urgent", 2.5),
    Copy(1, 2, 4096),
    CopyBatch(1, 2, bytes(48), "urgent", 1.0),
    CopyBatch(1, 2, bytes(24)),
    Cancel(7),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_survives_the_wire(req: Request) -> None:
    wire = msgpack.unpackb(msgpack.packb(req.encode(42)), raw=False)
    assert wire["id"] == 42 and wire["op"] == req.op
    fds = 1 if isinstance(req, RegisterHost) else 0
    assert decode_request(wire, fds=fds) == req


def test_the_written_out_copy_forms_agree_with_the_general_ones() -> None:
    """`Copy` and `CopyBatch` encode and decode their common case by hand (they come thousands of
    times a second); for every message, usual or not, the result or the error is the general
    way's, and encoding gives what the general encoder gives."""
    h = b"\x07" * 64
    batches: list[dict[str, Any]] = [
        {"dst": 1, "src": 2, "segments": bytes(24)},
        {"dst": 1, "src": 2, "segments": bytes(48), "priority": "urgent", "deadline_ms": 2.5},
        {
            "dst": 1,
            "src": 2,
            "segments": bytes(24),
            "deadline_ms": 3,
        },  # an int deadline: the general way makes it a float
        {"dst": 1, "src": 2, "segments": bytes(24), "deadline_ms": None, "wait_event": h, "signal_event": h},
        {"dst": 1, "src": 2, "segments": "0,0,24"},
        {"dst": True, "src": 2, "segments": bytes(24)},
        {"src": 2, "segments": bytes(24)},
        {"dst": 1, "src": 2, "segments": bytes(24), "priority": 3},
    ]
    copies: list[dict[str, Any]] = [
        {"dst": 1, "src": 2, "nbytes": 64},
        {"dst": 1, "src": 2, "nbytes": 64, "dst_offset": 8, "priority": "urgent", "deadline_ms": 1},
        {"dst": 1, "src": 2, "nbytes": 1.5},
        {"dst": 1, "src": 2, "nbytes": 64, "signal_event": h},
    ]
    for kind, fields in [(CopyBatch, f) for f in batches] + [(Copy, f) for f in copies]:
        general: Any
        try:
            general = kind(**kind._read(fields))
        except InvalidRequest as exc:
            general = str(exc)
        try:
            fast: Any = kind.decode(fields)
        except InvalidRequest as exc:
            fast = str(exc)
        assert fast == general, fields
        if isinstance(fast, kind):
            assert fast.encode(9) == {
                "id": 9,
                "op": kind.op,
                **{k: v for k, v in fast._fields_dict().items() if v is not None},
            }


def test_every_op_has_a_type() -> None:
    assert set(REQUEST_TYPES) == {
        *("hello", "ping", "status", "alloc_host", "register_host", "alloc_device", "register_device"),
        *("free", "share", "copy", "copy_batch", "cancel", "hold_page", "ring"),
    }


def test_replies_survive_the_wire() -> None:
    replies: list[tuple[Any, Any]] = [
        (
            HelloReply(1, "priod", "0.1.0", "sim", 1 << 20, ["urgent", "bulk"], {"pid": 1, "uid": 2, "gid": 3}),
            HelloReply,
        ),
        (RegionReply(5, 4096, "device", 0, {"kind": "memfd", "offset": 0}), RegionReply),
        (RegionReply(6, 4096, "host"), RegionReply),
        (CopyReply(4096, 1.5, 2.5, 4.0, "dma", True), CopyReply),
        (CopyBatchReply(8192, 512, 1.5, 2.5, 4.0, "express", False), CopyBatchReply),
        (CancelReply(9, "stopping"), CancelReply),
        (StatusReply({"lanes": []}), StatusReply),
        (
            HoldPageReply(
                [{"device": 0, "device_uuid": "GPU-00000000-0000-0000-0000-000000000000", "direction": "h2d"}]
            ),
            HoldPageReply,
        ),
        (Empty(), Empty),
    ]
    for reply, kind in replies:
        wire = msgpack.unpackb(msgpack.packb(reply.encode(3)), raw=False)
        assert wire["id"] == 3 and wire["ok"] is True and error_of(wire) is None
        assert kind.decode(wire) == reply


def test_an_error_reply_becomes_the_exception_it_stands_for() -> None:
    wire = ErrorReply("cancelled", "copy cancelled after 4096 of 8192 bytes", 4096).encode(3)
    assert wire == {
        "id": 3,
        "ok": False,
        "error": {"code": "cancelled", "message": "copy cancelled after 4096 of 8192 bytes", "bytes_done": 4096},
    }
    exc = error_of(wire)
    assert isinstance(exc, Cancelled) and exc.bytes_done == 4096
    assert isinstance(error_of(ErrorReply.of(LimitExceeded("too much")).encode(1)), LimitExceeded)


def test_an_error_reply_keeps_a_batch_s_progress_whatever_its_code() -> None:
    """bytes_done and segments_done survive the wire on cancelled and on failed copies alike."""
    cancelled = error_of(ErrorReply("cancelled", "copy cancelled", 4096, 3).encode(1))
    assert isinstance(cancelled, Cancelled) and (cancelled.bytes_done, cancelled.segments_done) == (4096, 3)
    failed = error_of(ErrorReply("engine", "copy failed", 8192, 5).encode(1))
    assert isinstance(failed, EngineError) and (failed.bytes_done, failed.segments_done) == (8192, 5)
    single = error_of(ErrorReply("engine", "copy failed", 100).encode(1))
    assert isinstance(single, EngineError) and (single.bytes_done, single.segments_done) == (100, None)


@pytest.mark.parametrize(
    ("msg", "fds", "greeted", "error"),
    [
        ({"op": "ping"}, 0, True, r"^every request needs an integer 'id' between 1 and 2\*\*63-1"),
        ({"id": True, "op": "ping"}, 0, True, r"^every request needs an integer 'id'"),
        ({"id": 1, "op": "explode"}, 0, True, r"^unknown op 'explode'; known ops: "),
        ({"id": 1, "op": "ping"}, 0, False, r"^send 'hello' with your protocol version before any other request$"),
        (
            {"id": 1, "op": "hello", "v": 3},
            0,
            False,
            r"^protocol version 3 is not supported; this daemon speaks version 2",
        ),
        ({"id": 1, "op": "ping"}, 1, True, r"^'ping' takes no file descriptors, but 1 came with it; they were closed$"),
        (
            {"id": 1, "op": "register_host", "nbytes": 4096},
            0,
            True,
            r"^'register_host' takes exactly one memfd with the frame, got 0$",
        ),
        (
            {"id": 1, "op": "copy", "dst": 1, "src": 2},
            0,
            True,
            r"^field 'nbytes' is missing from 'copy'; see docs/protocol.md$",
        ),
        ({"id": 1, "op": "copy", "dst": 1, "src": True, "nbytes": 4}, 0, True, r"^field 'src' must be int, got bool$"),
        (
            {"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 0},
            0,
            True,
            r"^nbytes = 0 is invalid; copy at least 1 byte$",
        ),
        (
            {"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 4, "src_offset": -1},
            0,
            True,
            r"^src_offset = -1 is invalid; it must be >= 0$",
        ),
        (
            {"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 4, "deadline_ms": math.nan},
            0,
            True,
            r"^deadline_ms = nan is invalid; give a finite number",
        ),
        (
            {"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 4, "deadline_ms": -math.inf},
            0,
            True,
            r"^deadline_ms = -inf is invalid",
        ),
        (
            {"id": 1, "op": "alloc_device", "nbytes": 4096, "device": "0"},
            0,
            True,
            r"^device '0' names no GPU; give the daemon's ordinal as an int \(0\)",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"", "nbytes": 4096, "kind": "vmm_fd", "size": 2 << 20},
            0,
            True,
            r"^'register_device' of kind 'vmm_fd' takes exactly one fd \(the allocation's POSIX fd\) with the frame, got 0$",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"h" * 64, "nbytes": 4096},
            1,
            True,
            r"^'register_device' takes no file descriptors, but 1 came",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"", "nbytes": 1, "kind": "dmabuf"},
            0,
            True,
            r"^kind = 'dmabuf' is invalid; register_device takes kind 'cuda_ipc' or",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"", "nbytes": 4096, "kind": "vmm_fd"},
            1,
            True,
            r"^size = None is invalid; kind 'vmm_fd' needs the whole allocation's size",
        ),
        (
            {
                "id": 1,
                "op": "register_device",
                "handle": b"",
                "nbytes": 4096,
                "offset": 4096,
                "kind": "vmm_fd",
                "size": 4096,
            },
            1,
            True,
            r"^offset 4096 \+ nbytes 4096 is past the allocation's size 4096; the buffer must lie within it$",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"e" * 64, "nbytes": 4096, "kind": "pool_fd", "size": 2 << 20},
            0,
            True,
            r"^'register_device' of kind 'pool_fd' takes exactly one fd \(the pool's POSIX fd\) with the frame, got 0$",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"e" * 64, "nbytes": 4096, "kind": "pool_fd", "size": 2 << 20},
            2,
            True,
            r"^'register_device' of kind 'pool_fd' takes exactly one fd \(the pool's POSIX fd\) with the frame, got 2$",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"e" * 63, "nbytes": 4096, "kind": "pool_fd", "size": 2 << 20},
            1,
            True,
            r"^handle is 63 bytes; kind 'pool_fd' needs the allocation's 64-byte CUmemPoolPtrExportData \(what cuMemPoolExportPointer gives\)",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"", "nbytes": 4096, "kind": "pool_fd", "size": 2 << 20},
            1,
            True,
            r"^handle is 0 bytes; kind 'pool_fd' needs",
        ),
        (
            {"id": 1, "op": "register_device", "handle": b"e" * 64, "nbytes": 4096, "kind": "pool_fd"},
            1,
            True,
            r"^size = None is invalid; kind 'pool_fd' needs the whole allocation's size",
        ),
        (
            {
                "id": 1,
                "op": "register_device",
                "handle": b"e" * 64,
                "nbytes": 4096,
                "offset": 1,
                "kind": "pool_fd",
                "size": 4096,
            },
            1,
            True,
            r"^offset 1 \+ nbytes 4096 is past the allocation's size 4096; the buffer must lie within it$",
        ),
    ],
)
def test_bad_requests_are_refused_with_the_fix(msg: dict[str, object], fds: int, greeted: bool, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        decode_request(msg, greeted=greeted, fds=fds)


def test_a_whole_number_deadline_is_a_float_and_none_means_no_deadline() -> None:
    assert decode_request({"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 4, "deadline_ms": 5}) == Copy(
        1, 2, 4, deadline_ms=5.0
    )
    assert decode_request({"id": 1, "op": "copy", "dst": 1, "src": 2, "nbytes": 4, "deadline_ms": None}) == Copy(
        1, 2, 4
    )


def test_register_device_of_a_vmm_allocation_takes_its_fd() -> None:
    """kind vmm_fd comes with one fd and the allocation's size; the default kind with none (and a
    frame without kind or size, from an older client, is that default)."""
    req = decode_request(
        {
            "id": 1,
            "op": "register_device",
            "handle": b"",
            "nbytes": 4096,
            "offset": 8192,
            "kind": "vmm_fd",
            "size": 2 << 20,
        },
        fds=1,
    )
    assert req == RegisterDevice(b"", 4096, 8192, kind="vmm_fd", size=2 << 20)
    # kind pool_fd: the pool's fd beside the frame, the allocation's 64-byte export data as handle
    pool = RegisterDevice(
        bytes(range(64)), 4096, 8192, 1, "GPU-00000000-0000-0000-0000-000000000000", kind="pool_fd", size=1 << 20
    )
    assert decode_request(msgpack.unpackb(msgpack.packb(pool.encode(7)), raw=False), fds=1) == pool
    assert "kind" not in RegisterDevice(b"h" * 64, 4096).encode(1)
    assert decode_request({"id": 1, "op": "register_device", "handle": b"h" * 64, "nbytes": 4096}) == RegisterDevice(
        b"h" * 64, 4096
    )


@given(st.floats(min_value=0.0, max_value=3600.0))
def test_reply_microseconds_are_rounded_to_the_nanosecond(seconds: float) -> None:
    """A copy reply's timings (`copies._reply_us`, whole nanoseconds / 1e3, cheaper than
    ``round(x, 3)``) are ``round(seconds * 1e6, 3)``: the same below 100 s, where a copy's timings
    lie; at most one nanosecond apart above, where float spacing meets the nanosecond."""
    us = _reply_us(seconds)
    if seconds < 100:
        assert us == round(seconds * 1e6, 3)
    assert abs(us - round(seconds * 1e6, 3)) <= 1.0001e-3
