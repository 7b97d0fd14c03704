"""GPU-side ordering in the daemon: the events a connection named, and the copies waiting for one.

A copy may name a ``wait_event`` (docs/protocol.md): a client's IPC event recorded behind the
kernel that produces the copy's source. The daemon must not start the copy before that event
has completed, and must not make anyone else wait for it: a lane's stream is shared by every
client, so ``cuStreamWaitEvent`` on it would hold other clients' chunks behind this client's
kernel (or forever, for an event that is never recorded complete). So the copy is held out of
the scheduler altogether, in a `Gates` table the pump polls (``cudaEventQuery``, 0.5-1 us),
and queued like any copy once its event has completed. A held copy holds nothing but itself:
no lane, no chunk, no place in a queue; it counts against its client's limits, as any pending
copy does, so a flood of them is bounded by ``[limits] max_queued_requests``.

A copy held longer than ``[limits] max_event_wait_s`` (`Gates.configure`) comes out of `Gates.poll`
with a `Cancelled` error saying so: an event never recorded complete would otherwise hold it, and
its place in those limits, until its client cancels it or leaves. It is checked when the copy is
polled anyway, so the limit costs a comparison per poll, and no poll is due later than it.

`EventTable` (one per connection) opens each handle once (``cudaIpcOpenEventHandle`` costs
about an event create) and closes them all when the connection ends.

Pure logic apart from the engine's event objects: the caller passes ``now``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from priod.daemon.engines.base import Engine, IpcEvent, Memory
from priod.daemon.sched.scheduler import Request
from priod.errors import Cancelled, LimitExceeded

__all__ = [
    "GATE_BACKOFF",
    "GATE_MAX_INTERVAL_S",
    "GATE_POLLS_PER_S",
    "GATE_POLLS_PER_TURN",
    "GATE_SPIN_S",
    "MAX_EVENTS_PER_CONNECTION",
    "EventTable",
    "Gate",
    "Gates",
]

MAX_EVENTS_PER_CONNECTION = 256
"""Distinct events one connection may have open: each is a driver object in the daemon, and a
client needs a few (one per stream it orders against), reused copy after copy."""
GATE_SPIN_S = 1e-3
"""A held copy younger than this is polled every loop turn: most events complete within
microseconds of the request (the client records before it sends), and the copy is urgent."""
GATE_BACKOFF = 8
"""Older, it is polled again after 1/8 of its age: it starts at most 12.5% (and at most
`GATE_MAX_INTERVAL_S`) after its event completed."""
GATE_MAX_INTERVAL_S = 10e-3
GATE_POLLS_PER_S = 50_000
"""Held copies past their first millisecond together cost at most about this many polls a
second (25-50 ms of the loop on cuda): with thousands held (a hostile client at its request
limit), each is polled less often, and nobody else's copy waits for them."""
GATE_POLLS_PER_TURN = 256
"""Polls in one loop turn at most; the rest wait for the next turn, in due order."""


