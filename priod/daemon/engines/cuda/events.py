"""How the CUDA engine learns that a chunk is done: an event recorded after it, polled.

`CudaEngine.submit` records an event from the device's `EventPool` on the chunk's stream right
after the copy, and returns an `EventCompletion` around it. The daemon's poller calls
`EventCompletion.done`, one ``cudaEventQuery`` (0.5-1 us a poll, measured on an H200), which
never blocks; `EventCompletion.release` puts the event back in the pool for the next chunk.
Polling rather than a host callback or a blocking wait keeps everything on the event loop.

Only ``cudaEventDisableTiming`` events: they are the cheapest to record and query. An event
must be recorded on a stream of its own device, hence one pool per device. Without timing
events, a lane's busy time (`Busy`) is what the poller sees: from a chunk's submission until
the poll that finds it done, while any chunk of the lane is outstanding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from priod.common.cuda.driver import bindings, check, error, status_codes
from priod.daemon.engines.base import Completion, IpcEvent
from priod.daemon.engines.cuda.pusher import Ticket
from priod.errors import EngineError, PriodError

__all__ = ["Busy", "CudaIpcEvent", "Done", "EventCompletion", "EventPool"]


class EventPool:
    """The events of one device: those free for the next chunk, and all it ever created."""

    def __init__(self, device: int) -> None:
        rt, _ = bindings()
        self.device = device
        self.free: list[Any] = []
        self.created: list[Any] = []
        self.closed = False
        self.query = rt.cudaEventQuery
        """``cudaEventQuery``, looked up once: completions call it on every poll."""
        self.ok, self.not_ready = status_codes()

    def take(self) -> Any:
        """A free event, or a new one."""
        if self.free:
            return self.free.pop()
        rt, _ = bindings()
        event = check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))
        self.created.append(event)
        return event

    def close(self, attempt: Callable[[tuple[Any, ...]], None]) -> None:
        """Destroy every event (the device must be current); completions still held then
        raise EngineError. ``attempt`` collects the errors of the destroy calls."""
        rt, _ = bindings()
        self.closed = True
        for event in self.created:
            attempt(rt.cudaEventDestroy(event))
        self.created.clear()
        self.free.clear()


class Busy:
    """One lane's busy time: seconds during which at least one of its chunks was outstanding.

    A copy engine works through the lane's chunks back to back, so time with a chunk outstanding is time
    the engine works, give or take the launch and the polling lag (the poller finds a chunk
    done up to one poll late; on the timer path it wakes when the chunk is due). Costs two
    ``perf_counter`` calls a chunk, on the loop's thread only.
    """

    __slots__ = ("outstanding", "seconds", "since")

    def __init__(self) -> None:
        self.outstanding = 0
        self.since = 0.0
        self.seconds = 0.0

    def start(self) -> None:
        if not self.outstanding:
            self.since = time.perf_counter()
        self.outstanding += 1

    def end(self) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self.seconds += time.perf_counter() - self.since

    def total(self) -> float:
        """Busy seconds so far, the stretch under way included."""
        return self.seconds + (time.perf_counter() - self.since if self.outstanding else 0.0)


class EventCompletion(Completion):
    """Done when the event recorded after the chunk has completed.

    With a ``ticket``, the chunk and its event are enqueued by the engine's pusher thread
    (pusher.py): not done before the ticket is, since an event not yet recorded reads as complete.
    """

    __slots__ = ("_busy", "_done", "_event", "_pool", "stream", "ticket")

    def __init__(
        self, event: Any, pool: EventPool, busy: Busy, stream: Any = None, ticket: Ticket | None = None
    ) -> None:
        self._event = event
        self._pool = pool
        self._done = False
        self._busy = busy
        self.stream = stream
        """The stream the chunk went on: a copy's signal_event is recorded there after it."""
        self.ticket = ticket
        """The pusher's job that enqueues the chunk, until it has run (then None)."""
        busy.start()

    @property
    def pending(self) -> bool:
        """The chunk is still waiting for the pusher: it is not on its stream yet."""
        return self.ticket is not None and not self.ticket.done

    @property
    def event(self) -> Any:
        """The pool's event recorded after the chunk (None once released)."""
        return self._event

    def done(self) -> bool:
        if self._done:
            return True
        ticket = self.ticket
        if ticket is not None:
            if not ticket.done:
                return False
            if ticket.error is not None:
                raise (
                    ticket.error
                    if isinstance(ticket.error, PriodError)
                    else EngineError(f"enqueueing the chunk failed: {ticket.error!r}")
                )
            self.ticket = None
        pool = self._pool
        if self._event is None or pool.closed:
            raise EngineError("the cuda engine was closed (or the completion released) before this chunk finished")
        err = pool.query(self._event)[0]
        if err is pool.ok:
            self._done = True
            self._busy.end()
            return True
        if err is pool.not_ready:
            return False
        raise error(err)

    def release(self) -> None:
        if self._event is not None:
            if not self._pool.closed:
                self._pool.free.append(self._event)
            self._event = None


class Done(Completion):
    """A chunk of zero bytes: nothing to wait for."""

    def done(self) -> bool:
        return True


class CudaIpcEvent(IpcEvent):
    """A client's interprocess event, opened in the daemon (``cudaIpcOpenEventHandle``).

    Polled with ``cudaEventQuery`` as a ``wait_event``; recorded after a copy's last chunk as a
    ``signal_event``. `close` destroys the daemon's import only (the client's event lives on);
    a record still pending then completes on its own (``cudaEventDestroy`` does not wait).
    """

    __slots__ = ("_on_close", "_pool", "device", "event")

    def __init__(self, event: Any, device: int, pool: EventPool, on_close: Callable[[CudaIpcEvent], None]) -> None:
        self.event: Any = event
        self.device = device
        self._pool = pool
        self._on_close = on_close

    def query(self) -> bool:
        if self.event is None or self._pool.closed:
            raise EngineError("the event was closed (its connection ended, or the engine stopped)")
        err = self._pool.query(self.event)[0]
        if err is self._pool.ok:
            return True
        if err is self._pool.not_ready:
            return False
        raise error(err)

    def close(self) -> None:
        if self.event is not None:
            self._on_close(self)
            self.event = None
