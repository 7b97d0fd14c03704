"""Where requests wait for their chunks: one queue per class and lane, with clients in rings. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). Why the rings: inside
every class, clients share by round robin (docs/design.md, promise 6), so that one client's
flood does not push another client's copy back by more than one round. A class queue is
three levels deep:

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

import heapq
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from priod.common.types import Path
from priod.daemon.sched.budget import Tenant, TenantKey
from priod.daemon.sched.policy import ClassSpec

if TYPE_CHECKING:
    from priod.daemon.sched.lanes import Lane
    from priod.daemon.sched.records import Request


class Track:
    """The scheduler's private record of one request, beside the caller-visible `Request`."""

    __slots__ = ("admitted", "charged", "cq", "group", "lane", "queued", "req", "route", "seq", "since", "sub", "tenant", "tkey")

    def __init__(self, req: Request, lane: Lane, cq: ClassQueue, seq: int, tkey: TenantKey, tenant: Tenant) -> None:
        self.req = req
        self.lane = lane
        self.cq = cq
        self.seq = seq
        self.tkey = tkey
        self.tenant = tenant
        self.since = req.arrival
        """When it last got a chunk (its arrival before the first): what aging measures."""
        self.queued = False
        """Still has bytes to hand out and is neither cancelled nor failed."""
        self.group: Group | None = None
        self.sub: Sub | None = None
        self.admitted = False
        """A strict request that passed the urgent budget (checked when it first comes up)."""
        self.charged = 0
        """What it counts in its tenant's ``pending`` until it finishes."""
        self.route: Path | None = None
        """A strict request's path, chosen when it first comes up."""


class Sub:
    """One connection's waiting requests in one class on one lane.

    Requests with a deadline wait in a heap (earliest first), the rest in a FIFO. Entries are
    removed lazily: a cancelled or fully handed-out request stays until it reaches the head,
    so cancel is O(1) and ``live`` is the truth.
    """

    __slots__ = ("_edf", "_fifo", "in_ring", "live", "owner")

    def __init__(self, owner: Hashable) -> None:
        self.owner = owner
        self.live = 0
        self.in_ring = False
        self._edf: list[tuple[float, int, Track]] = []
        self._fifo: deque[Track] = deque()

    def push(self, t: Track) -> None:
        if t.req.deadline is None:
            self._fifo.append(t)
        else:
            # seq breaks ties, so tracks themselves are never compared.
            heapq.heappush(self._edf, (t.req.deadline, t.seq, t))

    def head(self) -> Track:
        """The request to serve next. Only called while ``live > 0``."""
        edf = self._edf
        while edf:
            t = edf[0][2]
            if t.queued:
                return t
            heapq.heappop(edf)
        fifo = self._fifo
        while True:
            t = fifo[0]
            if t.queued:
                return t
            fifo.popleft()

    def pop_head(self, t: Track) -> None:
        """Take ``t``, the head just returned by `head`, out (it moves to another class)."""
        if self._edf and self._edf[0][2] is t:
            heapq.heappop(self._edf)
        else:
            self._fifo.popleft()

    def clear(self) -> None:
        self._edf.clear()
        self._fifo.clear()


class Group:
    """One tenant's connections in one class on one lane: a ring of `Sub`, one chunk each in turn."""

    __slots__ = ("cq", "in_ring", "key", "live", "parked", "prune_at", "ring", "subs", "tenant")

    def __init__(self, cq: ClassQueue, key: TenantKey, tenant: Tenant) -> None:
        self.cq = cq
        self.key = key
        self.tenant = tenant
        self.live = 0
        self.in_ring = False
        """It sits in its class's ring (possibly with nothing live: removed lazily)."""
        self.parked = False
        """Off the ring while its tenant is at a cap of chunks in flight."""
        self.subs: dict[Hashable, Sub] = {}
        self.ring: deque[Sub] = deque()
        self.prune_at = 8

    def head(self) -> Track:
        """The next request of the connection whose turn it is. Only called while ``live > 0``."""
        ring = self.ring
        while True:
            sub = ring[0]
            if sub.live:
                return sub.head()
            ring.popleft()
            sub.in_ring = False

    def sub(self, owner: Hashable) -> Sub:
        """``owner``'s sub-queue. Empty ones are kept for the next request (no allocation per
        copy) and dropped once they are half of what is kept."""
        sub = self.subs.get(owner)
        if sub is None:
            subs = self.subs
            if len(subs) >= self.prune_at:
                for key in [k for k, s in subs.items() if not s.live and not s.in_ring]:
                    del subs[key]
                self.prune_at = max(8, 2 * len(subs))
            sub = subs[owner] = Sub(owner)
        return sub

    def drained(self) -> None:
        """Nothing live is left: empty the ring (its entries are all empty)."""
        for sub in self.ring:
            sub.in_ring = False
        self.ring.clear()


class ClassQueue:
    """One class's waiting requests on one lane: a ring of tenant groups, and its DRR state."""

    __slots__ = ("active", "deficit", "groups", "in_turn", "live", "prune_at", "quantum", "queued_bytes", "ring", "spec")

    def __init__(self, spec: ClassSpec, chunk_bytes: int) -> None:
        self.spec = spec
        self.quantum = spec.weight * chunk_bytes
        self.deficit = 0
        self.in_turn = False
        """Its quantum for the current round-robin turn was already added."""
        self.active = False
        """It sits in its lane's round-robin list."""
        self.live = 0
        self.queued_bytes = 0
        self.groups: dict[TenantKey, Group] = {}
        self.ring: deque[Group] = deque()
        """Tenants with work here, round robin: the head has the turn."""
        self.prune_at = 8

    def group(self, key: TenantKey, tenant: Tenant) -> Group:
        """``key``'s group. Empty ones are kept for the next request (no allocation per copy)
        and dropped once they are half of what is kept."""
        g = self.groups.get(key)
        if g is None:
            groups = self.groups
            if len(groups) >= self.prune_at:
                for k in [k for k, old in groups.items() if not old.live and not old.in_ring]:
                    del groups[k]
                self.prune_at = max(8, 2 * len(groups))
            g = groups[key] = Group(self, key, tenant)
        elif not g.live:
            g.tenant = tenant  # the tenant may have been swept and come back since
            g.parked = False  # a stale entry in its old tenant's list is skipped
        return g

    def drained(self) -> None:
        """Nothing live is left: empty the ring (its entries are all empty)."""
        for g in self.ring:
            g.in_ring = False
            if g.ring:  # usually drained already, as its last request left (`leave_class`)
                g.drained()
        self.ring.clear()


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
    ``kind`` in flight (fewer than ``cap``); groups of tenants at their cap are parked on the way."""
    ring = cq.ring
    while ring:
        g = ring[0]
        if not g.live:
            ring.popleft()
            g.in_ring = False
        elif g.tenant.inflight[kind] >= cap:
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


def unpark(tenant: Tenant) -> None:
    """Put ``tenant``'s parked groups back on their rings (it has just had a completion)."""
    parked, tenant.parked = tenant.parked, []
    for g in parked:
        if not g.parked:
            continue
        g.parked = False
        if g.live:
            g.in_ring = True
            g.cq.ring.append(g)
