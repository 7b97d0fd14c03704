"""One lane's state: its parameters, class queues, tenants, and bytes in flight. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). A lane is a device
and a direction, one copy engine: every figure of the promise (docs/design.md) is kept per
lane, and lanes never wait on each other. What is derived from the policy (chunk size,
in-flight bounds, the classes, each tenant's urgent rate) is set in one place, `Lane.configure`,
on start and on every reload; `Lane.bound` says which of the two bounds holds now.

No clocks: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections import deque

from priod.common.types import LaneInfo, Path
from priod.daemon.sched.budget import BULK, EXPRESS, STRICT, Tenant, TenantKey
from priod.daemon.sched.policy import ALIGN, LaneParams, Policy, lane_params
from priod.daemon.sched.queues import ClassQueue, Track

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
BEAT_MARGIN_S = 150e-6
"""Past draining the long chunks in flight, how long before the next burst is due the lane is
back on its short bound."""
BEAT_MIN_S = 1e-3
"""The long chunks are used only where the beat leaves at least this long for them."""


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
        """``gate_bulk``: bulk DMA chunks under the short bound are handed out gated."""
        self.tenants: dict[TenantKey, Tenant] = {}
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
        self.classes = {c.name: ClassQueue(c, max(self.params.chunk_bytes, self.params.batch_chunk_bytes)) for c in policy.classes}
        self.strict = [cq for cq in self.classes.values() if cq.spec.strict]
        self.nonstrict = [cq for cq in self.classes.values() if not cq.spec.strict]
        self.rr = deque()
        self.fifo = deque()
        self.queued = 0
        self.window = policy.urgent_window_ms / 1e3
        self.beat_lead = policy.beat_block_us / 1e6 + BEAT_MARGIN_S if policy.beat_block_us and policy.mode == "priod" else 0.0
        self.burst_start = -math.inf  # a new policy learns its beat afresh
        self.beat_gaps = ()
        self.beat_until = -math.inf
        self.gate = policy.gate_bulk and policy.mode == "priod"
        self.min_chunk = policy.min_chunk_bytes
        self.budget_rate = min(policy.urgent_budget_bytes_per_s, policy.urgent_budget_share * self.info.bandwidth)
        self.burst = float(policy.urgent_burst_bytes)
        self.min_strict_cost = min(self.params.urgent_chunk_bytes, policy.urgent_burst_bytes)
        self.pending_cap = policy.urgent_inflight_bytes
        for tn in self.tenants.values():
            tn.parked.clear()  # their groups went with the old class queues

    def count(self, tenant: Tenant, path: Path, strict: bool, size: int, n: int) -> None:
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
