"""The client's side of a connection's copy ring (the layout and its rules: `priod.wire.ring`).

`ClientRing` maps the daemon's memfd, publishes plain copies as descriptors and reads their
completions back as the replies the socket would have brought. The doorbell is rung after the
descriptors are published: by the async client for a loop turn's first copy and once more at the
turn's end if more followed, by the blocking one once per copy.

A copy the client spins for asks for its landed word (`priod.wire.ring.WANT_LANDED`): the GPU
stores it right behind the copy's bytes, and `landed_reply` makes the copy's reply from it and
the figures the daemon stamped, without waiting for the daemon to see the copy done. The
completion that follows is dropped by the caller (its request is no longer pending).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from priod.wire.messages import Copy, CopyBatch
from priod.wire.ring import CompletionReader, LandedReader, SubmissionWriter, check_header, ring_eligible

__all__ = ["ClientRing"]


class ClientRing:
    """A mapped ring and its two eventfds; ``fds``: (memfd, doorbell, wake-up), now owned here."""

    def __init__(self, fds: list[int]) -> None:
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"the daemon's ring reply came with {len(fds)} fds instead of 3")
        memfd, self.doorbell, self.wake_fd = fds
        try:
            self._map = mmap.mmap(memfd, os.fstat(memfd).st_size)
        finally:
            os.close(memfd)  # the mapping keeps the memory
        self._buf = memoryview(self._map)
        try:
            entries = check_header(self._buf)
        except BaseException:
            self._release()
            raise
        self._writer = SubmissionWriter(self._buf, entries)
        self._reader = CompletionReader(self._buf, entries)
        self._landed = LandedReader(self._buf, entries)
        self.closed = False

    @staticmethod
    def eligible(req: Copy | CopyBatch) -> bool:
        return ring_eligible(req)

    def submit(self, req_id: int, req: Copy | CopyBatch, landed: bool = False) -> int | None:
        """Publish a copy or batch (ring the doorbell after, `ring`): its sequence number, or
        None if the ring (or its table area) is full, or closed. ``landed``: ask for its landed
        word (`landed`, `landed_reply`)."""
        return None if self.closed else self._writer.try_submit(req_id, req, landed)

    def taken(self, seq: int) -> bool:
        """Whether the daemon has taken the descriptor published as ``seq`` (its head passed
        it); readable after the daemon is gone, from this process's own mapping."""
        return not self.closed and self._writer.taken(seq)

    def landed(self, seq: int) -> bool:
        """Whether the copy published as ``seq`` (with ``landed``) has landed, as the GPU said."""
        return not self.closed and self._landed.landed(seq)

    def completion_or_landed(self, seq: int) -> Callable[[], bool]:
        """What a client spinning for the copy published as ``seq`` looks at: a completion
        (its own or another's), or the copy's landed word."""

        def woken() -> bool:
            return self.has_completions() or self.landed(seq)

        return woken

    def landed_reply(self, seq: int, req_id: int, req: Copy | CopyBatch) -> dict[str, object] | None:
        """The reply of ``req``, published as ``seq`` and `landed`, made here from the figures
        the daemon stamped: the daemon's clock (CLOCK_MONOTONIC, as this process's
        `time.perf_counter`), the end being now. None if the slot holds another copy's (wait
        for the completion then)."""
        figures = None if self.closed else self._landed.figures(seq)
        if figures is None:
            return None
        first_ns, queued_ns, express = figures
        transfer_us = max(time.perf_counter() * 1e6 - first_ns / 1e3, 0.0)
        queued_us = queued_ns / 1e3
        total_us = queued_us + transfer_us
        reply: dict[str, object] = {
            "id": req_id,
            "ok": True,
            "queued_us": round(queued_us, 3),
            "transfer_us": round(transfer_us, 3),
            "total_us": round(total_us, 3),
            "path": "express" if express else "dma",
            "missed_deadline": req.deadline_ms is not None and total_us > req.deadline_ms * 1e3,
        }
        if type(req) is CopyBatch:
            rows = np.frombuffer(req.segments, dtype="<u8")
            reply["nbytes"] = int(np.add.reduce(rows[2::3]))
            reply["segments"] = len(rows) // 3
        else:
            assert type(req) is Copy
            reply["nbytes"] = req.nbytes
        return reply

    def ring(self) -> None:
        """Wake the daemon for what was published."""
        if not self.closed:
            try:
                os.eventfd_write(self.doorbell, 1)
            except BlockingIOError:
                pass  # the counter is full: a wake-up is pending anyway

    def completions(self) -> list[tuple[int, dict[str, object]]]:
        """Completions published since the last call, as (request id, reply)."""
        return [] if self.closed else self._reader.drain()

    def has_completions(self) -> bool:
        return not self.closed and self._reader.pending()

    def clear_wake(self) -> None:
        """Reset the wake-up counter (before `completions`, so a later wake-up is not lost)."""
        try:
            os.eventfd_read(self.wake_fd)
        except (BlockingIOError, OSError):
            pass

    def watch(self, add_reader: Callable[[int, Callable[[], None]], None], on_wake: Callable[[], None]) -> None:
        add_reader(self.wake_fd, on_wake)

    def _release(self) -> None:
        for side in (getattr(self, "_writer", None), getattr(self, "_reader", None), getattr(self, "_landed", None)):
            if side is not None:
                side.release()
        self._buf.release()
        self._map.close()
        os.close(self.doorbell)
        os.close(self.wake_fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._release()
