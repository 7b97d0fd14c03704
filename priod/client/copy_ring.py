"""The client's side of a connection's copy ring (the layout and its rules: `priod.wire.ring`).

`ClientRing` maps the daemon's memfd, publishes plain copies as descriptors and reads their
completions back as the replies the socket would have brought. The doorbell is rung after the
descriptors are published: by the async client for a loop turn's first copy and once more at the
turn's end if more followed, by the blocking one once per copy.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

from priod.wire.messages import Copy, CopyBatch
from priod.wire.ring import CompletionReader, SubmissionWriter, check_header, ring_eligible

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
        self.closed = False

    @staticmethod
    def eligible(req: Copy | CopyBatch) -> bool:
        return ring_eligible(req)

    def submit(self, req_id: int, req: Copy | CopyBatch) -> bool:
        """Publish a copy or batch (ring the doorbell after, `ring`); False if the ring (or its
        table area) is full, or closed."""
        return not self.closed and self._writer.try_submit(req_id, req)

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
        for side in (getattr(self, "_writer", None), getattr(self, "_reader", None)):
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
