"""Where requests wait for their chunks: one queue per class and lane, with clients in rings. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). Why the rings: inside
every class, clients share by round robin (docs/design.md, promise 6), so that one client's
flood does not push another client's copy back by more than one round. A class queue is
three levels deep (the classes are defined in lanes.py, beside the `Lane` that holds them and
that every `Track` points back at; this module has the operations on them):

- `ClassQueue`: one class on one lane, a ring of tenant groups; the head has the turn. It also
  keeps the class's deficit-round-robin state (``quantum``, ``deficit``), which dispatch.py
  spends.
- `Group`: one tenant's connections in that class, a ring of sub-queues; one chunk each in turn.
- `Sub`: one connection's requests; earliest deadline first, then arrival order (EDF orders
  only a connection's own copies).

A `Track` is the scheduler's record of one request and where it sits. Entries leave lazily: a
cancelled or fully handed-out request stays until it reaches a head, so cancel is O(1), and
the ``live`` counts are the truth. Empty groups and sub-queues are kept for the next request
(no allocation per copy) and pruned as they pile up. A group whose tenant is at its cap of
chunks in flight (budget.py) is *parked*: off its class's ring until that tenant's next
completion (`park`, `unpark`).
"""

from __future__ import annotations

from priod.daemon.sched.budget import Tenant
from priod.daemon.sched.lanes import ClassQueue, Group, Track

__all__ = ["ClassQueue", "Group", "Track", "leave_class", "park", "pick", "push", "unpark"]
"""The classes too: dispatch.py and scheduler.py import them from here, with the operations."""


def push(t: Track, fifo: bool) -> None:
    """Put ``t`` into its class queue: its tenant's group, its connection's sub-queue (with
    ``fifo``, mode "fifo": onto its lane's one arrival-order queue instead)."""
    req, lane, cq = t.req, t.lane, t.cq
    cq.live += 1
    cq.queued_bytes += req.nbytes - req.submitted_bytes
    if fifo:
        lane.fifo.append(t)
        return
    g = cq.group(t.tkey, t.tenant)
    sub = g.sub(req.owner)
    sub.push(t)
    sub.live += 1
    g.live += 1
    t.group, t.sub = g, sub
    if not sub.in_ring:
        sub.in_ring = True
        g.ring.append(sub)
    if not g.in_ring and not g.parked:
        g.in_ring = True
        cq.ring.append(g)
    if not cq.spec.strict and not cq.active:
        cq.active = True
        lane.rr.append(cq)


def leave_class(t: Track) -> None:
    """Count ``t`` out of its class queue (its entry there is dropped lazily, or was popped)."""
    cq, g, sub = t.cq, t.group, t.sub
    cq.live -= 1
    if g is not None and sub is not None:
        sub.live -= 1
        g.live -= 1
        if not sub.live:
            sub.clear()
        if not g.live:
            g.drained()
    if not cq.live:
        cq.drained()
        cq.deficit = 0  # DRR: an empty class carries no credit into its next backlog


def pick(cq: ClassQueue, kind: int, cap: int) -> Group | None:
    """The tenant group whose turn it is in ``cq`` and that may have another chunk of
    ``kind`` in flight (fewer than ``cap`` slots, `Tenant.slots`); groups of tenants at their
    cap are parked on the way."""
    ring = cq.ring
    while ring:
        g = ring[0]
        if not g.live:
            ring.popleft()
            g.in_ring = False
        elif g.tenant.slots(kind) >= cap:
            park(g)
        else:
            return g
    return None


def park(g: Group) -> None:
    """Take ``g`` (its class ring's head) off the ring until its tenant's next completion."""
    g.cq.ring.popleft()
    g.in_ring = False
    g.parked = True
    g.tenant.parked.append(g)


def unpark(tenant: Tenant[Group]) -> None:
    """Put ``tenant``'s parked groups back on their rings (it has just had a completion)."""
    parked, tenant.parked = tenant.parked, []
    for g in parked:
        if not g.parked:
            continue
        g.parked = False
        if g.live:
            g.in_ring = True
            g.cq.ring.append(g)
