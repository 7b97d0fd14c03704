"""A mailbox: one copy at a time through shared memory, for the shortest urgent round trip.

Why: measured on the H200 host (docs/benchmarks.md, "Where an urgent copy's time goes"), a
64 KiB urgent copy through the socket spent ~55 us in the daemon from its arrival to its
completion seen, but ~180 us end to end: the rest is the socket hop each way, the frame
decoding and the reply, in Python, on both sides. A mailbox takes those out. The client
writes the request into a small shared page and flips its state; the daemon, whose loop is
awake anyway while urgent copies are about (pump.py), reads it on its next turn and writes
the result back the same way; the client spins on the state word. When the daemon's loop is
not awake (``awake_until`` in the page is past), the client also sends a ``kick`` frame.

The page is the client's to scribble on: the daemon copies the request out once, validates it
exactly as a ``copy`` frame (`messages.Copy`), and never reads it again; whatever the client
writes can only refuse or confuse its own copies.

Layout (256 bytes, little-endian; x86 keeps stores in order, and each side writes the state
word last):

    0   u32 state       IDLE, SUBMITTED (client), TAKEN, DONE, FAILED (daemon)
    4   u32 seq         the client's number for this request, echoed in the result
    8   f64 awake_until the daemon's loop polls mailboxes until this time.perf_counter()
    16  request: u64 dst, src, nbytes, dst_offset, src_offset; f64 deadline_ms (NaN: none);
        32 bytes priority (UTF-8, NUL-padded)
    96  result: f64 queued_us, transfer_us, total_us; u8 path (0 dma, 1 express); u8 missed
        deadline; 6 pad; u64 bytes_done; 24 bytes error code; 96 bytes error message
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time

from .engines.sim import sealed_memfd
from .errors import InvalidRequest
from .messages import Copy, CopyReply, ErrorReply

__all__ = ["MAILBOX_BYTES", "ClientMailbox", "DaemonMailbox", "MailboxRefusal"]

MAILBOX_BYTES = 256
IDLE, SUBMITTED, TAKEN, DONE, FAILED = 0, 1, 2, 3, 4

_HEAD = struct.Struct("<II")  # state, seq
_AWAKE = struct.Struct("<d")
_REQUEST = struct.Struct("<QQQQQd32s")
_RESULT = struct.Struct("<dddBB6xQ24s96s")
_AWAKE_AT, _REQUEST_AT, _RESULT_AT = 8, 16, 96
_PATHS = ("dma", "express")


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class DaemonMailbox:
    """The daemon's side of one client's mailbox."""

    def __init__(self) -> None:
        self.fd = sealed_memfd("priod-mailbox", MAILBOX_BYTES)
        self._map = mmap.mmap(self.fd, MAILBOX_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._awake = 0.0

    def take(self) -> tuple[int, Copy] | None:
        """The request the client submitted, if any, marked taken; InvalidRequest if it is not
        a valid copy (the caller answers it in the mailbox, under the returned seq)."""
        state, seq = _HEAD.unpack_from(self._map, 0)
        if state != SUBMITTED:
            return None
        _HEAD.pack_into(self._map, 0, TAKEN, seq)
        dst, src, nbytes, dst_offset, src_offset, deadline_ms, priority = _REQUEST.unpack_from(self._map, _REQUEST_AT)
        try:
            copy = Copy(
                dst, src, nbytes, dst_offset, src_offset, _text(priority), None if math.isnan(deadline_ms) else deadline_ms
            )
            copy.check()
        except (InvalidRequest, UnicodeError) as exc:
            raise MailboxRefusal(seq, exc) from None
        return seq, copy

    def finish(self, seq: int, reply: CopyReply | ErrorReply) -> None:
        """Write the copy's result, then its state: the client is spinning on the state word."""
        if isinstance(reply, CopyReply):
            _RESULT.pack_into(
                self._map, _RESULT_AT, reply.queued_us, reply.transfer_us, reply.total_us,
                _PATHS.index(reply.path), reply.missed_deadline, reply.nbytes, b"", b"",
            )  # fmt: skip
            state = DONE
        else:
            _RESULT.pack_into(
                self._map, _RESULT_AT, 0.0, 0.0, 0.0, 0, 0, reply.bytes_done or 0,
                reply.code.encode()[:24], reply.message.encode()[:96],
            )  # fmt: skip
            state = FAILED
        _HEAD.pack_into(self._map, 0, state, seq)

    def set_awake(self, until: float) -> None:
        """Tell the client until when the daemon's loop polls mailboxes without a kick."""
        if until != self._awake:
            self._awake = until
            _AWAKE.pack_into(self._map, _AWAKE_AT, until)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


class MailboxRefusal(Exception):
    """A mailbox request that is not a valid copy: answered under its seq."""

    def __init__(self, seq: int, error: Exception) -> None:
        super().__init__(str(error))
        self.seq = seq
        self.error = error


class ClientMailbox:
    """The client's side: submit one copy, spin on its result."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, MAILBOX_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._seq = 0

    def submit(self, copy: Copy) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        deadline = math.nan if copy.deadline_ms is None else copy.deadline_ms
        _REQUEST.pack_into(
            self._map, _REQUEST_AT, copy.dst, copy.src, copy.nbytes, copy.dst_offset, copy.src_offset, deadline, copy.priority.encode()
        )
        _HEAD.pack_into(self._map, 0, SUBMITTED, self._seq)
        return self._seq

    def daemon_awake(self, margin_s: float = 100e-6) -> bool:
        """Whether the daemon's loop will look at the mailbox on its own (no kick needed)."""
        (until,) = _AWAKE.unpack_from(self._map, _AWAKE_AT)
        return bool(time.perf_counter() + margin_s < until)

    def result(self) -> CopyReply | ErrorReply | None:
        """The result of the last submitted copy, once the daemon has written it."""
        state, seq = _HEAD.unpack_from(self._map, 0)
        if seq != self._seq or state not in (DONE, FAILED):
            return None
        queued, transfer, total, path, missed, nbytes, code, message = _RESULT.unpack_from(self._map, _RESULT_AT)
        if state == DONE:
            return CopyReply(nbytes, queued, transfer, total, _PATHS[path] if path < 2 else "dma", bool(missed))
        return ErrorReply(_text(code) or "internal", _text(message), nbytes)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass
