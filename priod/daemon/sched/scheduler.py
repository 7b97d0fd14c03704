"""The scheduler: priority classes, chunking and the in-flight bound, per lane. Pure logic.

No sockets, no CUDA, no clocks: the caller passes ``now`` (seconds, any monotonic origin) and
submits the chunks this module hands out. That keeps the promise below testable on its own.

The promise (docs/design.md), per lane (device x direction):
- At most ``inflight_bytes`` of non-strict DMA chunks are submitted to the engine at once; the
  rest waits here, where priority decides.
- A strict-class (``urgent``) request is handed out before any queued chunk of a lower class:
  on the express path when the lane has one for its size, else as DMA chunks with a budget of
  its own, so it waits for at most the non-strict bytes already in flight (on a lane with a
  gate, the chunk running: the pump closes the gate for it, lane_params). No non-strict
  chunk is handed out while a strict DMA chunk is queued or in flight on the lane.
- Non-strict classes share the lane by weight: deficit round robin, measured in bytes.
- Inside every class, clients share by round robin (a tenant is a uid; the connection where
  the uid is unknown), each with at most ``depth`` chunks in flight per lane and path.
- Strict work has a budget per tenant and lane; past it, a request is served as the
  highest-weight non-strict class (``high``) instead, for good.
- ``mode = "fifo"`` switches all of it off: whole copies, in arrival order, no bound. It is what
  a plain CUDA stream does, and the baseline the benchmarks compare against.

This module is the public face: the records that go in and out (`Request`, `Chunk`,
`Finished`, the statistics; defined in records.py, re-exported here) and `Scheduler`, which
keeps the books (each request's state, chunks in flight, outcomes). The machinery behind it,
in the order a request meets it: queues.py (where requests wait: class queues, tenant and
connection rings, EDF), budget.py (each client's urgent budget and cap of chunks in flight),
lanes.py (one lane's state and bounds), dispatch.py (which request gets the next chunk, how
big, by which path).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Literal

from priod.common.choice import PathChooser, PathEstimate
from priod.common.types import Direction, LaneInfo, LaneKey, Path
from priod.daemon.sched import budget
from priod.daemon.sched.budget import TenantKey
from priod.daemon.sched.dispatch import Dispatcher
from priod.daemon.sched.lanes import Lane
from priod.daemon.sched.policy import LaneParams, Policy, validate_policy
from priod.daemon.sched.queues import ClassQueue, Track, leave_class, push, unpark
from priod.daemon.sched.records import Chunk, Finished, LaneStats, Request, RequestState, SchedulerStats
from priod.errors import ConfigError, InvalidRequest, NotFound, PermissionDenied
from priod.wire.batch import SEGMENT_COST_S, URGENT_DMA_SEGMENTS

__all__ = ["Chunk", "Finished", "LaneStats", "Request", "RequestState", "Scheduler", "SchedulerStats"]

_OUTCOMES: tuple[str, ...] = ("done", "cancelled", "failed")

# Enum members read as module globals where they are read per chunk: on Python 3.11 a member
# read off its class (``RequestState.DONE``) costs ~55 ns more than a global (EnumType's
# __getattr__ takes enum classes off the interpreter's fast attribute path).
_QUEUED, _ACTIVE, _DONE, _CANCELLED, _FAILED = (
    RequestState.QUEUED,
    RequestState.ACTIVE,
    RequestState.DONE,
    RequestState.CANCELLED,
    RequestState.FAILED,
)
_EXPRESS = Path.EXPRESS
_DMA = Path.DMA


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

    def __init__(self, policy: Policy, lanes: Iterable[LaneInfo], *, host_bandwidth: float = 0.0) -> None:
        """``host_bandwidth``: bytes/s of host memory shared by every h2d and d2h lane
        (`Engine.host_bandwidth`; 0: none). While the host lanes with work ask for more, each
        one's chunks and in-flight bound shrink in proportion (`Lane.bound`), so an urgent copy
        still waits for about ``max_block_us`` of bulk, not that times the slowdown."""
        validate_policy(policy)
        if not (0 <= host_bandwidth < math.inf):
            raise ConfigError(
                f"host bandwidth = {host_bandwidth} is invalid; give a finite number of bytes/s >= 0 (0: none)"
            )
        self._policy = policy
        self._class_names: set[str] = {c.name for c in policy.classes}
        self._fallback = ""  # set by set_policy: a class name only a reload can remove
        self._lanes: dict[LaneKey, Lane] = {}
        for info in sorted(lanes, key=lambda i: i.key):
            if info.key in self._lanes:
                raise ConfigError(f"lane {info.key} is listed twice; an engine must report each lane once")
            lane = Lane(info)
            lane.configure(policy)
            self._lanes[info.key] = lane
        self._lane_list = list(self._lanes.values())
        self._host_bandwidth = host_bandwidth
        self._host_lanes = (
            [ln for ln in self._lane_list if ln.key.direction in (Direction.H2D, Direction.D2H)]
            if host_bandwidth > 0
            else []
        )
        self._tracks: dict[int, Track] = {}
        self._by_owner: dict[Hashable, set[int]] = {}
        """Each owner's requests queued or in flight. An owner's set stays while it is about,
        empty or not (a connection making one copy at a time would otherwise make and drop a
        set per copy, ~0.3 us of the loop); `drop_owner` removes it."""
        self._seq = 0
        self._queued = 0
        self._inflight_chunks = 0
        self._strict_chunks = 0
        self._misses = 0
        self._finished = dict.fromkeys(_OUTCOMES, 0)
        self._chooser = PathChooser(policy.explore_ms / 1e3, policy.explore_every)
        self._urgent_until = -math.inf
        self._requests_until = -math.inf
        """Like ``_urgent_until``, from urgent requests only (not clients' direct copies)."""
        self._held: frozenset[LaneKey] = frozenset()
        self._beat_lanes: set[Lane] = set()
        """Lanes whose urgent requests have given them a beat's gaps: the few `beat_watch_at`
        looks at. Not for clients' direct copies alone: their holds ring a doorbell and need
        nothing read, and a loop turning beside them takes a core from their clients."""
        self._beat_spin_s = policy.beat_spin_us / 1e6
        self._dispatch = Dispatcher(policy, self._chooser, self._hand_out)

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
        self._class_names, self._fallback = names, fallback
        self._policy = policy
        self._dispatch.configure(policy)
        self._chooser.explore_s = policy.explore_ms / 1e3
        self._chooser.explore_every = policy.explore_every
        for lane in self._lane_list:
            lane.configure(policy)
        self._beat_lanes.clear()  # each lane learns its beat afresh
        self._beat_spin_s = policy.beat_spin_us / 1e6
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

    def class_after_reload(self, cls: str) -> str:
        """``cls`` where the policy has it, else the class `set_policy` moves such requests to:
        for requests accepted before a reload and not queued here (held for their events)."""
        return cls if cls in self._class_names else self._fallback

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
        cq = self._check(lane, req)
        spec = cq.spec
        if spec.strict:
            lane.urgent_arrived(now)
            if lane.beat_gaps:
                self._beat_lanes.add(lane)
            until = now + lane.window  # urgent_window_ms, in seconds
            if until > self._urgent_until:
                self._urgent_until = until
            if until > self._requests_until:
                self._requests_until = until
        tkey: TenantKey = ("owner", req.owner) if req.uid is None else ("uid", req.uid)
        tenant = lane.tenants.get(tkey)
        if tenant is None:  # the usual copy finds its tenant: no call
            tenant = budget.tenant(lane, tkey, now)
        tenant.tracks += 1
        self._seq += 1
        t = Track(req, lane, cq, self._seq, tkey, tenant)
        self._tracks[req.id] = t
        ids = self._by_owner.get(req.owner)
        if ids is None:  # not setdefault: that makes a set per copy to throw away
            ids = self._by_owner[req.owner] = set()
        ids.add(req.id)
        self._place(t)

    def check(self, req: Request) -> ClassQueue:
        """Raise what `enqueue` would raise for ``req``, queuing nothing (a request held for
        its event is checked on arrival); the class queue it would join."""
        return self._check(self._lane(req.lane), req)

    def _check(self, lane: Lane, req: Request) -> ClassQueue:
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
        return cq

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
            raise NotFound(f"no copy with id {request_id} is queued or in flight; it may have finished already")
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
        # The owner's set goes now; its copies still in flight finish without it (`_finish`).
        for rid in self._by_owner.pop(owner, ()):
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
        if self._host_lanes and not fifo:
            self._share_host()
        for lane in self._lane_list:
            if not lane.queued:
                continue
            if fifo:
                self._dispatch.serve_fifo(lane, now, out)
            else:
                self._dispatch.serve(lane, now, out)
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
        size = chunk.nbytes
        tenant = t.tenant
        t.lane.count(tenant, chunk.path, chunk.strict, size, -1)
        if tenant.parked:
            unpark(tenant)
        if chunk.strict:
            self._strict_chunks -= 1
        self._inflight_chunks -= 1
        req.inflight_chunks -= 1

        state = req.state
        if error is None:
            if state is not _FAILED:
                req.done_bytes += size
                req.last_done = now
        elif state is _ACTIVE:
            # The first failure decides; a cancel already asked for keeps its outcome.
            req.state = state = _FAILED
            req.error = error
            self._stop(t)
        if req.inflight_chunks:
            return []
        if state is _ACTIVE:
            if req.done_bytes < req.nbytes:
                return []
            req.state = _DONE
            return [self._finish(t, "done")]
        return [self._finish(t, "cancelled" if state is _CANCELLED else "failed")]

    # --- state ---------------------------------------------------------------------------

    def set_holds(self, held: frozenset[LaneKey], begun: frozenset[LaneKey], now: float) -> None:
        """Clients' direct urgent copies (holds.py): ``held`` lanes hand out no non-strict chunk
        but aged ones until the next call; a copy ``begun`` on a lane starts its short bound,
        as a strict request's arrival does. Lanes this scheduler does not serve are ignored."""
        for key in begun:
            lane = self._lanes.get(key)
            if lane is not None:
                lane.urgent_arrived(now)
                self._urgent_until = max(self._urgent_until, now + lane.window)  # urgent_window_ms, as in `enqueue`
        if held != self._held:
            self._held = held
            for lane in self._lane_list:
                lane.held = lane.key in held

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self._queued and not self._inflight_chunks

    @property
    def strict_in_flight(self) -> bool:
        """Some strict-class chunk (express or DMA) is in flight: worth polling tightly."""
        return self._strict_chunks > 0

    def strict_dma_lanes(self) -> frozenset[LaneKey]:
        """The lanes with a strict-class DMA chunk handed out and not yet done."""
        return frozenset(lane.key for lane in self._lane_list if lane.strict_inflight)

    def strict_dma_on(self, key: LaneKey) -> bool:
        """Whether lane ``key`` has a strict-class DMA chunk handed out and not yet done."""
        lane = self._lanes.get(key)
        return lane is not None and lane.strict_inflight > 0

    def urgent_recent(self, now: float) -> bool:
        """Some lane runs its short bound: its small chunks want polling every loop turn."""
        return now < self._urgent_until

    def beat_watch_at(self, now: float) -> float:
        """When the loop should next be awake for a lane's coming burst of urgent copies
        (`Lane.beat_watch`, ``beat_spin_us`` ahead): at or before ``now`` while one is watched
        for, inf where none will be until more copies come."""
        lead = self._beat_spin_s
        if not lead or not self._beat_lanes:
            return math.inf
        return min(lane.beat_watch(now, lead) for lane in self._beat_lanes)

    def urgent_requests_recent(self, now: float) -> bool:
        """An urgent request came within ``urgent_window_ms``: another may follow soon. A
        client's direct copy does not count: the daemon has nothing to read or answer for it."""
        return now < self._requests_until

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
                device=lane.key.device,
                peer=lane.key.peer,
                host_scale=lane.host_scale,
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
                batch_chunk_bytes=lane.params.batch_chunk_bytes,
                batch_inflight_bound=lane.params.batch_inflight_bytes,
                beat_chunk_bytes=lane.params.beat_chunk_bytes,
                beat_inflight_bound=lane.params.beat_inflight_bytes,
                beat_us=None if (beat := lane.beat) is None else beat * 1e6,
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
            demoted=self._dispatch.demoted,
        )

    # --- internals ---------------------------------------------------------------------

    def _lane(self, key: LaneKey) -> Lane:
        lane = self._lanes.get(key)
        if lane is None:
            known = ", ".join(str(k) for k in self._lanes) or "none"
            raise InvalidRequest(f"no lane {key}; the lanes are {known}")
        return lane

    def _share_host(self) -> None:
        """Set each host lane's share of its rate from the host lanes that have work now: the
        sum of their rates against the host's bandwidth (proportional, as the sim models it)."""
        demand = 0.0
        for lane in self._host_lanes:
            if lane.queued or lane.inflight or lane.strict_inflight or lane.express_inflight:
                demand += lane.info.bandwidth
        scale = min(1.0, self._host_bandwidth / demand) if demand else 1.0
        for lane in self._host_lanes:
            lane.host_scale = scale

    def _place(self, t: Track) -> None:
        """Count a request with bytes to hand out as queued, in the queue its mode and class say."""
        t.queued = True
        t.lane.queued += 1
        self._queued += 1
        push(t, self._policy.mode == "fifo")

    def _stop(self, t: Track) -> None:
        """Take a cancelled or failed request's unsent bytes out of the queue counters."""
        if t.queued:
            t.cq.queued_bytes -= t.req.nbytes - t.req.submitted_bytes
            self._unqueue(t)

    def _unqueue(self, t: Track) -> None:
        t.queued = False
        t.lane.queued -= 1
        self._queued -= 1
        leave_class(t)

    def _finish(self, t: Track, outcome: Literal["done", "cancelled", "failed"]) -> Finished:
        req = t.req
        missed = (
            outcome == "done"
            and req.deadline is not None
            and req.last_done is not None
            and req.last_done > req.deadline
        )
        del self._tracks[req.id]
        ids = self._by_owner.get(req.owner)
        if ids is not None:  # None: the owner was dropped while this copy was in flight
            ids.discard(req.id)
        tenant = t.tenant
        tenant.tracks -= 1
        tenant.pending -= t.charged
        t.charged = 0
        self._finished[outcome] += 1
        if (
            outcome == "done"
            and t.cq.spec.strict
            and req.path is not None
            and req.first_submit is not None
            and req.last_done is not None
        ):
            p = t.lane.params
            if (
                p.express_max and p.express_min <= req.nbytes <= p.express_max
            ):  # a size with a choice (`Dispatcher._route`)
                self._chooser.observe(
                    t.lane.key,
                    req.path,
                    req.nbytes,
                    req.last_done - req.first_submit,
                    req.last_done,
                    req.segments is not None,
                )
        if missed:
            self._misses += 1
        return Finished(req, outcome, req.done_bytes, missed, req.error if outcome == "failed" else None)

    def _hand_out(self, t: Track, size: int, path: Path, now: float) -> Chunk:
        """Cut the next ``size`` bytes of ``t`` and account for them as in flight."""
        req, lane, cq = t.req, t.lane, t.cq
        offset = req.submitted_bytes
        if req.segments is not None:
            if path is _EXPRESS:
                # One kernel row per segment: no per-descriptor cost, only the cap per chunk.
                size = req.segments.cut(offset, size, 0)
            elif cq.spec.strict:
                size = req.segments.cut(offset, size, 0, URGENT_DMA_SEGMENTS)
            else:
                # The cost budget is a whole chunk of the lane even when fewer bytes are left
                # (``size`` is then the rest): else each chunk would be cut against what remains
                # and a batch would shrink into ever smaller chunks.
                budget = max(size, lane.bound(now, batch=req.segments.small_blocks())[0])
                size = min(size, req.segments.cut(offset, budget, int(lane.info.bandwidth * SEGMENT_COST_S)))
        if req.state is _QUEUED:
            req.state = _ACTIVE
            req.first_submit = now
            req.path = path
        req.submitted_bytes = offset + size
        req.inflight_chunks += 1
        t.since = now
        strict = cq.spec.strict
        lane.count(t.tenant, path, strict, size, 1)
        if strict:
            self._strict_chunks += 1
        self._inflight_chunks += 1
        cq.queued_bytes -= size
        if req.submitted_bytes == req.nbytes:
            self._unqueue(t)
        # Gated: a bulk DMA chunk, which a direct copy's hold or the daemon's own urgent DMA
        # chunk must be able to stop on the GPU once queued (Pump._set_gates). Not a chunk of a
        # batch of small blocks outside the short bound: its long bound (batch_block_us) keeps
        # the link fed without a wait before each call.
        gated = (
            lane.gate
            and not strict
            and path is _DMA
            and (req.segments is None or now - lane.last_strict < lane.window or not req.segments.small_blocks())
        )
        return Chunk(req, offset, size, path, strict, gated)
