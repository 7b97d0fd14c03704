"""Enqueueing bulk batches off the event loop: one thread that makes the long driver calls.

``cuMemcpyBatchAsync`` costs the driver about a microsecond of CPU a segment (0.6-1.1 us on the
H200), and a 64 KiB block moves in 1.2 us, so a bulk stream of small blocks keeps whoever
enqueues it nearly as busy as the link. On the event loop that was everything: profiled, 1.66
of the loop's 3 seconds went into those calls, the link ran at 0.74 and every client waited
behind them. A `Pusher` takes such a call (a *job*) and runs it on its own thread, in the order
given; the job lets go of the GIL while the driver works (ctypes does), so the loop goes on
polling and serving meanwhile.

What a job enqueues is not on its stream until the job has run: the completion of a pushed
chunk is not done before its `Ticket` is (an event not yet recorded reads as complete), and
anything that must follow the chunk on its stream is pushed behind it (`CudaEngine.record_event`).

Nothing here knows CUDA: a job is any callable, run once, its exception kept on its ticket.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from priod.errors import EngineError

__all__ = ["Pusher", "Ticket"]


class Ticket:
    """A pushed job's state, written by the pusher's thread: ``error`` first, then ``done``."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: Exception | None = None


class Pusher:
    """Runs jobs in the order pushed, one at a time, on a thread of its own (started on the
    first push). `close` lets the queued jobs finish, then stops the thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: deque[tuple[Callable[[], None], Ticket]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._running = False
        """A job taken from the queue is running (set and cleared under the lock)."""

    def push(self, job: Callable[[], None]) -> Ticket:
        """Queue ``job``; its ticket says when it has run. EngineError once closed."""
        ticket = Ticket()
        with self._cv:
            if self._closed:
                raise EngineError("the cuda engine is closing: no chunk can be enqueued")
            self._jobs.append((job, ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return ticket

    @property
    def pending(self) -> int:
        """Jobs queued or running: not yet run to the end."""
        with self._cv:
            return len(self._jobs) + self._running

    def close(self) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job, ticket = self._jobs.popleft()
                self._running = True
            try:
                job()
            except Exception as exc:  # the chunk's failure: the poller raises it from done()
                ticket.error = exc
            with self._cv:
                self._running = False
                ticket.done = True
