"""What one client may have on one lane: its urgent budget and its chunks in flight. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). Why it exists: the
strict class holds bulk back while it is queued or in flight, so without a limit one client's
urgent flood would take the lane from everyone else (docs/design.md, promise 7); and one
client's flood of small copies would fill the engine's FIFO queue ahead of others (promise 6).

- A *tenant* is a uid, or the connection where the uid is unknown (`TenantKey`); each lane
  keeps one `Tenant` per client that has requests there or has spent tokens lately.
- The urgent budget is a token bucket of strict bytes (``urgent_budget_bytes_per_s``, or
  ``urgent_budget_share`` of the lane if lower; ``urgent_burst_bytes`` deep) and a cap on the
  strict bytes admitted and not yet finished (``urgent_inflight_bytes``). A strict request is
  charged once, when it first comes up for service (`admit`; express copies count like DMA
  ones). Nothing waits for tokens, so no timer is needed: a request past the budget is served
  as the highest-weight non-strict class instead, for good (dispatch.py).
- The in-flight cap: a tenant has at most ``depth`` chunks in flight per lane of each kind
  (`EXPRESS`, `STRICT`, `BULK`; `BULK` as many as the lane's bound holds where
  ``urgent_queue_us`` keeps more short chunks); its class groups wait off their rings while it is at the cap
  (``parked``; queues.py parks and unparks them). Non-strict chunks under `SMALL_CHUNK_BYTES`
  count `SMALL_PER_SLOT` to one (`Tenant.slots`).

No clocks: the caller passes ``now``.

This module sits below lanes.py and queues.py, which import it: it names what it reads of a
lane and a request by the protocols `BudgetLane` and `Charge`, and a tenant's parked groups
by a type parameter (`Tenant`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sized
from typing import Generic, Protocol, TypeVar

from priod.common.types import LaneInfo
from priod.daemon.sched.records import Request
from priod.wire.batch import SEGMENT_COST_S

EXPRESS, STRICT, BULK = 0, 1, 2
"""Kinds of chunk in flight, counted per tenant: express, strict DMA, non-strict DMA."""

SMALL_CHUNK_BYTES = 64 << 10
SMALL_PER_SLOT = 16
"""Non-strict chunks under `SMALL_CHUNK_BYTES` take one in-flight slot per `SMALL_PER_SLOT` of
them. The cap stops one client's flood of small copies from filling the engine's queue ahead of
others; what a chunk costs the others there is its bytes plus a few microseconds of the engine's
own, so 16 copies of at most 64 KiB (about 1 MiB and 50 us) weigh about what one short-bound
chunk does. Counted one a slot, a client's pipelined 64-byte copies went through the daemon two
at a time: 0.27-0.32x a bare echo's frames/s, against 0.39-0.40x counted so (2-vCPU VM, sim
engine, docs/benchmarks.md)."""

TenantKey = tuple[str, Hashable]
"""``("uid", uid)``, or ``("owner", connection)`` where the uid is unknown."""


G = TypeVar("G")
"""What a tenant parks: a class group (`lanes.Group`, which names its tenant in turn)."""


class Tenant(Generic[G]):
    """One client on one lane: its urgent budget and its chunks in flight.

    Generic in its parked groups (``Tenant[Group]``), so that this module need not name them."""

    __slots__ = ("inflight", "parked", "pending", "small", "stamp", "tokens", "tracks")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens = tokens
        """The token bucket of strict bytes, refilled lazily from ``stamp``."""
        self.stamp = now
        self.pending = 0
        """Strict bytes admitted and not finished (``urgent_inflight_bytes`` bounds it)."""
        self.inflight = [0, 0, 0]
        """Chunks in flight by kind (EXPRESS, STRICT, BULK); each is at most ``depth``, BULK in slots."""
        self.small = 0
        """Its non-strict chunks in flight under `SMALL_CHUNK_BYTES` (among ``inflight[BULK]``)."""
        self.parked: list[G] = []
        """Its class groups taken off their rings while it was at a cap; put back on a completion."""
        self.tracks = 0
        """Its requests on this lane, queued or in flight."""

    def slots(self, kind: int) -> int:
        """Its in-flight slots of ``kind`` that ``depth`` caps: a chunk each, but non-strict
        chunks under `SMALL_CHUNK_BYTES` `SMALL_PER_SLOT` to a slot."""
        if kind != BULK:
            return self.inflight[kind]
        small = self.small
        return self.inflight[BULK] - small + small // SMALL_PER_SLOT


class BudgetLane(Protocol[G]):
    """What this module reads and keeps of a lane (a `lanes.Lane`)."""

    sweep_at: int

    @property
    def tenants(self) -> dict[TenantKey, Tenant[G]]: ...
    @property
    def info(self) -> LaneInfo: ...
    @property
    def budget_rate(self) -> float: ...
    @property
    def burst(self) -> float: ...
    @property
    def min_strict_cost(self) -> int: ...
    @property
    def pending_cap(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def rr(self) -> Sized:
        """Its non-strict classes with queued work (only whether there are any is read here)."""
        ...


class Charge(Protocol[G]):
    """What `admit` reads and sets of a strict request's record (a `lanes.Track`)."""

    charged: int
    admitted: bool

    @property
    def req(self) -> Request: ...
    @property
    def lane(self) -> BudgetLane[G]: ...
    @property
    def tenant(self) -> Tenant[G]: ...


