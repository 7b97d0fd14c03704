"""File descriptors across Unix sockets: who the peer is, reading fds with a frame, closing them safely.

The transport (transport.py) frames messages; this module is what it needs of the kernel for
fds: SO_PEERCRED, one reusable buffer for ``recvmsg``, the SCM_RIGHTS cap per frame, and closes
that can never block the event loop, because a hostile peer chooses what its fds are.
"""

from __future__ import annotations

import array
import fcntl
import os
import queue
import socket
import struct
import termios
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from priod.errors import ProtocolError

__all__ = [
    "MAX_FDS_PER_FRAME",
    "RECV_BYTES",
    "Peer",
    "close_all",
    "close_connection",
    "close_received",
    "fds_from_ancdata",
    "peer_credentials",
    "recvmsg",
]

MAX_FDS_PER_FRAME = 4
RECV_BYTES = 256 * 1024
"""The most bytes one read takes, and the most received bytes a `FramedSocket` holds undecoded."""
_SCM_MAX_FD = 253
"""The most fds Linux passes with one message. The ancillary buffer holds that many, not only
MAX_FDS_PER_FRAME: fds that do not fit (MSG_CTRUNC) are closed by the kernel inside recvmsg, on
the caller's thread, and closing a peer's fd can block (see `close_received`)."""
_ANC_SPACE = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)
_PEERCRED = struct.Struct("3i")
_CLOSE_THREADS = 4


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, as the kernel recorded it at connect()."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return Peer(*_PEERCRED.unpack(raw))


_recv_buffers = threading.local()


def recvmsg(
    sock: socket.socket, flags: int = 0, nbytes: int = RECV_BYTES
) -> tuple[bytes, list[tuple[int, int, bytes]], int]:
    """One ``recvmsg`` into this thread's reusable buffer: data, ancillary data, flags.

    ``sock.recvmsg(RECV_BYTES)`` allocates a fresh 256 KiB bytes object per call (an mmap and
    munmap under the allocator, with page faults), about 15 us even for a 60-byte frame, and a
    client spinning for its reply pays that on every empty poll. Each thread keeps one buffer
    (sockets are read by one thread at a time) and only the bytes received are copied out.
    At most ``nbytes`` (up to RECV_BYTES) are read.
    """
    buf = getattr(_recv_buffers, "buf", None)
    if buf is None:
        buf = _recv_buffers.buf = memoryview(bytearray(RECV_BYTES))
    nbytes, ancdata, msg_flags, _ = sock.recvmsg_into(
        [buf if nbytes >= RECV_BYTES else buf[:nbytes]], _ANC_SPACE, flags
    )
    return bytes(buf[:nbytes]), ancdata, msg_flags


_MSG_CTRUNC = int(socket.MSG_CTRUNC)
"""As a plain int: ``flags & socket.MSG_CTRUNC`` goes through `enum.IntFlag`'s Python-level
``__and__``, ~0.5 us on every frame read (the daemon's and the client's)."""


def fds_from_ancdata(ancdata: list[tuple[int, int, bytes]], flags: int) -> list[int]:
    if not ancdata and not flags & _MSG_CTRUNC:
        return []  # the usual read: no fds, nothing cut off
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
            fds.extend(arr)
    if flags & _MSG_CTRUNC or len(fds) > MAX_FDS_PER_FRAME:
        close_received(fds)
        raise ProtocolError(
            f"more than {MAX_FDS_PER_FRAME} file descriptors sent with one frame; send at most {MAX_FDS_PER_FRAME}"
        )
    return fds


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Closer:
    """A few daemon threads that close fds: a close that blocks holds one of them, never the
    loop. Threads start on first use; one that blocks delays only the fds queued behind it."""

    def __init__(self, max_threads: int) -> None:
        self._max_threads = max_threads
        self._reset()

    def _reset(self) -> None:
        """Start empty (also in a forked child, which has none of the parent's threads)."""
        self._queue: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0
        self._waiting = 0

    def submit(self, fds: list[int]) -> None:
        with self._lock:
            self._waiting += 1
            if self._waiting > self._threads - self._busy and self._threads < self._max_threads:
                self._threads += 1
                threading.Thread(target=self._run, name=f"priod-close-{self._threads}", daemon=True).start()
        self._queue.put(fds)

    def _run(self) -> None:
        while True:
            fds = self._queue.get()
            with self._lock:
                self._waiting -= 1
                self._busy += 1
            close_all(fds)
            with self._lock:
                self._busy -= 1


_closer = _Closer(_CLOSE_THREADS)
os.register_at_fork(after_in_child=_closer._reset)


def close_received(fds: Iterable[int]) -> None:
    """Close fds that a peer sent and that are not kept, on a worker thread; returns at once.

    Closing a peer's fd runs whatever its file does on its last close, and a hostile peer picks
    the file: a TCP socket with SO_LINGER and a full send queue blocks close() for the linger
    time (seconds), a file on a FUSE mount for as long as its server wants. On the event loop
    that would stall every client. The fds must not be used after this call.
    """
    batch = list(fds)
    if batch:
        _closer.submit(batch)


def close_connection(sock: socket.socket) -> None:
    """Close a connection socket without letting fds still queued in it block the caller.

    A frame the peer sent but we never read (after a protocol error, or with its output full)
    may carry fds; the kernel drops them when the socket closes, on the closing thread, with
    the same cost as `close_received`. Shut reading first (nothing more can be queued), then
    close here if nothing is queued (the common case), else on a worker thread.
    """
    try:
        sock.shutdown(socket.SHUT_RD)
        unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        unread = 1  # cannot tell: take the safe way
    if unread:
        close_received([sock.detach()])
    else:
        sock.close()
