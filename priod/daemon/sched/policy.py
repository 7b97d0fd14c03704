"""What the scheduler is told: priority classes, the ``[scheduler]`` settings, and lane figures.

A leaf: config builds a `Policy` from ``[scheduler]`` and ``[classes]``, the scheduler runs
on one, and both check it with `validate_policy`, the one place these values are validated.
Nothing here knows about files, sockets or engines beyond `engines.base.LaneInfo`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

from priod.common.choice import EXPLORE_EVERY
from priod.common.types import LaneInfo
from priod.errors import ConfigError

__all__ = [
    "ALIGN",
    "DEFAULT_CLASSES",
    "ClassSpec",
    "LaneParams",
    "Policy",
    "SchedulerSettings",
    "Tuning",
    "lane_params",
    "validate_policy",
]

ALIGN = 4096
"""Chunks are a multiple of this many bytes."""

MAX_DEPTH = 64

Mode = Literal["priod", "fifo"]


@dataclass(frozen=True)
class ClassSpec:
    """A priority class. ``strict`` classes are served before anything else (``urgent``).

    ``uids`` and ``gids`` say who may use it: both empty, everyone; else a client whose uid is
    in ``uids`` or whose gid is in ``gids`` (uid 0 always may). Others are refused with
    ``permission`` at enqueue.
    """

    name: str
    weight: int = 1
    strict: bool = False
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()

    def allows(self, uid: int | None, gid: int | None, groups: tuple[int, ...] = ()) -> bool:
        """Whether a client may use this class (``uid`` None: unknown, allowed)."""
        if uid is None or uid == 0 or not (self.uids or self.gids):
            return True
        if uid in self.uids or (gid is not None and gid in self.gids):
            return True
        return any(g in self.gids for g in groups)


DEFAULT_CLASSES: tuple[ClassSpec, ...] = (
    ClassSpec("urgent", weight=1, strict=True),
    ClassSpec("high", weight=8),
    ClassSpec("normal", weight=4),
    ClassSpec("bulk", weight=1),
)


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """The scheduler's internal constants: the ``[tuning]`` table, which the shipped config does
    not list. Each default is the measured best on the H200 (docs/design.md, "Defaults and
    why"); an operator has no reason to change them, an experiment may."""

    depth: int = 2
    """Non-strict chunks in flight per lane: chunk size = inflight bytes / depth."""
    min_chunk_bytes: int = 256 * 1024
    urgent_block_us: float = 150.0
    """While urgent copies are recent on a lane: the bound that replaces ``max_block_us`` there
    (smaller chunks, so an urgent DMA copy waits for less bulk). 0: keep ``max_block_us``."""
    urgent_window_ms: float = 100.0
    """How long after its last urgent copy a lane keeps the ``urgent_block_us`` bound."""
    urgent_queue_us: float = 0.0
    """On a lane with a gate, bulk kept handed out under the short bound: as many
    ``urgent_block_us`` chunks as fill this long (at least ``depth``; a tenant may hold them
    all). 0: ``depth`` chunks. More keeps the link fed across the poller's late wake-ups, but
    chunks queued behind the gate still delay an urgent copy: with 1000 bulk kept 0.956-0.972
    of the link against 0.900-0.954, at front-door p50 179-237 us against 82-138 (H100; see
    docs/design.md, Defaults). For a host that wants bulk more than urgent latency."""
    beat_block_us: float = 600.0
    """Within that window, where a lane's urgent copies come on a steady beat (an inference
    step's), the bound between them: bulk runs chunks of this long (half this on a lane
    without a gate) from just after one copy until this long (and a margin) before the next is
    due, and the short bound around the copies (lanes.py, `Lane.urgent_arrived`). 0: the short bound throughout the window.
    600 keeps 0.93-0.97 of the link for bulk where 0 keeps 0.89-0.94, at the same urgent
    latencies (H200, a direct urgent copy every 5 ms; see docs/design.md, Defaults)."""
    beat_spin_us: float = 200.0
    """Where a lane keeps a steady beat (``beat_block_us``), the daemon's loop turns awake from
    this long before the lane's next burst is due, until it comes (or the watch passes,
    `Lane.beat_watch`), instead of sleeping until the copy's doorbell wakes it. 0: sleep."""
    batch_block_us: float = 4000.0
    """The bound that replaces ``max_block_us`` for bulk chunks of batches of small blocks
    (``SMALL_BLOCK_MEAN``, batch.py) while no urgent copy is recent on the lane (0: keep ``max_block_us``). The driver takes about as long to enqueue a
    chunk of 64 KiB blocks as the link takes to move it, so such chunks need more in flight to
    keep the link fed; an urgent DMA copy that comes after a quiet spell may wait that long."""
    gate_bulk: bool = True
    """Each bulk DMA chunk waits on the GPU behind a gate the daemon closes while a client's
    direct urgent copy holds the lane or an urgent DMA chunk of its own is in flight: a chunk
    queued but not begun then waits, so the urgent copy waits for the running chunk only, and a
    chunk may take all of ``max_block_us`` (`lane_params`). Lanes without a gate keep
    ``depth`` chunks within ``max_block_us``."""
    explore_ms: float = 2000.0
    """An urgent path not chosen for a size is tried again after this long (see choice.py)."""
    explore_every: int = EXPLORE_EVERY
    """... and only once this many urgent copies of that size and form (on one lane) have taken
    the other path since the last look: each look costs its copy the slower path's time
    (`priod.common.choice.EXPLORE_EVERY` says why 200). 1: ``explore_ms`` alone."""
    urgent_inflight_bytes: int = 64 << 20
    """Per client and lane: strict bytes admitted and not yet finished (queued or in flight)."""
    direct_hold_max_ms: float = 5.0
    """A client's direct urgent copy (holds.py) holds bulk back on its lane for at most this long."""
    direct_hold_burst_ms: float = 50.0
    """Per client (uid) and lane: held time a client may spend at once; the long-run share of
    time it may hold a lane is ``urgent_budget_share``."""


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    """The ``[scheduler]`` section of the config: what an operator decides (config/priod.toml)."""

    mode: Mode = "priod"
    max_block_us: float = 1000.0
    """How long an urgent DMA copy may wait behind non-strict chunks already in flight."""
    aging_ms: float = 200.0
    """A non-strict request queued this long gets chunks through even while strict work waits."""
    express: bool = True
    urgent_budget_bytes_per_s: float = float(8 << 30)
    """Per client (uid) and lane: the long-run rate of strict-class (urgent) bytes, a token
    bucket. Past its budget a client's urgent copies are served as the highest-weight
    non-strict class (``high``). The rate is the lower of this and ``urgent_budget_share``."""
    urgent_budget_share: float = 0.25
    """The same rate as a share of the lane's bandwidth (what binds on slow lanes)."""
    urgent_burst_bytes: int = 64 << 20
    """The token bucket's depth: urgent bytes a client may send at once after a quiet spell.
    An urgent copy larger than this is always served as ``high``."""
    direct_hold_total_share: float = 0.25
    """Per lane: the share of its time that the holds of clients' direct urgent copies, all uids
    together, may take (each uid alone: ``urgent_budget_share``); past it every client's page
    reads refused on the lane and their urgent copies go through the daemon. Bulk loses more than
    the holds' own time (the stop before each hold and the restart after: 0.1-0.17 of the link
    beside 8 uids taking turns on the 2-vCPU VM), so 0.25, one uid's share, is what keeps it at
    least half the link however many uids take turns (beside 8 uids 0.59-0.61x; 0.3 left it
    0.42-0.48x, 0.5 0.41x)."""

    def with_classes(self, classes: tuple[ClassSpec, ...], tuning: Tuning | None = None) -> Policy:
        """The `Policy` of these settings, ``classes`` (the ``[classes]`` tables) and ``tuning``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerSettings)}
        tuned = tuning or Tuning()
        values.update({f.name: getattr(tuned, f.name) for f in dataclasses.fields(Tuning)})
        return Policy(**values, classes=classes)


@dataclass(frozen=True, kw_only=True)
class Policy(SchedulerSettings, Tuning):
    """Everything the scheduler is told by config: ``[scheduler]``, ``[tuning]`` and ``[classes]``.

    Replaced whole on reload. Check one with `validate_policy` (the scheduler does).
    """

    classes: tuple[ClassSpec, ...] = DEFAULT_CLASSES


def validate_policy(policy: Policy) -> None:
    """Check every ``[scheduler]``, ``[tuning]`` and ``[classes]`` value; the one validator of them.

    Raises:
        ConfigError: the first invalid value, in a message that names the setting and the fix.
    """

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    modes = get_args(Mode)
    need(
        policy.mode in modes,
        f"[scheduler] mode = {policy.mode!r} is invalid; set it to one of {', '.join(repr(m) for m in modes)}",
    )
    need(
        policy.max_block_us > 0,
        f"[scheduler] max_block_us = {policy.max_block_us} is invalid; set it > 0 (microseconds)",
    )
    need(1 <= policy.depth <= MAX_DEPTH, f"[tuning] depth = {policy.depth} is invalid; set 1 <= depth <= {MAX_DEPTH}")
    need(
        policy.min_chunk_bytes >= ALIGN,
        f"[tuning] min_chunk_bytes = {policy.min_chunk_bytes} is invalid; set min_chunk_bytes >= {ALIGN}",
    )
    need(policy.aging_ms > 0, f"[scheduler] aging_ms = {policy.aging_ms} is invalid; set it > 0")
    need(
        policy.batch_block_us >= 0,
        f"[tuning] batch_block_us = {policy.batch_block_us} is invalid; set it >= 0 (0: keep max_block_us)",
    )
    need(
        policy.urgent_block_us >= 0,
        f"[tuning] urgent_block_us = {policy.urgent_block_us} is invalid; set it >= 0 (0: keep max_block_us)",
    )
    need(policy.beat_block_us >= 0, f"[tuning] beat_block_us = {policy.beat_block_us} is invalid; set it >= 0 (0: off)")
    need(
        0 <= policy.beat_spin_us <= 5000,
        f"[tuning] beat_spin_us = {policy.beat_spin_us} is invalid; set 0 <= beat_spin_us <= 5000 (0: off)",
    )
    need(
        0 <= policy.urgent_queue_us < math.inf,
        f"[tuning] urgent_queue_us = {policy.urgent_queue_us} is invalid; set a finite number >= 0 (0: depth chunks)",
    )
    need(policy.urgent_window_ms >= 0, f"[tuning] urgent_window_ms = {policy.urgent_window_ms} is invalid; set it >= 0")
    for name in ("direct_hold_max_ms", "direct_hold_burst_ms"):
        value = getattr(policy, name)
        need(
            0 <= value < math.inf,
            f"[tuning] {name} = {value} is invalid; set a finite number of milliseconds >= 0 (0: direct copies hold nothing)",
        )
    need(policy.explore_ms > 0, f"[tuning] explore_ms = {policy.explore_ms} is invalid; set it > 0")
    need(
        policy.explore_every >= 1,
        f"[tuning] explore_every = {policy.explore_every} is invalid; set a whole number >= 1 (1: explore_ms alone)",
    )
    rate = policy.urgent_budget_bytes_per_s
    need(
        0 < rate < math.inf,
        f"[scheduler] urgent_budget_bytes_per_s = {rate} is invalid; set a finite number of bytes per second > 0",
    )
    share = policy.urgent_budget_share
    need(
        0 < share <= 1,
        f"[scheduler] urgent_budget_share = {share} is invalid; set 0 < urgent_budget_share <= 1 (of a lane's bandwidth)",
    )
    total = policy.direct_hold_total_share
    need(
        0 < total <= 1,
        f"[scheduler] direct_hold_total_share = {total} is invalid; set 0 < direct_hold_total_share <= 1 (of a lane's time)",
    )
    need(
        policy.urgent_burst_bytes >= ALIGN,
        f"[scheduler] urgent_burst_bytes = {policy.urgent_burst_bytes} is invalid; set urgent_burst_bytes >= {ALIGN}",
    )
    need(
        policy.urgent_inflight_bytes >= ALIGN,
        f"[tuning] urgent_inflight_bytes = {policy.urgent_inflight_bytes} is invalid; set urgent_inflight_bytes >= {ALIGN}",
    )

    classes = policy.classes
    need(bool(classes), "[classes] is empty; define at least one class, like [classes.bulk] weight = 1")
    names = [c.name for c in classes]
    dups = sorted({n for n in names if names.count(n) > 1})
    need(
        not dups,
        f"class names must be unique, got {', '.join(names)}; rename or remove the duplicate {', '.join(f'[classes.{n}]' for n in dups)}",
    )
    for c in classes:
        need(c.weight >= 1, f"[classes.{c.name}] weight = {c.weight} is invalid; set weight >= 1")
        for key, ids in (("uids", c.uids), ("gids", c.gids)):
            bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
            need(
                not bad,
                f"[classes.{c.name}] {key} = {list(ids)} is invalid; list whole numbers >= 0, or leave it empty for everyone",
            )
    need(not all(c.strict for c in classes), "[classes] needs at least one class without strict = true, for bulk work")


@dataclass(frozen=True)
class LaneParams:
    """Chunking figures for one lane, derived from its bandwidth and the policy."""

    chunk_bytes: int
    inflight_bytes: int
    express_min: int
    express_max: int
    """0: no express path on this lane (or express turned off)."""
    urgent_chunk_bytes: int = 0
    """Chunk size while urgent copies are recent (``urgent_block_us``); 0: ``chunk_bytes``."""
    urgent_inflight_bytes: int = 0
    batch_chunk_bytes: int = 0
    """Chunk size of bulk batches while no urgent copy is recent (``batch_block_us``); 0: ``chunk_bytes``."""
    batch_inflight_bytes: int = 0
    beat_chunk_bytes: int = 0
    """Chunk size between the urgent copies of a steady beat (``beat_block_us``); 0: off."""
    beat_inflight_bytes: int = 0


def gated_bulk(info: LaneInfo, policy: Policy) -> bool:
    """Whether the lane's bulk DMA chunks are handed out gated (`Chunk.gated`): ``gate_bulk``
    on, the priod scheduler, and an engine that has a gate for the lane."""
    return policy.gate_bulk and policy.mode == "priod" and info.gate


def lane_params(info: LaneInfo, policy: Policy) -> LaneParams:
    """Derive chunk size and in-flight bound from ``max_block_us`` (and ``urgent_block_us``)
    and the lane's bandwidth.

    ``inflight = bandwidth * max_block_us`` (at least ``depth`` minimum chunks), split into
    ``depth`` chunks, each a multiple of 4 KiB. On a lane with a gate (`gated_bulk`) a bulk
    chunk that has not begun waits at the gate while an urgent copy goes, so an urgent copy
    waits for the running chunk only: there each chunk takes ``max_block_us`` and ``depth`` of
    them are in flight, half the chunks (and the daemon's polls) for the same promise.
    """

    def chunk_for(block_us: float) -> int:
        inflight = int(info.bandwidth * block_us / 1e6)
        return max(ALIGN, max(policy.min_chunk_bytes, inflight // policy.depth) // ALIGN * ALIGN)

    whole = policy.depth if gated_bulk(info, policy) else 1
    chunk = chunk_for(policy.max_block_us * whole)
    short = chunk_for(min(policy.urgent_block_us, policy.max_block_us)) if policy.urgent_block_us else chunk
    batch = chunk_for(policy.batch_block_us) if policy.batch_block_us else chunk
    # Between the bursts of a beat as outside the window: the lane is back on its short bound
    # beat_block_us and a margin before the next burst is due (lanes.py, BEAT_MARGIN_S). The
    # short bound itself keeps depth chunks: a direct copy waits for the running one, and
    # longer ones cost its p50 (urgent_block_us, docs/design.md).
    beat = chunk_for(policy.beat_block_us * whole) if policy.beat_block_us else 0
    short_depth = policy.depth
    if whole > 1 and policy.urgent_queue_us:
        short_depth = max(short_depth, math.ceil(info.bandwidth * policy.urgent_queue_us / 1e6 / short))
    express_max = info.express_max if policy.express else 0
    return LaneParams(
        chunk,
        chunk * policy.depth,
        info.express_min,
        express_max,
        short,
        short * short_depth,
        batch,
        batch * policy.depth,
        beat,
        beat * policy.depth,
    )
