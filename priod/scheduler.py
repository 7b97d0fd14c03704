"""The scheduler: priority classes, chunking and the in-flight bound, per lane. Pure logic.

No sockets, no CUDA, no clocks: the caller passes ``now`` (seconds, any monotonic origin) and
submits the chunks this module hands out. That keeps the promise below testable on its own.

The promise (docs/design.md), per lane (device x direction):
- At most ``inflight_bytes`` of non-strict DMA chunks are submitted to the engine at once; the
  rest waits here, where priority decides.
- A strict-class (``urgent``) request is handed out before any queued chunk of a lower class:
  on the express path when the lane has one for its size, else as DMA chunks with a budget of
  its own, so it waits for at most the non-strict bytes already in flight. No non-strict
  chunk is handed out while a strict DMA chunk is queued or in flight on the lane.
- Non-strict classes share the lane by weight: deficit round robin, measured in bytes.
- Inside every class, clients share by round robin: one chunk per tenant (a uid; the
  connection where the uid is unknown) per turn, and one per connection of that tenant per
  its turn. Deadlines (EDF) order only a connection's own requests. A tenant has at most
  ``depth`` chunks in flight per lane on each path (express, strict DMA, the rest), so one
  client's flood of small copies cannot fill the engine's queue ahead of others: another
  client's copy waits for at most one round.
- Strict work has a budget per tenant and lane: a token bucket (``urgent_budget_bytes_per_s``
  or ``urgent_budget_share`` of the lane, ``urgent_burst_bytes`` deep) and a cap on its strict
  bytes admitted and unfinished (``urgent_inflight_bytes``). A strict request is admitted when
  it first comes up for service; past the budget it is served as the highest-weight non-strict
  class (``high``) instead, for good. Express copies count like any other.
- ``mode = "fifo"`` switches all of it off: whole copies, in arrival order, no bound. It is what
  a plain CUDA stream does, and the baseline the benchmarks compare against.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from .choice import PathChooser, PathEstimate
from .engines.base import LaneInfo, LaneKey, Path
from .errors import ConfigError, InvalidRequest, NotFound, PermissionDenied
from .policy import ALIGN, ClassSpec, LaneParams, Policy, lane_params, validate_policy

__all__ = [
    "Chunk",
    "Finished",
    "LaneStats",
    "Request",
    "RequestState",
    "Scheduler",
    "SchedulerStats",
]


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    ACTIVE = "active"
    """Some chunk submitted, not all completed."""
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    """One copy request as the scheduler tracks it. ``payload`` is the caller's, untouched."""

    id: int
    owner: Hashable
    """The connection: a tenant's requests are served round robin by this."""
    lane: LaneKey
    cls: str
    nbytes: int
    arrival: float
    deadline: float | None = None
    payload: object = None
    uid: int | None = None
    """The client's uid (peer credentials): the tenant that fairness and the urgent budget
    count by, and what ``[classes.NAME] uids`` checks. None: unknown (the connection is the
    tenant, and every class is allowed)."""
    gid: int | None = None
    """The client's gid, for ``[classes.NAME] gids``; None: unknown."""
    groups: tuple[int, ...] = ()
    """Supplementary groups, also checked against ``gids`` (empty where not known)."""
    # Bookkeeping, owned by the scheduler:
    state: RequestState = RequestState.QUEUED
    submitted_bytes: int = 0
    done_bytes: int = 0
    inflight_chunks: int = 0
    first_submit: float | None = None
    last_done: float | None = None
    path: Path | None = None
    demoted_from: str | None = None
    """The strict class it asked for, when its client was past the urgent budget and it was
    served as ``cls`` instead."""
    error: Exception | None = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class Chunk:
    """A piece of a request for the caller to submit: bytes [offset, offset+nbytes)."""

    request: Request
    offset: int
    nbytes: int
    path: Path
    strict: bool


@dataclass(frozen=True)
class Finished:
    """A request that reached its end; the caller replies to the client with it."""

    request: Request
    outcome: Literal["done", "cancelled", "failed"]
    bytes_done: int
    missed_deadline: bool = False
    error: Exception | None = None


@dataclass(frozen=True)
class LaneStats:
    lane: str
    bandwidth: float
    chunk_bytes: int
    inflight_bound: int
    express_min: int
    express_max: int
    queued_requests: dict[str, int]
    queued_bytes: dict[str, int]
    inflight_bytes: int
    """Non-strict DMA bytes in flight (the figure the bound applies to)."""
    strict_inflight_bytes: int
    express_inflight_bytes: int
    urgent_chunk_bytes: int = 0
    urgent_inflight_bound: int = 0
    """The short bound, used while urgent copies are recent on the lane."""
    tenants: int = 0
    """Clients (uids, or connections where unknown) the lane keeps state for."""
    urgent_budget_bytes_per_s: float = 0.0
    """Each tenant's strict budget on this lane: the lower of the two settings."""