class EventTable:
    """The events one connection has named, each opened once; `close` when it ends."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._events: dict[tuple[int, bytes], IpcEvent] = {}

    def __len__(self) -> int:
        return len(self._events)

    def open(self, handle: bytes, device: int, region: Callable[[int], Memory]) -> IpcEvent:
        """The opened event of ``handle`` on GPU ``device`` (the daemon's ordinal).

        Raises:
            InvalidRequest: the handle does not open (the engine says why).
            LimitExceeded: past `MAX_EVENTS_PER_CONNECTION` distinct events.
        """
        key = (device, handle)
        event = self._events.get(key)
        if event is None:
            if len(self._events) >= MAX_EVENTS_PER_CONNECTION:
                raise LimitExceeded(
                    f"this connection has {len(self._events)} IPC events open, the most one may have; "
                    "reuse your events (record the same one again) rather than making one per copy"
                )
            event = self._engine.open_event(handle, device, region)
            self._events[key] = event
        return event

    def close(self) -> None:
        """Close every event (the connection ended; its held copies were cancelled first)."""
        events, self._events = list(self._events.values()), {}
        for event in events:
            event.close()


@dataclass(eq=False, slots=True)
class Gate:
    """A copy held until its ``wait_event`` completes."""

    request: Request
    event: IpcEvent
    since: float
    """When it arrived."""
    due: float
    """When to poll it next."""


class Gates:
    """Copies held for their events, polled in due order with back-off (see the module doc)."""

    def __init__(self) -> None:
        self._gates: dict[int, Gate] = {}
        self._heap: list[tuple[float, int, int]] = []
        """(due, seq, request id); entries of gates gone or re-timed are skipped when popped."""
        self._seq = 0
        self.polls = 0
        self.max_wait_s = 0.0
        """``[limits] max_event_wait_s``: a copy held longer is cancelled (0: never)."""

    def configure(self, max_wait_s: float) -> None:
        """Take ``[limits] max_event_wait_s`` (at start and on reload); copies held now are
        judged by it from their next poll."""
        self.max_wait_s = max_wait_s

    def __len__(self) -> int:
        return len(self._gates)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._gates

    def hold(self, req: Request, event: IpcEvent, now: float) -> None:
        """Hold ``req`` until ``event`` has completed; polled from the next turn on."""
        gate = Gate(req, event, now, now)
        self._gates[req.id] = gate
        self._push(gate)

    def _push(self, gate: Gate) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (gate.due, self._seq, gate.request.id))

    def poll(self, now: float) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Poll the gates that are due (at most `GATE_POLLS_PER_TURN`): the requests whose event
        completed, taken out, and those whose event failed, taken out with the error (a
        `Cancelled` one for a copy held past `max_wait_s`)."""
        opened: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        again: list[Gate] = []
        heap, gates = self._heap, self._gates
        polled = 0
        max_wait = self.max_wait_s
        while heap and heap[0][0] <= now and polled < GATE_POLLS_PER_TURN:
            due, _, rid = heapq.heappop(heap)
            gate = gates.get(rid)
            if gate is None or gate.due != due:
                continue
            polled += 1
            try:
                done = gate.event.query()
            except Exception as exc:  # a broken event fails its own copy, nothing else
                del gates[rid]
                failed.append((gate.request, exc))
                continue
            if done:
                del gates[rid]
                opened.append(gate.request)
            elif max_wait and now - gate.since >= max_wait:
                del gates[rid]
                failed.append((gate.request, self._expired(now - gate.since)))
            else:
                gate.due = now + self._interval(now - gate.since)
                if max_wait and gate.due > gate.since + max_wait:
                    gate.due = gate.since + max_wait  # polled once more at the limit, not later
                again.append(gate)
        for gate in again:  # after the loop: a gate due at once is polled once per turn, not 256 times
            self._push(gate)
        self.polls += polled
        return opened, failed

    def _expired(self, age: float) -> Cancelled:
        return Cancelled(
            f"its wait_event did not complete within [limits] max_event_wait_s = {self.max_wait_s:g} s "
            f"(held {age:.3g} s), so the daemon cancelled it; record the event behind the work that "
            "produces the source before sending the copy, or raise max_event_wait_s in the daemon's "
            "config (0: no limit)"
        )

    def _interval(self, age: float) -> float:
        if age < GATE_SPIN_S:
            return 0.0
        return max(min(age / GATE_BACKOFF, GATE_MAX_INTERVAL_S), len(self._gates) / GATE_POLLS_PER_S)

    def next_due(self) -> float | None:
        """When the earliest gate is due; None with none held."""
        heap, gates = self._heap, self._gates
        while heap:
            due, _, rid = heap[0]
            gate = gates.get(rid)
            if gate is not None and gate.due == due:
                return due
            heapq.heappop(heap)
        return None

    def requests(self) -> list[Request]:
        """Every request held now."""
        return [g.request for g in self._gates.values()]

    def get(self, request_id: int) -> Request | None:
        """The request if it is held."""
        gate = self._gates.get(request_id)
        return None if gate is None else gate.request

    def take(self, request_id: int) -> Request | None:
        """Stop holding a request (cancelled); None if it is not held."""
        gate = self._gates.pop(request_id, None)
        return None if gate is None else gate.request

    def take_owner(self, owner: Hashable) -> list[Request]:
        """Stop holding every request of ``owner`` (a connection that left)."""
        mine = [rid for rid, g in self._gates.items() if g.request.owner == owner]
        return [self._gates.pop(rid).request for rid in mine]
