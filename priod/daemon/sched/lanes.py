"""One lane's state: its parameters, class queues, tenants, and bytes in flight. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). A lane is a device
and a direction, one copy engine: every figure of the promise (docs/design.md) is kept per
lane, and lanes never wait on each other. What is derived from the policy (chunk size,
in-flight bounds, the classes, each tenant's urgent rate) is set in one place, `Lane.configure`,
on start and on every reload; `Lane.bound` says which of the two bounds holds now.

The records of what waits on a lane are here too (`Track`, and the class queues `ClassQueue`,
`Group`, `Sub`; queues.py describes them and has the operations on them): a lane holds its
queues and every request's record points back at its lane, so they live in one module, below
queues.py and dispatch.py, which use them.

No clocks: the caller passes ``now``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable

from priod.common.types import LaneInfo, Path
from priod.daemon.sched.budget import BULK, EXPRESS, SMALL_CHUNK_BYTES, STRICT, Tenant, TenantKey
from priod.daemon.sched.policy import ALIGN, ClassSpec, LaneParams, Policy, gated_bulk, lane_params
from priod.daemon.sched.records import Request

_EXPRESS = Path.EXPRESS
"""A module global: read per chunk, where ``Path.EXPRESS`` costs ~55 ns more on Python 3.11
(EnumType's __getattr__ takes enum classes off the fast attribute path)."""

BURST_S = 300e-6
"""Urgent copies that arrive within this of the one before belong to one burst (an inference
step's several copies): the beat is the time from one burst's first copy to the next's, and the
long chunks between bursts start this long after a burst's last copy arrived."""
BEAT_GAPS = 4
"""Gaps between bursts a lane remembers: the beat is the shortest of them, so one early burst
turns the long chunks off until four steady gaps have passed again."""
BEAT_STEADY = 1.5
"""The gaps make a beat only where the longest is at most this times the shortest. Copies at
random times (exponential gaps, a mean of 5-10 ms) would otherwise find long chunks running
at 7-15% of their arrivals, and wait for one; with this rule, at 0.5% or less, while a 5 ms beat
jittered by +-1 ms keeps its long chunks (tests/test_path_choice.py)."""
BEAT_MARGIN_S = 450e-6
"""How long before the next burst is due the long chunk that an urgent copy would wait for (the
one running, on a lane with a gate; else all in flight) has ended: copies that come, or that the
daemon sees, up to this early meet short chunks only. With 150 us a front-door copy's p99 under
bulk read 424-2,325 us against 236-313 with 450 (H100, docs/design.md, Defaults)."""
BEAT_MIN_S = 1e-3
"""The long chunks are used only where the beat leaves at least this long for them."""
BEAT_WATCH_LATE_S = 500e-6
"""A burst that comes later than the beat's shortest gap is watched for as long as the gaps
spread, up to this: the daemon's loop stays awake no more than ``2 x beat_spin_us`` and this
per burst (`Lane.beat_watch`)."""


class Lane:
    """Per-lane state: parameters, class queues, tenants, and bytes in flight by kind."""

    __slots__ = (
        "beat_gaps",
        "beat_lead",
        "beat_until",
        "budget_rate",
        "burst",
        "burst_start",
        "classes",
        "express_inflight",
        "fifo",
        "gate",
        "held",
        "host_scale",
        "inflight",
        "info",
        "key",
        "last_strict",
        "min_chunk",
        "min_strict_cost",
        "nonstrict",
        "params",
        "pending_cap",
        "queued",
        "rr",
        "strict",
        "strict_inflight",
        "sweep_at",
        "tenants",
        "window",
    )

    def __init__(self, info: LaneInfo) -> None:
        self.key = info.key
        self.info = info
        self.params = LaneParams(ALIGN, ALIGN, 0, 0)
        self.classes: dict[str, ClassQueue] = {}
        self.strict: list[ClassQueue] = []
        self.nonstrict: list[ClassQueue] = []
        self.rr: deque[ClassQueue] = deque()
        """Non-strict classes with queued work, in round-robin order; the head has the turn."""
        self.fifo: deque[Track] = deque()
        """mode "fifo": every request, in arrival order."""
        self.queued = 0
        """Requests with bytes still to hand out."""
        self.inflight = 0
        """Non-strict DMA bytes in flight: the figure ``inflight_bytes`` bounds."""
        self.strict_inflight = 0
        self.express_inflight = 0
        self.held = False
        """A client's direct urgent copy is under way on this lane (holds.py): no bulk chunk goes."""
        self.last_strict = -math.inf
        """When a strict request last arrived: the short bound holds for ``urgent_window_ms`` after."""
        self.window = 0.0
        """``urgent_window_ms``, in seconds."""
        self.burst_start = -math.inf
        """When the current (or last) burst of urgent copies began (`urgent_arrived`)."""
        self.beat_gaps: tuple[float, ...] = ()
        """The last `BEAT_GAPS` times from one burst's start to the next's."""
        self.beat_lead = 0.0
        """``beat_block_us`` and `BEAT_MARGIN_S`, in seconds; 0: no long chunks between bursts."""
        self.beat_until = -math.inf
        """From `BURST_S` after the last urgent copy until then (the burst over, the next not yet
        close), bulk runs the beat bound."""
        self.gate = False
        """Bulk DMA chunks are handed out gated (`gated_bulk`)."""
        self.tenants: dict[TenantKey, Tenant[Group]] = {}
        """Kept past a tenant's last request until its bucket is full again (see `budget.sweep`)."""
        self.sweep_at = 64
        self.budget_rate = 0.0
        """Each tenant's urgent budget on this lane, bytes/s; the three figures below are the
        rest of it: policy-derived, kept here so that admitting a strict copy reads no policy."""
        self.burst = 0.0
        """``urgent_burst_bytes``: the depth of a tenant's bucket."""
        self.min_strict_cost = 0
        """What a strict copy costs at least: a short-bound chunk, capped at the burst (budget.admit)."""
        self.pending_cap = 0
        """``urgent_inflight_bytes``: strict bytes a tenant may have admitted and not finished."""
        self.host_scale = 1.0
        """A host lane's share of its own rate while the host links busy now ask for more host
        memory bandwidth than there is (set by the scheduler each turn); 1.0 otherwise."""
        self.min_chunk = ALIGN

    def configure(self, policy: Policy) -> None:
        """Fresh class queues and parameters for ``policy`` (requests are re-placed by the caller)."""
        self.params = lane_params(self.info, policy)
        # quantum >= the largest chunk, so a class's every turn hands out at least one (dispatch.py).
        self.classes = {
            c.name: ClassQueue(c, max(self.params.chunk_bytes, self.params.batch_chunk_bytes)) for c in policy.classes
        }
        self.strict = [cq for cq in self.classes.values() if cq.spec.strict]
        self.nonstrict = [cq for cq in self.classes.values() if not cq.spec.strict]
        self.rr = deque()
        self.fifo = deque()
        self.queued = 0
        self.window = policy.urgent_window_ms / 1e3
        self.beat_lead = (
            policy.beat_block_us / 1e6 + BEAT_MARGIN_S if policy.beat_block_us and policy.mode == "priod" else 0.0
        )
        self.burst_start = -math.inf  # a new policy learns its beat afresh
        self.beat_gaps = ()
        self.beat_until = -math.inf
        self.gate = gated_bulk(self.info, policy)
        self.min_chunk = policy.min_chunk_bytes
        self.budget_rate = min(policy.urgent_budget_bytes_per_s, policy.urgent_budget_share * self.info.bandwidth)
        self.burst = float(policy.urgent_burst_bytes)
        self.min_strict_cost = min(self.params.urgent_chunk_bytes, policy.urgent_burst_bytes)
        self.pending_cap = policy.urgent_inflight_bytes
        for tn in self.tenants.values():
            tn.parked.clear()  # their groups went with the old class queues

    def count(self, tenant: Tenant[Group], path: Path, strict: bool, size: int, n: int) -> None:
        """Count a chunk of ``size`` bytes into flight (``n`` = 1) or out of it (``n`` = -1):
        the lane's bytes of its kind (express, strict DMA, non-strict DMA), its tenant's chunks."""
        if path is _EXPRESS:
            self.express_inflight += n * size
            tenant.inflight[EXPRESS] += n
        elif strict:
            self.strict_inflight += n * size
            tenant.inflight[STRICT] += n
        else:
            self.inflight += n * size
            tenant.inflight[BULK] += n
            if size < SMALL_CHUNK_BYTES:
                tenant.small += n

    def urgent_arrived(self, now: float) -> None:
        """An urgent copy arrived on this lane (a strict request, or a client's direct copy
        begun): the short bound holds from now for ``urgent_window_ms``. Where ``beat_block_us``
        is set, the copy also counts toward the lane's beat: a copy more than `BURST_S` after
        the one before starts a burst, and once `BEAT_GAPS` gaps between bursts are known, bulk
        runs the beat bound from `BURST_S` after this burst's last copy until the shortest of
        those gaps, less ``beat_lead``, has passed since this burst began, where the gaps are
        steady (`beat`).

        Long chunks between beats keep bulk near the link's rate at the same urgent latencies
        (H200, a direct copy every 5 ms: bulk 0.93-0.97 of raw with ``beat_block_us`` 600,
        0.89-0.94 without; see docs/design.md, Defaults). A copy that comes before the beat
        says waits for the long chunk running then."""
        if self.beat_lead and now - self.last_strict >= BURST_S:
            if self.burst_start > -math.inf:
                self.beat_gaps = (*self.beat_gaps[1 - BEAT_GAPS :], now - self.burst_start)
            self.burst_start = now
            beat = self.beat
            until = -math.inf if beat is None else now + beat - self.beat_lead
            self.beat_until = until if until - (now + BURST_S) >= BEAT_MIN_S else -math.inf
        self.last_strict = now

    def beat_watch(self, now: float, lead: float) -> float:
        """When the daemon's loop should be awake for this lane's next burst of urgent copies,
        so that it reads the burst's first copy (a descriptor on the copy ring, a frame) on a loop
        turn rather than after a wake-up: from ``lead`` before the burst is due (the beat's
        shortest gap after the last burst began) until ``lead`` and the gaps' spread (at most
        `BEAT_WATCH_LATE_S`) after. Returns that start, at or before ``now`` while the watch is
        on; inf where the lane keeps no steady beat (or one under `BEAT_MIN_S`: a loop awake
        most of such a beat would be a core spent) or the watch has passed without a burst."""
        beat = self.beat
        if beat is None or beat < BEAT_MIN_S:
            return math.inf
        due = self.burst_start + beat
        if now >= due + lead + min(max(self.beat_gaps) - beat, BEAT_WATCH_LATE_S):
            return math.inf
        return due - lead

    @property
    def beat(self) -> float | None:
        """The lane's beat in seconds: the shortest of its last `BEAT_GAPS` gaps between bursts,
        where those gaps are steady (`BEAT_STEADY`); else None."""
        gaps = self.beat_gaps
        if len(gaps) < BEAT_GAPS or max(gaps) > BEAT_STEADY * min(gaps):
            return None
        return min(gaps)

    def bound(self, now: float, batch: bool = False) -> tuple[int, int]:
        """Chunk size and in-flight bound now, for chunks of a batch of small blocks or others:
        short while urgent copies are recent, else ``batch_block_us`` for such batches,
        ``max_block_us`` for the rest.

        Measured on the H200 (one CUDA context, bulk held while urgent work is pending): with
        27 MiB bulk chunks in flight a 64 KiB urgent DMA copy waited 550 us p50, ~1 ms p99; with
        4 MiB chunks, 93 / 152 us. Big chunks keep the link full with little polling; small
        ones cost polls. So bulk runs big chunks until an urgent copy shows up on the lane, and
        small ones for ``urgent_window_ms`` after the last, but for long ones between the bursts
        of a steady beat (`urgent_arrived`).
        """
        p = self.params
        if now - self.last_strict < self.window:
            if self.last_strict + BURST_S <= now < self.beat_until:
                chunk, bound = p.beat_chunk_bytes, p.beat_inflight_bytes
            else:
                chunk, bound = p.urgent_chunk_bytes, p.urgent_inflight_bytes
        elif batch:
            chunk, bound = p.batch_chunk_bytes, p.batch_inflight_bytes
        else:
            chunk, bound = p.chunk_bytes, p.inflight_bytes
        scale = self.host_scale
        if scale < 1.0:
            # The host binds: this lane moves at ``scale`` of its rate, so the same bytes in
            # flight would hold an urgent copy 1/scale times longer. Keep the bound in time
            # instead, with as many (smaller) chunks, no smaller than min_chunk_bytes.
            depth = bound // chunk
            chunk = max(min(chunk, self.min_chunk), int(chunk * scale) // ALIGN * ALIGN)
            bound = chunk * depth
        return chunk, bound


# -- what waits on a lane: the records that queues.py and dispatch.py work on ----------------
class Track:
    """The scheduler's private record of one request, beside the caller-visible `Request`."""

    __slots__ = (
        "admitted",
        "charged",
        "cq",
        "group",
        "lane",
        "queued",
        "req",
        "route",
        "seq",
        "since",
        "sub",
        "tenant",
        "tkey",
    )

    def __init__(
        self, req: Request, lane: Lane, cq: ClassQueue, seq: int, tkey: TenantKey, tenant: Tenant[Group]
    ) -> None:
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

    def __init__(self, cq: ClassQueue, key: TenantKey, tenant: Tenant[Group]) -> None:
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

    __slots__ = (
        "active",
        "deficit",
        "groups",
        "in_turn",
        "live",
        "prune_at",
        "quantum",
        "queued_bytes",
        "ring",
        "spec",
    )

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

    def group(self, key: TenantKey, tenant: Tenant[Group]) -> Group:
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