@dataclass(frozen=True)
class SchedulerStats:
    mode: str
    classes: tuple[ClassSpec, ...]
    lanes: tuple[LaneStats, ...]
    deadline_misses: int
    finished: dict[str, int]
    """Finished requests by outcome."""
    demoted: int = 0
    """Strict requests served as a lower class because their client was past its budget."""


_OUTCOMES: tuple[str, ...] = ("done", "cancelled", "failed")

_EXPRESS, _STRICT, _BULK = 0, 1, 2
"""Kinds of chunk in flight, counted per tenant: express, strict DMA, non-strict DMA."""

TenantKey = tuple[str, Hashable]


class _Tenant:
    """One client on one lane: its urgent budget and its chunks in flight."""

    __slots__ = ("inflight", "parked", "pending", "stamp", "tokens", "tracks")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        """The token bucket of strict bytes, refilled lazily from ``stamp``."""
        self.stamp = now
        self.pending = 0
        """Strict bytes admitted and not finished (``urgent_inflight_bytes`` bounds it)."""
        self.inflight = [0, 0, 0]
        """Chunks in flight by kind (_EXPRESS, _STRICT, _BULK); each is at most ``depth``."""
        self.parked: list[_Group] = []
        """Its class groups taken off their rings while it was at a cap; put back on a completion."""
        self.tracks = 0
        """Its requests on this lane, queued or in flight."""


class _Track:
    """The scheduler's private record of one request, beside the caller-visible `Request`."""

    __slots__ = ("admitted", "charged", "cq", "group", "lane", "queued", "req", "route", "seq", "since", "sub", "tenant", "tkey")

    def __init__(self, req: Request, lane: _Lane, cq: _ClassQueue, seq: int, tkey: TenantKey, tenant: _Tenant) -> None:
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
        self.group: _Group | None = None
        self.sub: _Sub | None = None
        self.admitted = False
        """A strict request that passed the urgent budget (checked when it first comes up)."""
        self.charged = 0
        """What it counts in its tenant's ``pending`` until it finishes."""
        self.route: Path | None = None
        """A strict request's path, chosen when it first comes up."""


class _Sub:
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
        self._edf: list[tuple[float, int, _Track]] = []
        self._fifo: deque[_Track] = deque()

    def push(self, t: _Track) -> None:
        if t.req.deadline is None:
            self._fifo.append(t)
        else:
            # seq breaks ties, so tracks themselves are never compared.
            heapq.heappush(self._edf, (t.req.deadline, t.seq, t))

    def head(self) -> _Track:
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

    def pop_head(self, t: _Track) -> None:
        """Take ``t``, the head just returned by `head`, out (it moves to another class)."""
        if self._edf and self._edf[0][2] is t:
            heapq.heappop(self._edf)
        else:
            self._fifo.popleft()

    def clear(self) -> None:
        self._edf.clear()
        self._fifo.clear()


class _Group:
    """One tenant's connections in one class on one lane: a ring of `_Sub`, one chunk each in turn."""

    __slots__ = ("cq", "in_ring", "key", "live", "parked", "prune_at", "ring", "subs", "tenant")

    def __init__(self, cq: _ClassQueue, key: TenantKey, tenant: _Tenant) -> None:
        self.cq = cq
        self.key = key
        self.tenant = tenant
        self.live = 0
        self.in_ring = False
        """It sits in its class's ring (possibly with nothing live: removed lazily)."""
        self.parked = False
        """Off the ring while its tenant is at a cap of chunks in flight."""
        self.subs: dict[Hashable, _Sub] = {}
        self.ring: deque[_Sub] = deque()
        self.prune_at = 8

    def head(self) -> _Track:
        """The next request of the connection whose turn it is. Only called while ``live > 0``."""
        ring = self.ring
        while True:
            sub = ring[0]
            if sub.live:
                return sub.head()
            ring.popleft()
            sub.in_ring = False

    def sub(self, owner: Hashable) -> _Sub:
        """``owner``'s sub-queue. Empty ones are kept for the next request (no allocation per
        copy) and dropped once they are half of what is kept."""
        sub = self.subs.get(owner)
        if sub is None:
            subs = self.subs
            if len(subs) >= self.prune_at:
                for key in [k for k, s in subs.items() if not s.live and not s.in_ring]:
                    del subs[key]
                self.prune_at = max(8, 2 * len(subs))
            sub = subs[owner] = _Sub(owner)
        return sub

    def drained(self) -> None:
        """Nothing live is left: empty the ring (its entries are all empty)."""
        for sub in self.ring:
            sub.in_ring = False
        self.ring.clear()


