"""Unix stream sockets carrying frames plus file descriptors (SCM_RIGHTS), for asyncio and blocking code.

asyncio's streams and transports expose no ancillary data, so fds cannot ride on them.
`FramedSocket` therefore drives a raw non-blocking socket with
``loop.add_reader`` / ``add_writer``, the pattern AnyIO uses. A sender attaches fds to the first
byte of a frame (one ``sendmsg`` per frame that carries fds). A ``recvmsg`` on Linux returns the
fds of at most one send and stops after that send's bytes, but it may begin with bytes sent
before them, unread until then: the fds belong to the last frame that begins in that read.

Memory per connection is bounded by bytes, not by frames: received bytes wait undecoded (at most
RECV_BYTES) and are decoded a slice at a time as requests are taken, and small replies queued
behind others share one buffer. A decoded 17-byte ping is some 300 bytes of objects, a reply
queued on its own some 350: a client that floods pings and never reads its replies would
otherwise cost the daemon several times ``max_output``.
"""

from __future__ import annotations

import array
import asyncio
import collections
import math
import os
import select
import socket
import time
from collections.abc import Callable, Sequence

from priod.errors import ConnectionClosed, ProtocolError
from priod.wire.fdpass import (
    MAX_FDS_PER_FRAME,
    RECV_BYTES,
    Peer,
    close_all,
    close_connection,
    close_received,
    fds_from_ancdata,
    peer_credentials,
    recvmsg,
)
from priod.wire.frames import (
    DEFAULT_MAX_FRAME,
    HEADER,
    REPLY_LIMITS,
    REQUEST_LIMITS,
    DecodeLimits,
    FrameDecoder,
    FrameEncoder,
    Message,
    encode,
)

__all__ = ["MAX_FDS_PER_FRAME", "BlockingFramedSocket", "FramedSocket", "Peer", "close_received", "peer_credentials"]

DECODE_SLICE = 4096
"""Received bytes are decoded this many at a time, when `FramedSocket.take` finds no decoded
message: a decoded message costs some 300 bytes of objects however small its frame (a 256 KiB
read of 17-byte pings, decoded at once, was some 5 MiB), while undecoded bytes cost what they are."""
OUTPUT_JOIN_BYTES = 64 * 1024
"""A frame without fds queued behind others joins the last of them, up to this size: queued on
its own, a 17-byte reply costs some 350 bytes of objects."""


def _last_frame_start(data: bytes, offset: int) -> int | None:
    """Where in ``data`` the last frame begins, walking headers from ``offset`` (a frame
    boundary); None if no frame begins there."""
    last = None
    while offset < len(data):
        last = offset
        if len(data) - offset < HEADER.size:
            break
        (length,) = HEADER.unpack_from(data, offset)
        offset += HEADER.size + length
    return last


class _Inbox:
    """Frames decoded from a byte stream, each paired with the fds that arrived with its first byte."""

    def __init__(self, max_frame: int, limits: DecodeLimits) -> None:
        self.decoder = FrameDecoder(max_frame, limits)
        self._fds_for_next: list[int] = []

    def feed(self, data: bytes, fds: list[int]) -> list[tuple[Message, list[int]]]:
        """Decode one read, all of it, with the fds that came with it."""
        if not fds:
            return self.decode(data)
        try:
            start = self.fds_start(data)
            out = self.decode(data[:start])
        except BaseException:
            close_received(fds)
            raise
        self.attach(fds)
        out += self.decode(data[start:])
        return out

    def fds_start(self, data: bytes) -> int:
        """Where the frame that a read's fds belong to begins in ``data``, the read's bytes, none
        of them decoded yet. Raises `ProtocolError` (and leaves the fds to the caller) if no
        frame begins in ``data``."""
        # One recvmsg returns the fds of at most one send and ends with that send's bytes, but
        # may begin with bytes sent before it (the rest of a frame, whole frames): the fds
        # belong to the last frame that begins in ``data``.
        to_boundary = self.decoder.bytes_to_boundary(data)
        start = _last_frame_start(data, to_boundary) if to_boundary is not None else None
        if start is None:
            raise ProtocolError(
                "file descriptors arrived in the middle of a frame; send them with a frame's first byte"
            )
        return start

    def attach(self, fds: list[int]) -> None:
        """The next frame decoded (the decoder is at a frame boundary) came with ``fds``."""
        self._fds_for_next = fds

    def decode(self, data: bytes) -> list[tuple[Message, list[int]]]:
        out: list[tuple[Message, list[int]]] = []
        for msg in self.decoder.feed(data):
            out.append((msg, self._fds_for_next))
            self._fds_for_next = []
        return out

    def close(self) -> None:
        close_received(self._fds_for_next)
        self._fds_for_next = []