def tenant(lane: BudgetLane[G], key: TenantKey, now: float) -> Tenant[G]:
    """``key``'s tenant on ``lane``; a new one with a full bucket where the lane has none."""
    tenant = lane.tenants.get(key)
    if tenant is None:
        if len(lane.tenants) >= lane.sweep_at:
            sweep(lane, now)
        tenant = lane.tenants[key] = Tenant(lane.burst, now)
    return tenant


def refill(lane: BudgetLane[G], tenant: Tenant[G], now: float) -> None:
    if now > tenant.stamp:
        tenant.tokens = min(lane.burst, tenant.tokens + lane.budget_rate * (now - tenant.stamp))
        tenant.stamp = now


def admit(t: Charge[G], now: float) -> bool:
    """Charge a strict request to its tenant's budget; False: past it (nothing charged).

    A request costs its bytes (a batch, its segments' engine time as bytes too), but at least
    one short-bound chunk of the lane (``urgent_chunk_bytes``, capped at the burst) while the
    lane has non-strict work queued or in flight: bulk is then held while the copy is queued or
    in flight by DMA, which costs the others about that much however small the copy. With none,
    holding costs no one anything, and the copy costs its bytes (a client's tiny urgent copies on
    an idle lane do not spend the budget it will need once bulk comes).
    """
    lane, tenant, req = t.lane, t.tenant, t.req
    left = req.nbytes - req.submitted_bytes
    if req.segments is not None:
        # A batch also costs the engine time per segment, as its chunks are cut (batch.py): an
        # urgent batch of many tiny segments holds bulk back far longer than its bytes say.
        left += len(req.segments) * int(lane.info.bandwidth * SEGMENT_COST_S)
    cost = left
    if (lane.inflight or lane.rr) and lane.min_strict_cost > left:
        cost = lane.min_strict_cost
    if now > tenant.stamp:  # `refill`, inline (min() too): this runs once per urgent copy
        tokens = tenant.tokens + lane.budget_rate * (now - tenant.stamp)
        tenant.tokens = tokens if tokens < lane.burst else lane.burst
        tenant.stamp = now
    if cost > tenant.tokens or tenant.pending + cost > lane.pending_cap:
        return False
    tenant.tokens -= cost
    tenant.pending += cost
    t.charged = cost
    t.admitted = True
    return True


def sweep(lane: BudgetLane[G], now: float) -> None:
    """Forget tenants with no requests whose bucket is full again (nothing is lost by it)."""
    for key, tenant in list(lane.tenants.items()):
        if not tenant.tracks:
            refill(lane, tenant, now)
            if tenant.tokens >= lane.burst:
                del lane.tenants[key]
    lane.sweep_at = max(64, 2 * len(lane.tenants))