class _ClassQueue:
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
        self.groups: dict[TenantKey, _Group] = {}
        self.ring: deque[_Group] = deque()
        """Tenants with work here, round robin: the head has the turn."""
        self.prune_at = 8

    def group(self, key: TenantKey, tenant: _Tenant) -> _Group:
        """``key``'s group. Empty ones are kept for the next request (no allocation per copy)
        and dropped once they are half of what is kept."""
        g = self.groups.get(key)
        if g is None:
            groups = self.groups
            if len(groups) >= self.prune_at:
                for k in [k for k, old in groups.items() if not old.live and not old.in_ring]:
                    del groups[k]
                self.prune_at = max(8, 2 * len(groups))
            g = groups[key] = _Group(self, key, tenant)
        elif not g.live:
            g.tenant = tenant  # the tenant may have been swept and come back since
            g.parked = False  # a stale entry in its old tenant's list is skipped
        return g

    def drained(self) -> None:
        """Nothing live is left: empty the ring (its entries are all empty)."""
        for g in self.ring:
            g.in_ring = False
            g.drained()
        self.ring.clear()


class _Lane:
    """Per-lane state: parameters, class queues, tenants, and bytes in flight by kind."""

    __slots__ = (
        "budget_rate",
        "classes",
        "express_inflight",
        "fifo",
        "inflight",
        "info",
        "key",
        "last_strict",
        "nonstrict",
        "params",
        "queued",
        "rr",
        "strict",
        "strict_inflight",
        "sweep_at",
        "tenants",
    )

    def __init__(self, info: LaneInfo) -> None:
        self.key = info.key
        self.info = info
        self.params = LaneParams(ALIGN, ALIGN, 0, 0)
        self.classes: dict[str, _ClassQueue] = {}
        self.strict: list[_ClassQueue] = []
        self.nonstrict: list[_ClassQueue] = []
        self.rr: deque[_ClassQueue] = deque()
        """Non-strict classes with queued work, in round-robin order; the head has the turn."""
        self.fifo: deque[_Track] = deque()
        """mode "fifo": every request, in arrival order."""
        self.queued = 0
        """Requests with bytes still to hand out."""
        self.inflight = 0
        """Non-strict DMA bytes in flight: the figure ``inflight_bytes`` bounds."""
        self.strict_inflight = 0
        self.express_inflight = 0
        self.last_strict = -math.inf
        """When a strict request last arrived: the short bound holds for ``urgent_window_ms`` after."""
        self.tenants: dict[TenantKey, _Tenant] = {}
        """Kept past a tenant's last request until its bucket is full again (see `Scheduler._sweep`)."""
        self.sweep_at = 64
        self.budget_rate = 0.0

    def configure(self, policy: Policy) -> None:
        """Fresh class queues and parameters for ``policy`` (requests are re-placed by the caller)."""
        self.params = lane_params(self.info, policy)
        self.classes = {c.name: _ClassQueue(c, self.params.chunk_bytes) for c in policy.classes}
        self.strict = [cq for cq in self.classes.values() if cq.spec.strict]
        self.nonstrict = [cq for cq in self.classes.values() if not cq.spec.strict]
        self.rr = deque()
        self.fifo = deque()
        self.queued = 0
        self.budget_rate = min(policy.urgent_budget_bytes_per_s, policy.urgent_budget_share * self.info.bandwidth)
        for tn in self.tenants.values():
            tn.parked.clear()  # their groups went with the old class queues