class FramedSocket:
    """Frames and fds over a non-blocking Unix socket on an asyncio loop.

    Output is buffered without blocking the caller; while more than ``max_output`` bytes wait
    for a peer that does not read, this side stops reading that peer's requests, so a client
    that never reads its replies cannot grow the daemon's memory. Received bytes wait undecoded
    (reading pauses while RECV_BYTES / 2 of them wait) and are decoded DECODE_SLICE bytes at a
    time when `take` has no decoded message left, so what a peer's unhandled requests cost is
    about the bytes it sent, not some 300 bytes of objects per request.

    Frames are decoded within ``limits``: by default `REQUEST_LIMITS`, the daemon's side (so no
    daemon code path can forget them); a client reading replies passes `REPLY_LIMITS`. Fds the
    peer sent that nobody claims are closed with `close_received`, never on the loop.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_output: int = 4 << 20,
        max_inbox: int = 1024,
        limits: DecodeLimits = REQUEST_LIMITS,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._inbox = _Inbox(max_frame, limits)
        self._encode = FrameEncoder()
        self._messages: collections.deque[tuple[Message, list[int]]] = collections.deque()
        self._raw: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        """Reads not yet decoded (all of them after the first's ``_raw_off`` bytes), each with the
        fds that came with it (an entry's fds are still its own until `_decode_some` hands them
        to the inbox)."""
        self._raw_off = 0
        self._raw_fds_at = -1
        """Where in the first entry of ``_raw`` the frame its fds belong to begins; -1: not known yet."""
        self._raw_bytes = 0
        self._max_inbox = max_inbox
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._out: collections.deque[tuple[bytes | bytearray | memoryview, list[int]]] = collections.deque()
        """Frames to send, each with the fds that go with its first byte. Fd-less frames queued
        behind others share a bytearray (see `send`); only the first entry is ever sent from, so
        only it may be a memoryview of a bytearray."""
        self.output_buffered = 0
        self._max_output = max_output
        self._drained: asyncio.Future[None] | None = None
        self._reading = False
        self._writing = False
        self._burst = False
        self._held_back = False
        """`take` refused a message because output was backed up: the flush that brings it
        back within ``max_output`` wakes the listener (or `receive`) to take it."""
        self.closed = False
        self._resume_reading()

    # -- reading -------------------------------------------------------------------------
    def _resume_reading(self) -> None:
        if not self._reading and not self.closed and self._error is None:
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def _may_read(self) -> bool:
        """Nothing holds reading back: output within max_output, room in the inbox and the raw buffer."""
        return (
            self.output_buffered <= self._max_output
            and len(self._messages) < self._max_inbox
            and self._raw_bytes < RECV_BYTES // 2
        )

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def _on_readable(self) -> None:
        room = RECV_BYTES - self._raw_bytes
        if room <= 0:  # not reached (reading pauses at half of it): a read of 0 bytes would say EOF
            self._pause_reading()
            return
        try:
            data, ancdata, flags = recvmsg(self.sock, 0, room)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(ConnectionClosed(f"connection lost: {exc}"), exc)
            return
        try:
            fds = fds_from_ancdata(ancdata, flags) if ancdata or flags else []  # the usual read: no call
            if not data:
                close_received(fds)
                self._fail(ConnectionClosed("peer closed the connection"))
                return
            if (
                (len(data) <= DECODE_SLICE or self._inbox.decoder.is_one_frame(data))
                and not self._raw
                and not self._messages
            ):
                # The usual read, a request or a few, with nothing waiting: decoded at once (at
                # most a slice's worth of messages, as `_decode_some` would make of it, or one
                # frame of any size, a batch's: one message, and not 58 us of copies slice by
                # slice for a table of 512 segments, this VM).
                # (`decode` when no fds came, as `_Inbox.feed` would: one call less per request.)
                self._messages.extend(self._inbox.decode(data) if not fds else self._inbox.feed(data, fds))
            else:
                # Decoded when taken (`_decode_some`): the bytes wait, not hundreds of decoded requests.
                self._raw.append((data, fds))
                self._raw_bytes += len(data)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if not self._may_read():
            self._pause_reading()
        self._wake()

    def _decode_some(self) -> None:
        """Decode received bytes, a slice at a time, until a message comes out or none are left.

        A read's fds go with the last frame that begins in it (see `_Inbox.fds_start`), found
        when decoding reaches the read's first byte, where the decoder's state is that read's
        start. A protocol error drops the bytes behind it (closing their fds) and is raised by
        `take` once the messages before it are out; it comes before any error reading met
        later in the stream (the end of it, a reset), so it replaces that one.
        """
        raw, inbox = self._raw, self._inbox
        try:
            while not self._messages and raw:
                data, fds = raw[0]
                off = self._raw_off
                end = len(data)
                if fds:
                    if self._raw_fds_at < 0:
                        self._raw_fds_at = inbox.fds_start(data)  # off is 0: nothing of this read is decoded
                    if off == self._raw_fds_at:
                        raw[0] = (data, [])
                        inbox.attach(fds)  # the frames before it are out: the decoder is at a boundary
                    else:
                        end = self._raw_fds_at
                piece = data[off : min(end, off + DECODE_SLICE)]
                self._raw_bytes -= len(piece)
                off += len(piece)
                if off == len(data):
                    raw.popleft()
                    off = 0
                    self._raw_fds_at = -1
                self._raw_off = off
                self._messages.extend(inbox.decode(piece))
        except ProtocolError as exc:
            for _, fds in raw:
                close_received(fds)
            raw.clear()
            self._raw_off = self._raw_bytes = 0
            self._raw_fds_at = -1
            self._error = exc
            self._pause_reading()

    def _fail(self, exc: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            exc.__cause__ = cause
        if self._error is None:
            self._error = exc
        self._pause_reading()
        self._wake()

    def _drop_requests(self) -> None:
        """Forget every request received and not yet handed out, closing the fds they carried."""
        for _, fds in self._messages:
            close_received(fds)
        self._messages.clear()
        for _, fds in self._raw:
            close_received(fds)
        self._raw.clear()
        self._raw_off = self._raw_bytes = 0
        self._raw_fds_at = -1
        self._inbox.close()

    def _wake_later(self) -> None:
        """`_wake` from the send path: a listener runs on a later turn of the loop, never inside
        the caller's `send` (a reply sent from the pump's completion loop would otherwise have
        the next request handled, and the pump entered again, in the middle of that loop)."""
        if self._listener is not None:
            self._loop.call_soon(self._wake)
        else:
            self._wake()

    def _wake(self) -> None:
        if self._listener is not None:
            self._listener()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` whenever `take` may have something new (a message, or the end),
        instead of waking a `receive`. It runs in the loop callback that read the frame, so a
        request is handled without waiting for a task to be scheduled (a loop turn, 25-40 us
        of an urgent copy's round trip on the GPU host). It may be called re-entrantly (from
        `send`); the listener guards against that itself."""
        self._listener = listener

    def take(self) -> tuple[Message, list[int]] | None:
        """The next message and the fds sent with it (the caller owns them), or None if none may
        be handed out now.

        Raises `ConnectionClosed` at end of stream, `ProtocolError` for a bad frame; messages
        decoded before the error are delivered first. While more than ``max_output`` bytes of
        output wait for this peer, no message is handed out (each may add a reply, and a status
        reply is kilobytes), so unread output stays within ``max_output`` plus one frame, and
        nothing more is decoded.
        """
        if self.output_buffered > self._max_output and self._error is None and not self.closed:
            self._held_back = True
            return None
        # (`not self._reading` and ``self._raw`` are tested first: this runs twice per request,
        # and reading is usually on, with nothing undecoded.)
        if not self._messages:
            if self._raw:
                self._decode_some()
            if not self._messages:
                if self._error is not None:
                    raise self._error
                if self.closed:
                    raise ConnectionClosed("connection closed")
                if not self._reading and self._may_read():
                    self._resume_reading()  # the bytes held were a frame's beginning
                return None
        item = self._messages.popleft()
        if not self._reading and self._may_read():
            self._resume_reading()
        return item

    async def receive(self) -> tuple[Message, list[int]]:
        """The next message and its fds, waiting for it (see `take` for what it raises)."""
        while (item := self.take()) is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return item

    # -- writing -------------------------------------------------------------------------
    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Queue one frame; ``fds`` ride with its first byte and are closed here once sent."""
        if self.closed:
            close_all(fds)
            raise ConnectionClosed("cannot send: connection closed")
        frame = self._encode(msg)
        out = self._out
        if not out and not fds and not self._writing and not self._burst and self._reading and not self._held_back:
            # The usual reply: the first frame of a loop turn, with nothing queued or held back.
            # Written at once without the queue's bookkeeping; what does not go (the peer's
            # buffer is full, or it is gone) is queued below and flushed at the burst's end,
            # where `_flush` meets the error again and deals with it as with any frame.
            self._burst = True
            try:
                sent = self.sock.send(frame)
            except OSError:
                sent = 0
            self._loop.call_soon(self._end_burst)  # after the send: the reply leaves first
            if sent == len(frame):
                return
            frame = frame[sent:]
        if (
            not fds
            and len(out) > 1
            and len(frame) < OUTPUT_JOIN_BYTES
            and not out[-1][1]
            and len(out[-1][0]) < OUTPUT_JOIN_BYTES
        ):
            # Join the last queued frame, never the first (it may be half sent, and only it is
            # ever viewed by a memoryview), nor one with fds (they would go with this frame).
            tail = out[-1][0]
            if type(tail) is bytearray:
                tail += frame
            else:
                out[-1] = (bytearray(tail) + frame, [])
        else:
            out.append((frame, list(fds)))
        self.output_buffered += len(frame)
        if not self._writing and not self._burst:
            # The first frame of a loop turn goes at once; any more in the same turn (replies
            # from one poll, a window of requests) wait for its end and share one system call.
            self._burst = True
            self._flush()  # the reply first, then the bookkeeping
            self._loop.call_soon(self._end_burst)
        if self.output_buffered > self._max_output:
            self._pause_reading()

    async def drain(self) -> None:
        """Wait until the output buffer is empty (or the connection fails)."""
        while self._out and not self.closed:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await self._drained

    def _end_burst(self) -> None:
        self._burst = False
        if self._out and not self._writing and not self.closed:
            self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                view, fds = self._out[0]
                if not fds and len(self._out) > 1 and not self._out[1][1]:
                    view = self._coalesce()
                if fds:
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                    sent = self.sock.sendmsg([view], rights)
                    close_all(fds)
                    self._out[0] = (view, [])
                else:
                    sent = self.sock.send(view)
                self.output_buffered -= sent
                if sent < len(view):
                    self._out[0] = (memoryview(view)[sent:], [])
                    break
                self._out.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            # The peer is gone: drop what we could not send; the reader will see EOF.
            for _, fds in self._out:
                close_all(fds)
            self._out.clear()
            self.output_buffered = 0
            self._fail(ConnectionClosed(f"connection lost while sending: {exc}"), exc)
            # Nobody can read an answer any more: the requests still buffered are dropped, not
            # handled (100 clients that flooded and left once kept the loop busy for 50 s).
            self._drop_requests()
        if self.output_buffered <= self._max_output and (self._held_back or not self._reading):
            # A take() held back by full output, or reading paused (by it, or by an error), may
            # go on. Not after every reply: a read pass on the next turn that finds nothing
            # costs ~5 us of the loop per copy.
            self._held_back = False
            self._wake_later()
        if self._out and not self._writing and not self.closed:
            self._loop.add_writer(self.fd, self._flush)
            self._writing = True
        elif not self._out:
            if self._writing:
                self._loop.remove_writer(self.fd)
                self._writing = False
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)
            self._drained = None
            if self._may_read():
                self._resume_reading()

    def _coalesce(self) -> bytes:
        """Join the leading frames that carry no fds (up to RECV_BYTES) into one entry."""
        parts: list[bytes | bytearray | memoryview] = []
        size = 0
        while self._out and not self._out[0][1] and size < RECV_BYTES:
            view = self._out.popleft()[0]
            parts.append(view)
            size += len(view)
        joined = b"".join(parts)
        self._out.appendleft((joined, []))
        return joined

    def close(self) -> None:
        """Close at once; unsent output and unclaimed fds are dropped."""
        if self.closed:
            return
        if self._out and not self._writing:
            self._flush()  # frames held back by this loop turn's burst still go, as if sent at once
        self.closed = True
        self._pause_reading()
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        for _, fds in self._out:
            close_all(fds)  # ours, on their way out: nothing a peer chose
        self._out.clear()
        self._drop_requests()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._wake()
        close_connection(self.sock)


class BlockingFramedSocket:
    """The same framing over a blocking socket, for `priod.SyncClient` and scripts (the client's
    side: replies are decoded within `REPLY_LIMITS` unless ``limits`` says otherwise)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        spin_s: float = 0.0,
        limits: DecodeLimits = REPLY_LIMITS,
        peer: str = "",
    ) -> None:
        """``peer``: what the errors of a lost connection name (the daemon's socket path)."""
        if sock.gettimeout() == 0.0:
            sock.setblocking(True)  # a socket with a timeout keeps it
        self.sock = sock
        self._inbox = _Inbox(max_frame, limits)
        self._messages: collections.deque[tuple[Message, list[int]]] = collections.deque()
        self.spin_s = spin_s
        """Busy-poll this long for a reply before sleeping in recv: waking a sleeping process
        costs tens to hundreds of microseconds, more than an urgent copy itself."""
        self.peer = peer

    def _lost(self, why: object) -> ConnectionClosed:
        """The error of a connection the peer ended (it exited, or closed it), as the async
        client's: `ConnectionClosed`, never a bare BrokenPipeError or ConnectionResetError."""
        at = f" at {self.peer}" if self.peer else ""
        return ConnectionClosed(f"connection to priod{at} lost: {why}")

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Raises:
        ConnectionClosed: the peer is gone (EPIPE, ECONNRESET)."""
        frame = encode(msg)
        try:
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                sent = self.sock.sendmsg([frame], rights)
                if sent < len(frame):
                    self.sock.sendall(frame[sent:])
            else:
                self.sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            raise self._lost(exc) from exc

    def _recvmsg(self, flags: int = 0) -> tuple[bytes, list[tuple[int, int, bytes]], int]:
        try:
            return recvmsg(self.sock, flags)
        except (ConnectionResetError, ConnectionAbortedError) as exc:
            raise self._lost(exc) from exc

    def _recv(self, spin_s: float) -> tuple[bytes, list[tuple[int, int, bytes]], int]:
        if spin_s > 0:
            deadline = time.perf_counter() + spin_s
            while time.perf_counter() < deadline:
                try:
                    data, ancdata, flags = self._recvmsg(socket.MSG_DONTWAIT)
                    return data, ancdata, flags
                except BlockingIOError:
                    os.sched_yield()  # see `receive_or_wake`
        data, ancdata, flags = self._recvmsg()
        return data, ancdata, flags

    def receive(self, spin_s: float | None = None) -> tuple[Message, list[int]]:
        """The next message; `ConnectionClosed` once the peer is gone. ``spin_s``: this wait's
        busy-poll, instead of the socket's `spin_s`."""
        while not self._messages:
            self._take_in(*self._recv(self.spin_s if spin_s is None else spin_s))
        return self._messages.popleft()

    def _take_in(self, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        fds = fds_from_ancdata(ancdata, flags)
        if not data:
            close_received(fds)
            raise self._lost("the daemon closed the connection")
        self._messages.extend(self._inbox.feed(data, fds))

    def receive_within(self, timeout: float, spin_s: float | None = None) -> tuple[Message, list[int]] | None:
        """The next message if one arrives within ``timeout`` seconds (0: only what is already
        here), else None. For clients that wait for one of several replies with a deadline.
        ``spin_s``: as `receive`'s."""
        deadline = time.perf_counter() + max(timeout, 0.0)
        spin = self.spin_s if spin_s is None else spin_s
        # Spin first, as `_recv` does (no wake-up to pay), but only on a socket without a timeout
        # of its own: Python waits for readiness up to that timeout even with MSG_DONTWAIT.
        spin_until = min(deadline, time.perf_counter() + spin) if self.sock.gettimeout() is None else 0.0
        while not self._messages and time.perf_counter() < spin_until:
            try:
                self._take_in(*self._recvmsg(socket.MSG_DONTWAIT))
            except BlockingIOError:
                os.sched_yield()  # see `receive_or_wake`
        while not self._messages:
            ready, _, _ = select.select([self.sock], [], [], max(deadline - time.perf_counter(), 0.0))
            if not ready:
                return None
            self._take_in(*self._recvmsg())
        return self._messages.popleft()

    def receive_or_wake(
        self, timeout: float, wake_fd: int, woken: Callable[[], bool], spin_s: float | None = None
    ) -> tuple[Message, list[int]] | None:
        """As `receive_within`, but also return None as soon as ``woken()`` is true (checked while
        spinning: a shared-memory completion costs no system call) or ``wake_fd`` is readable."""
        if self._messages:
            return self._messages.popleft()
        now = time.perf_counter()
        deadline = now + max(timeout, 0.0)
        spin = self.spin_s if spin_s is None else spin_s
        spin_until = min(deadline, now + spin) if self.sock.gettimeout() is None else 0.0
        while time.perf_counter() < spin_until:
            if woken():
                return None
            # Give the CPU up to any task waiting for it, without sleeping: the daemon woken by
            # this copy's doorbell may be queued on this very CPU, and a spin that does not
            # yield holds it off for the whole spin (2-vCPU VM, sim, an urgent 64-byte copy
            # every 5 ms with a 2 ms spin: 6% of copies took over 2 ms, p99 2.33-2.38 ms;
            # yielding, none, p99 0.45-0.51 ms). With nothing else runnable it returns at once.
            os.sched_yield()
        while not self._messages:
            if woken():
                return None
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            fd = self.sock.fileno()
            ready, _, _ = select.select([fd, wake_fd], [], [], None if left == math.inf else left)
            if not ready:
                return None
            if fd in ready:
                self._take_in(*self._recvmsg())
            elif ready:
                return None
        return self._messages.popleft()

    def close(self) -> None:
        for _, fds in self._messages:
            close_received(fds)
        self._messages.clear()
        self._inbox.close()
        self.sock.close()
