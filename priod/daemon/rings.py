"""A connection's copy ring in the daemon (the layout and its rules: `priod.wire.ring`).

The daemon makes the ring's memfd (sealed: the client can neither shrink nor grow it) and both
eventfds; it keeps its own mapping of the memfd and both eventfds, and the client gets the memfd
and duplicates of the eventfds. So a hostile client can write anything into the ring's bytes and
its doorbell, and nothing else: what it writes is checked (`SubmissionReader`), a completion
queue it never reads makes the daemon answer on the socket, and unmapping or closing its copies
changes nothing here.

The mapping is the engine's (`Engine.map_host`: pinned and mapped for the GPU on CUDA), so that
the GPU can store a copy's landed word into it (`LandedWord`). It therefore outlives the
connection while a store into it may still be queued on a stream: until the last copy that asked
for one has ended.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
from collections.abc import Callable

from priod.daemon.engines.base import Engine, HostMemory
from priod.wire.ring import (
    RING_ENTRIES,
    CompletionWriter,
    LandedStamps,
    SubmissionReader,
    ring_bytes,
    write_header,
)

__all__ = ["RING_FDS", "CopyRing", "LandedWord"]

RING_FDS = 3
"""Open files the daemon holds for one connection's ring."""


class CopyRing:
    """One connection's ring: the submissions it reads and the completions it writes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_doorbell: Callable[[], None],
        engine: Engine,
        release: Callable[[HostMemory], None],
    ) -> None:
        """``engine`` maps the ring (pinned and mapped for the GPU on CUDA: its 412 KiB, once per
        connection); ``release`` gives the mapping back, off the loop (`RegionTable.release_host_later`)."""
        size = ring_bytes(RING_ENTRIES)
        self.fd = os.memfd_create("priod-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.doorbell = self.wake_fd = -1
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            """Written by the client after it publishes descriptors."""
            self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            """Written by the daemon after it publishes completions."""
            self._mem: HostMemory | None = engine.map_host(self.fd, size)
        except BaseException:
            for fd in (self.fd, self.doorbell, self.wake_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        self._release = release
        mapping: mmap.mmap = self._mem.mapping
        self._buf = memoryview(mapping)
        write_header(self._buf, RING_ENTRIES)
        self.submissions = SubmissionReader(self._buf, RING_ENTRIES)
        self.completions = CompletionWriter(self._buf, RING_ENTRIES)
        """Where a done copy's completion is written (`complete_on_ring`); then `completed_one`."""
        self.landed = LandedStamps(self._buf, RING_ENTRIES) if engine.stores_landed else None
        """Where the figures of a copy whose landed word the engine stores go (None: this engine
        stores none, and the client waits for the completion)."""
        self.landed_stored = 0
        """Copies whose landed word this ring's client asked for and the engine took."""
        self.landed_in_flight = 0
        """Copies whose landed word is queued on a stream and that have not ended: the mapping
        stays until they have."""
        self._loop = loop
        self._wake_due = False
        self._burst = False
        self.completed = 0
        """Completions written to the ring (the rest of this connection's replies went by the socket)."""
        self.closed = False
        loop.add_reader(self.doorbell, self._rung, on_doorbell)

    def client_fds(self) -> list[int]:
        """For the client, once: the memfd itself (the daemon's mapping keeps the memory), and
        duplicates of its doorbell and the daemon's wake-up. The daemon then holds three fds
        for the ring (`RING_FDS`): the two eventfds and the one its mapping keeps."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            raise RuntimeError("a ring's fds go to its client once")
        return [fd, os.dup(self.doorbell), os.dup(self.wake_fd)]

    def _rung(self, on_doorbell: Callable[[], None]) -> None:
        # Read (and so reset) the doorbell before the queue is looked at: a descriptor published
        # after that look rings it again.
        try:
            os.eventfd_read(self.doorbell)
        except BlockingIOError:
            pass
        on_doorbell()

    def completed_one(self) -> None:
        """Count a completion just written to `completions` and wake the client for it."""
        self.completed += 1
        if not self._burst:
            # The first completion of a loop turn wakes the client at once (a copy waited for
            # alone is answered without the rest of the turn before it); any more in the same
            # turn share one wake-up at its end, as the socket's replies share one send.
            self._burst = True
            self._wake()
            self._loop.call_soon(self._end_burst)
        else:
            self._wake_due = True

    def _wake(self) -> None:
        try:
            os.eventfd_write(self.wake_fd, 1)
        except BlockingIOError:
            pass  # the counter is full: the client has a wake-up pending anyway

    def _end_burst(self) -> None:
        self._burst = False
        if self._wake_due and not self.closed:
            self._wake_due = False
            self._wake()

    def landed_store(
        self, seq: int, first_submit: float, arrival: float, express: bool
    ) -> tuple[HostMemory, int, int] | None:
        """Stamp descriptor ``seq``'s figures and give the engine's store of its landed word
        (`ChunkJob.landed`); None once the ring is closed (nobody waits) or where the engine
        stores none."""
        stamps, mem = self.landed, self._mem
        if self.closed or stamps is None or mem is None:
            return None
        stamps.stamp(seq, int(first_submit * 1e9), int((first_submit - arrival) * 1e9), express)
        offset, value = stamps.landed_word(seq)
        return mem, offset, value

    def landed_ended(self) -> None:
        """A copy whose landed word was handed to the engine has ended (its last chunk's
        completion, which follows the store, was seen)."""
        self.landed_in_flight -= 1
        if self.closed and self.landed_in_flight <= 0:
            self._release_memory()

    def _release_memory(self) -> None:
        mem, self._mem = self._mem, None
        if mem is not None:
            self._release(mem)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.doorbell)
        self.submissions.release()
        self.completions.release()
        if self.landed is not None:
            self.landed.release()
        self._buf.release()
        if self.landed_in_flight <= 0:
            self._release_memory()  # else once the last copy with a store queued has ended
        for fd in (self.fd, self.doorbell, self.wake_fd):
            if fd >= 0:
                os.close(fd)


class LandedWord:
    """A ring copy that asked for its landed word (`priod.wire.ring.WANT_LANDED`): what the pump
    hands the engine with its last chunk, and whether it did."""

    __slots__ = ("placed", "ring", "seq")

    def __init__(self, ring: CopyRing, seq: int) -> None:
        self.ring, self.seq = ring, seq
        self.placed = False

    def job(self, first_submit: float, arrival: float, express: bool) -> tuple[HostMemory, int, int] | None:
        """The engine's store for this copy (`CopyRing.landed_store`)."""
        return self.ring.landed_store(self.seq, first_submit, arrival, express)

    def handed(self) -> None:
        """The engine took the store: the ring's memory stays until the copy has ended."""
        self.placed = True
        self.ring.landed_in_flight += 1
        self.ring.landed_stored += 1

    def ended(self) -> None:
        if self.placed:
            self.placed = False
            self.ring.landed_ended()