class Scheduler:
    """Queues copy requests per lane and hands out the chunks to submit, keeping the promise.

    The caller (the daemon's loop) drives it: `enqueue` requests, call `next_chunks` and submit
    every chunk it returns in that order, report each completion with `chunk_done`, and reply to
    clients with the `Finished` records these calls return. Nothing here reads a clock or
    blocks; every figure is per lane and lanes never wait on each other.

    Liveness: after `next_chunks`, any lane with queued work has a chunk in flight, so calling
    `next_chunks` after every `enqueue`, `chunk_done`, `cancel`, `drop_owner` and `set_policy`
    is enough; no timer is needed (aging is checked whenever completions come in; a tenant held
    at its cap of chunks in flight has a chunk in flight; a strict request past the urgent
    budget is moved to a lower class at once rather than held for tokens).
    """

    def __init__(self, policy: Policy, lanes: Iterable[LaneInfo]) -> None:
        validate_policy(policy)
        self._policy = policy
        self._lanes: dict[LaneKey, _Lane] = {}
        for info in sorted(lanes, key=lambda i: i.key):
            if info.key in self._lanes:
                raise ConfigError(f"lane {info.key} is listed twice; an engine must report each lane once")
            lane = _Lane(info)
            lane.configure(policy)
            self._lanes[info.key] = lane
        self._lane_list = list(self._lanes.values())
        self._tracks: dict[int, _Track] = {}
        self._by_owner: dict[Hashable, set[int]] = {}
        self._seq = 0
        self._queued = 0
        self._inflight_chunks = 0
        self._strict_chunks = 0
        self._misses = 0
        self._demoted = 0
        self._finished = dict.fromkeys(_OUTCOMES, 0)
        self._chooser = PathChooser(policy.explore_ms / 1e3)
        self._urgent_until = -math.inf
        self._below_strict = _below_strict(policy)

    # --- configuration -------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    def set_policy(self, policy: Policy) -> None:
        """Apply a reloaded policy: classes, weights, mode, ``max_block_us`` and the rest.

        Lane parameters are derived anew and deficits restart at 0. Queued requests keep their
        arrival order and deadlines; requests of a class that no longer exists move to the
        lowest-weight remaining non-strict class (the first such in the policy on a tie; any
        class if none is non-strict), and their ``cls`` is renamed accordingly. Chunks in
        flight are unaffected; a request already split into chunks continues with the new
        chunk size from where it got to. A strict request not yet started may now go express.
        Tenants keep their urgent budgets and counts of chunks in flight; class permissions
        (``uids``, ``gids``) apply to requests enqueued from now on.
        """
        validate_policy(policy)
        names = {c.name for c in policy.classes}
        nonstrict = [c for c in policy.classes if not c.strict] or list(policy.classes)
        fallback = min(nonstrict, key=lambda c: c.weight).name
        self._policy = policy
        self._below_strict = _below_strict(policy)
        self._chooser.explore_s = policy.explore_ms / 1e3
        for lane in self._lane_list:
            lane.configure(policy)
        self._queued = 0
        # Re-place in arrival order so FIFO order within each class survives the reload.
        for t in sorted(self._tracks.values(), key=lambda t: t.seq):
            if t.req.cls not in names:
                t.req.cls = fallback
            t.cq = t.lane.classes[t.req.cls]
            t.group = t.sub = None
            if t.req.submitted_bytes == 0:
                t.route = None
            if t.queued:
                self._place(t)

    def lane_params(self, lane: LaneKey) -> LaneParams:
        """Chunk size, in-flight bound and express range of ``lane`` under the current policy."""
        return self._lane(lane).params

    # --- requests ------------------------------------------------------------------------

    def enqueue(self, req: Request, now: float) -> None:
        """Queue ``req`` (state QUEUED, nothing submitted). Its chunks come from `next_chunks`.

        Waiting for aging is measured from ``req.arrival``; a strict request at ``now`` puts its
        lane on the short bound (``urgent_block_us``) for ``urgent_window_ms``.

        Raises:
            InvalidRequest: unknown class or lane, ``nbytes <= 0``, or an id already queued or
                in flight.
            PermissionDenied: the class's ``uids``/``gids`` leave this client out.
        """
        lane = self._lane(req.lane)
        cq = lane.classes.get(req.cls)
        if cq is None:
            allowed = ", ".join(lane.classes)
            raise InvalidRequest(f"unknown class {req.cls!r}; the classes are {allowed}")
        if req.nbytes <= 0:
            raise InvalidRequest(f"a copy of {req.nbytes} bytes is invalid; nbytes must be > 0")
        if req.id in self._tracks:
            raise InvalidRequest(f"copy id {req.id} is already queued or in flight; use a fresh id")
        spec = cq.spec
        if (spec.uids or spec.gids) and not spec.allows(req.uid, req.gid, req.groups):
            raise PermissionDenied(
                f"uid {req.uid} (gid {req.gid}) may not use class {req.cls!r}: [classes.{req.cls}] uids = {list(spec.uids)}, "
                f"gids = {list(spec.gids)}; use another class, or ask the operator to add your uid or group there"
            )
        if spec.strict:
            lane.last_strict = now
            self._urgent_until = max(self._urgent_until, now + self._policy.urgent_window_ms / 1e3)
        tkey: TenantKey = ("owner", req.owner) if req.uid is None else ("uid", req.uid)
        tenant = lane.tenants.get(tkey)
        if tenant is None:
            if len(lane.tenants) >= lane.sweep_at:
                self._sweep(lane, now)
            tenant = lane.tenants[tkey] = _Tenant(float(self._policy.urgent_burst_bytes), now)
        tenant.tracks += 1
        self._seq += 1
        t = _Track(req, lane, cq, self._seq, tkey, tenant)
        self._tracks[req.id] = t
        self._by_owner.setdefault(req.owner, set()).add(req.id)
        self._place(t)

    def get(self, request_id: int) -> Request | None:
        """The request while queued or in flight; None once finished (or never seen)."""
        t = self._tracks.get(request_id)
        return None if t is None else t.req

    def cancel(self, request_id: int, now: float) -> Finished | None:
        """Stop handing out chunks of a request; it stops at the next chunk boundary.

        Returns the ``cancelled`` Finished at once if no chunk of it is in flight. Otherwise
        returns None and the Finished (with the bytes that landed) comes out of `chunk_done`
        when its last chunk in flight completes.

        Raises:
            NotFound: no such request, or it is already cancelled or failed.
        """
        t = self._tracks.get(request_id)
        if t is None:
            raise NotFound(
                f"no copy with id {request_id} is queued or in flight; it may have finished already"
            )
        req = t.req
        if req.state is RequestState.CANCELLED or req.state is RequestState.FAILED:
            raise NotFound(
                f"copy {request_id} is already {req.state.value}; its reply comes when its last chunk in flight lands"
            )
        req.state = RequestState.CANCELLED
        self._stop(t)
        if req.inflight_chunks:
            return None
        return self._finish(t, "cancelled")

    def drop_owner(self, owner: Hashable, now: float) -> list[Finished]:
        """Cancel every request of ``owner`` (a client that went away), as `cancel` does.

        Returns the Finished records available at once; the others come out of `chunk_done`.
        Requests already being cancelled or failing are left to finish on their own.
        """
        out: list[Finished] = []
        for rid in list(self._by_owner.get(owner, ())):
            state = self._tracks[rid].req.state
            if state is RequestState.CANCELLED or state is RequestState.FAILED:
                continue
            fin = self.cancel(rid, now)
            if fin is not None:
                out.append(fin)
        return out

    # --- the per-chunk path --------------------------------------------------------------

    def next_chunks(self, now: float) -> list[Chunk]:
        """Every chunk to submit now, in submission order (per lane: strict, then the rest).

        The caller must submit all of them, in this order, before the next call: the bounds
        count them as in flight from here on.
        """
        out: list[Chunk] = []
        fifo = self._policy.mode == "fifo"
        for lane in self._lane_list:
            if not lane.queued:
                continue
            if fifo:
                self._serve_fifo(lane, now, out)
            else:
                self._serve(lane, now, out)
        return out

    def chunk_done(self, chunk: Chunk, now: float, error: Exception | None = None) -> list[Finished]:
        """Record that ``chunk`` completed (or failed with ``error``).

        A failure fails the request: no more of its chunks are handed out, and its ``failed``
        Finished comes once its last chunk in flight completes; bytes landing after the failure
        are not counted. Returns the requests this completion finished (zero or one).
        """
        req = chunk.request
        t = self._tracks.get(req.id)
        if t is None or t.req is not req or req.inflight_chunks <= 0:
            raise ValueError(f"chunk_done for copy {req.id} at offset {chunk.offset}, which is not in flight")
        lane = t.lane
        size = chunk.nbytes
        tenant = t.tenant
        if chunk.path is Path.EXPRESS:
            lane.express_inflight -= size
            tenant.inflight[_EXPRESS] -= 1
        elif chunk.strict:
            lane.strict_inflight -= size
            tenant.inflight[_STRICT] -= 1
        else:
            lane.inflight -= size
            tenant.inflight[_BULK] -= 1
        if tenant.parked:
            self._unpark(tenant)
        if chunk.strict:
            self._strict_chunks -= 1
        self._inflight_chunks -= 1
        req.inflight_chunks -= 1

        state = req.state
        if error is None:
            if state is not RequestState.FAILED:
                req.done_bytes += size
                req.last_done = now
        elif state is RequestState.ACTIVE:
            # The first failure decides; a cancel already asked for keeps its outcome.
            req.state = state = RequestState.FAILED
            req.error = error
            self._stop(t)
        if req.inflight_chunks:
            return []
        if state is RequestState.ACTIVE:
            if req.done_bytes < req.nbytes:
                return []
            req.state = RequestState.DONE
            return [self._finish(t, "done")]
        return [self._finish(t, "cancelled" if state is RequestState.CANCELLED else "failed")]

    # --- state ---------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self._queued and not self._inflight_chunks

    @property
    def strict_in_flight(self) -> bool:
        """Some strict-class chunk (express or DMA) is in flight: worth polling tightly."""
        return self._strict_chunks > 0

    def urgent_recent(self, now: float) -> bool:
        """Some lane runs its short bound: its small chunks want polling every loop turn."""
        return now < self._urgent_until

    def path_estimates(self) -> list[PathEstimate]:
        """Each urgent path's recent latency per lane and size, and the current choice."""
        return self._chooser.estimates()

    @property
    def has_queued(self) -> bool:
        """Some request still has bytes to hand out."""
        return self._queued > 0

    def statistics(self) -> SchedulerStats:
        """A snapshot for `priod status` and metrics. Queued figures count bytes not yet handed out."""
        lanes = tuple(
            LaneStats(
                lane=str(lane.key),
                bandwidth=lane.info.bandwidth,
                chunk_bytes=lane.params.chunk_bytes,
                inflight_bound=lane.params.inflight_bytes,
                express_min=lane.params.express_min,
                express_max=lane.params.express_max,
                queued_requests={name: cq.live for name, cq in lane.classes.items()},
                queued_bytes={name: cq.queued_bytes for name, cq in lane.classes.items()},
                inflight_bytes=lane.inflight,
                strict_inflight_bytes=lane.strict_inflight,
                express_inflight_bytes=lane.express_inflight,
                urgent_chunk_bytes=lane.params.urgent_chunk_bytes,
                urgent_inflight_bound=lane.params.urgent_inflight_bytes,
                tenants=len(lane.tenants),
                urgent_budget_bytes_per_s=lane.budget_rate,
            )
            for lane in self._lane_list
        )
        return SchedulerStats(
            mode=self._policy.mode,
            classes=self._policy.classes,
            lanes=lanes,
            deadline_misses=self._misses,
            finished=dict(self._finished),
            demoted=self._demoted,
        )

    # --- internals: queues ---------------------------------------------------------------

    def _lane(self, key: LaneKey) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            known = ", ".join(str(k) for k in self._lanes) or "none"
            raise InvalidRequest(f"no lane {key}; the lanes are {known}")
        return lane

    def _place(self, t: _Track) -> None:
        """Count a request with bytes to hand out as queued, in the queue its mode and class say."""
        t.queued = True
        t.lane.queued += 1
        self._queued += 1
        self._push(t)

    def _push(self, t: _Track) -> None:
        """Put ``t`` into its class queue: its tenant's group, its connection's sub-queue."""
        req, lane, cq = t.req, t.lane, t.cq
        cq.live += 1
        cq.queued_bytes += req.nbytes - req.submitted_bytes
        if self._policy.mode == "fifo":
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

    def _stop(self, t: _Track) -> None:
        """Take a cancelled or failed request's unsent bytes out of the queue counters."""
        if t.queued:
            t.cq.queued_bytes -= t.req.nbytes - t.req.submitted_bytes
            self._unqueue(t)

    def _unqueue(self, t: _Track) -> None:
        t.queued = False
        t.lane.queued -= 1
        self._queued -= 1
        self._leave_class(t)

    def _leave_class(self, t: _Track) -> None:
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

    def _pick(self, cq: _ClassQueue, kind: int) -> _Group | None:
        """The tenant group whose turn it is in ``cq`` and that may have another chunk of
        ``kind`` in flight; groups of tenants at their cap are parked on the way."""
        ring = cq.ring
        cap = self._policy.depth
        while ring:
            g = ring[0]
            if not g.live:
                ring.popleft()
                g.in_ring = False
            elif g.tenant.inflight[kind] >= cap:
                self._park(g)
            else:
                return g
        return None

    def _park(self, g: _Group) -> None:
        """Take ``g`` (its class ring's head) off the ring until its tenant's next completion."""
        g.cq.ring.popleft()
        g.in_ring = False
        g.parked = True
        g.tenant.parked.append(g)

    def _unpark(self, tenant: _Tenant) -> None:
        parked, tenant.parked = tenant.parked, []
        for g in parked:
            if not g.parked:
                continue
            g.parked = False
            if g.live:
                g.in_ring = True
                g.cq.ring.append(g)

    def _finish(self, t: _Track, outcome: Literal["done", "cancelled", "failed"]) -> Finished:
        req = t.req
        missed = (
            outcome == "done" and req.deadline is not None and req.last_done is not None and req.last_done > req.deadline
        )
        del self._tracks[req.id]
        ids = self._by_owner[req.owner]
        ids.discard(req.id)
        if not ids:
            del self._by_owner[req.owner]
        tenant = t.tenant
        tenant.tracks -= 1
        tenant.pending -= t.charged
        t.charged = 0
        self._finished[outcome] += 1
        if outcome == "done" and t.cq.spec.strict and req.path is not None and req.first_submit is not None and req.last_done is not None:
            self._chooser.observe(t.lane.key, req.path, req.nbytes, req.last_done - req.first_submit, req.last_done)
        if missed:
            self._misses += 1
        return Finished(req, outcome, req.done_bytes, missed, req.error if outcome == "failed" else None)

    # --- internals: the urgent budget ----------------------------------------------------

    def _refill(self, lane: _Lane, tenant: _Tenant, now: float) -> None:
        if now > tenant.stamp:
            tenant.tokens = min(float(self._policy.urgent_burst_bytes), tenant.tokens + lane.budget_rate * (now - tenant.stamp))
            tenant.stamp = now

    def _admit(self, t: _Track, now: float) -> bool:
        """Charge a strict request to its tenant's budget; False: past it (nothing charged).

        A request costs its bytes, but at least one short-bound chunk of the lane
        (``urgent_chunk_bytes``, capped at the burst): while it is queued or in flight by DMA,
        bulk is held, which costs the others about that much however small the copy.
        """
        lane, tenant, req, policy = t.lane, t.tenant, t.req, self._policy
        cost = max(req.nbytes - req.submitted_bytes, min(lane.params.urgent_chunk_bytes, policy.urgent_burst_bytes))
        self._refill(lane, tenant, now)
        if cost > tenant.tokens or tenant.pending + cost > policy.urgent_inflight_bytes:
            return False
        tenant.tokens -= cost
        tenant.pending += cost
        t.charged = cost
        t.admitted = True
        return True

    def _demote(self, t: _Track) -> None:
        """Move a strict request past its tenant's budget (its sub-queue's head) to the class
        below strict, where it is served with the tenant's other work there."""
        sub = t.sub
        assert sub is not None
        sub.pop_head(t)
        t.cq.queued_bytes -= t.req.nbytes - t.req.submitted_bytes
        self._leave_class(t)
        req = t.req
        if req.demoted_from is None:
            req.demoted_from = req.cls
        req.cls = self._below_strict
        t.cq = t.lane.classes[req.cls]
        self._push(t)
        self._demoted += 1

    def _sweep(self, lane: _Lane, now: float) -> None:
        """Forget tenants with no requests whose bucket is full again (nothing is lost by it)."""
        burst = float(self._policy.urgent_burst_bytes)
        for key, tenant in list(lane.tenants.items()):
            if not tenant.tracks:
                self._refill(lane, tenant, now)
                if tenant.tokens >= burst:
                    del lane.tenants[key]
        lane.sweep_at = max(64, 2 * len(lane.tenants))

    # --- internals: handing out ----------------------------------------------------------

    def _hand_out(self, t: _Track, size: int, path: Path, now: float) -> Chunk:
        """Cut the next ``size`` bytes of ``t`` and account for them as in flight."""
        req, lane, cq = t.req, t.lane, t.cq
        offset = req.submitted_bytes
        if req.state is RequestState.QUEUED:
            req.state = RequestState.ACTIVE
            req.first_submit = now
            req.path = path
        req.submitted_bytes = offset + size
        req.inflight_chunks += 1
        t.since = now
        strict = cq.spec.strict
        if path is Path.EXPRESS:
            lane.express_inflight += size
            t.tenant.inflight[_EXPRESS] += 1
        elif strict:
            lane.strict_inflight += size
            t.tenant.inflight[_STRICT] += 1
        else:
            lane.inflight += size
            t.tenant.inflight[_BULK] += 1
        if strict:
            self._strict_chunks += 1
        self._inflight_chunks += 1
        cq.queued_bytes -= size
        if req.submitted_bytes == req.nbytes:
            self._unqueue(t)
        return Chunk(req, offset, size, path, strict)

    def _serve_fifo(self, lane: _Lane, now: float, out: list[Chunk]) -> None:
        """mode "fifo": every request whole, in arrival order, no bound (a plain CUDA stream)."""
        q = lane.fifo
        while q:
            t = q.popleft()
            if t.queued:
                out.append(self._hand_out(t, t.req.nbytes - t.req.submitted_bytes, Path.DMA, now))

    def _serve(self, lane: _Lane, now: float, out: list[Chunk]) -> None:
        """mode "priod" for one lane: strict (express and DMA), then non-strict by weight."""
        chunk, bound = self._bound(lane, now)

        # Strict classes in order. Strict DMA has its own budget, so an urgent copy waits for
        # at most the non-strict bytes already in flight, never for a growing pile of its own
        # kind plus bulk. Once a class's DMA waits for that budget, lower strict classes may
        # still go express but not by DMA (it would pass the higher class).
        dma_ok = True
        for cq in lane.strict:
            if cq.live and self._serve_strict(lane, cq, chunk, bound, dma_ok, now, out):
                dma_ok = False

        if not lane.rr:
            return
        # Hold non-strict work while a strict DMA chunk is queued *or in flight*. Measured on
        # the H200: the copy engine keeps draining the bulk stream while it stays non-empty,
        # so an urgent chunk on another stream waited seconds while bulk chunks kept coming
        # behind it. Bulk resumes as soon as the urgent chunk lands.
        if not dma_ok or lane.strict_inflight:
            self._serve_aged(lane, now, out)
            return

        # Deficit round robin by bytes across classes; within a class, one chunk per tenant in
        # turn. The head of ``rr`` holds the turn; a turn can span several calls when the
        # in-flight bound fills up, hence ``in_turn``. A class whose tenants are all at their
        # cap of chunks in flight is passed over and keeps its turn for when it comes round.
        rr = lane.rr
        skipped = 0
        while rr and skipped < len(rr):
            cq = rr[0]
            if not cq.live:
                rr.popleft()
                cq.active = cq.in_turn = False
                continue
            g = self._pick(cq, _BULK)
            if g is None:
                rr.rotate(-1)
                skipped += 1
                continue
            t = g.head()
            size = min(chunk, t.req.nbytes - t.req.submitted_bytes)
            if lane.inflight and lane.inflight + size > bound:
                return
            if not cq.in_turn:
                # quantum >= chunk_bytes >= size, so every turn hands out at least one chunk.
                cq.deficit += cq.quantum
                cq.in_turn = True
            if cq.deficit < size:
                cq.in_turn = False
                rr.rotate(-1)
                continue
            cq.deficit -= size
            out.append(self._hand_out(t, size, Path.DMA, now))
            skipped = 0
            g.ring.rotate(-1)
            cq.ring.rotate(-1)

    def _serve_strict(self, lane: _Lane, cq: _ClassQueue, chunk: int, bound: int, dma_ok: bool, now: float, out: list[Chunk]) -> bool:
        """Hand out what one strict class may now, a chunk per tenant in turn. True: some of
        its DMA work waits for the lane's strict budget (or for a higher class's)."""
        ring = cq.ring
        cap = self._policy.depth
        waiting = False
        skipped = 0
        while ring and skipped < len(ring):
            g = ring[0]
            if not g.live:
                ring.popleft()
                g.in_ring = False
                continue
            t = g.head()
            req = t.req
            if t.route is None:
                if not t.admitted and not self._admit(t, now):
                    self._demote(t)
                    continue
                t.route = self._route(t, now)
            left = req.nbytes - req.submitted_bytes
            if t.route is Path.EXPRESS:
                # Express copies do not queue behind the copy engine: only the tenant's cap
                # bounds them (and its budget, already charged).
                if g.tenant.inflight[_EXPRESS] >= cap:
                    self._park(g)
                    continue
                out.append(self._hand_out(t, left, Path.EXPRESS, now))
            else:
                if g.tenant.inflight[_STRICT] >= cap:
                    self._park(g)
                    continue
                size = min(chunk, left)
                if not dma_ok or (lane.strict_inflight and lane.strict_inflight + size > bound):
                    waiting = True
                    ring.rotate(-1)
                    skipped += 1
                    continue
                out.append(self._hand_out(t, size, Path.DMA, now))
            skipped = 0
            g.ring.rotate(-1)
            ring.rotate(-1)
        return waiting

    def _route(self, t: _Track, now: float) -> Path:
        """A strict request's path: express where the lane has one for its size and it is
        faster now (choice.py), else DMA."""
        p, req = t.lane.params, t.req
        if (
            p.express_max
            and req.submitted_bytes == 0
            and p.express_min <= req.nbytes <= p.express_max
            and self._chooser.choose(t.lane.key, req.nbytes, now) is Path.EXPRESS
        ):
            return Path.EXPRESS
        return Path.DMA

    def _bound(self, lane: _Lane, now: float) -> tuple[int, int]:
        """Chunk size and in-flight bound of ``lane`` now: short while urgent copies are recent.

        Measured on the H200 (one CUDA context, bulk held while urgent work is pending): with
        27 MiB bulk chunks in flight a 64 KiB urgent DMA copy waited 550 us p50, ~1 ms p99; with
        4 MiB chunks, 93 / 152 us. Big chunks keep the link full with little polling; small
        ones cost polls. So bulk runs big chunks until an urgent copy shows up on the lane, and
        small ones for ``urgent_window_ms`` after the last.
        """
        p = lane.params
        if now - lane.last_strict < self._policy.urgent_window_ms / 1e3:
            return p.urgent_chunk_bytes, p.urgent_inflight_bytes
        return p.chunk_bytes, p.inflight_bytes

    def _serve_aged(self, lane: _Lane, now: float, out: list[Chunk]) -> None:
        """While strict work waits, let through one chunk per non-strict head waiting too long.

        Each class's head is the request its class would serve next (its turn's tenant and
        connection); the longest-waiting one goes first. Handing it a chunk restarts its wait,
        so a strict flood still leaves each class a chunk per ``aging_ms``. These chunks still
        respect the in-flight bound and the tenants' caps, and are not charged to the
        round-robin deficits.
        """
        chunk, bound = self._bound(lane, now)
        limit = now - self._policy.aging_ms / 1000.0
        while True:
            best: _Track | None = None
            best_group: _Group | None = None
            best_since = limit
            for cq in lane.nonstrict:
                if cq.live:
                    g = self._pick(cq, _BULK)
                    if g is not None:
                        t = g.head()
                        if t.since < best_since:
                            best, best_group, best_since = t, g, t.since
            if best is None or best_group is None:
                return
            size = min(chunk, best.req.nbytes - best.req.submitted_bytes)
            if lane.inflight and lane.inflight + size > bound:
                return
            out.append(self._hand_out(best, size, Path.DMA, now))
            best_group.ring.rotate(-1)
            best_group.cq.ring.rotate(-1)


def _below_strict(policy: Policy) -> str:
    """Where strict work past its client's budget is served: the highest-weight non-strict
    class (the first such in the policy on a tie)."""
    return max((c for c in policy.classes if not c.strict), key=lambda c: c.weight).name
