"""The records that go in and out of the scheduler: requests, chunks, outcomes, statistics. No logic.

`priod.daemon.sched.scheduler` re-exports every name here as its public face, and callers import them from
there. They live apart so that the scheduler's machinery (queues.py, dispatch.py) can name a
`Request` or a `Chunk` without importing the `Scheduler` that drives it, and so that
scheduler.py holds the books and nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

from priod.common.types import LaneKey, Path
from priod.daemon.sched.policy import ClassSpec
from priod.wire.batch import Segments

__all__ = ["Chunk", "Finished", "LaneStats", "Request", "RequestState", "SchedulerStats"]


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
    segments: Segments | None = None
    """A batch's segment table: its chunks are cut so that their bytes plus a cost per segment
    fit the size a contiguous chunk would get (batch.py); None for a contiguous copy."""
    held_s: float = 0.0
    """Seconds it waited, before it was queued here, for a client's event (pump.py's gates);
    ``arrival`` is then when it was queued, so that waiting earns it no aging."""
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


# Chunk and Finished are frozen, and one of each is made per copy on the daemon's loop: their
# __init__ fills the instance dict at once, where the generated one of a frozen dataclass calls
# object.__setattr__ per field (0.56 -> 0.24 us each). Setting a field afterwards still raises.


@dataclass(frozen=True, eq=False, init=False)
class Chunk:
    """A piece of a request for the caller to submit: bytes [offset, offset+nbytes)."""

    request: Request
    offset: int
    nbytes: int
    path: Path
    strict: bool
    gated: bool
    """A bulk DMA chunk handed out under the lane's short bound: the engine makes it wait behind
    the lane's gate, which the daemon closes while a client's direct copy holds the lane."""

    def __init__(
        self, request: Request, offset: int, nbytes: int, path: Path, strict: bool, gated: bool = False
    ) -> None:
        d = self.__dict__
        d["request"], d["offset"], d["nbytes"], d["path"], d["strict"], d["gated"] = (
            request,
            offset,
            nbytes,
            path,
            strict,
            gated,
        )


@dataclass(frozen=True, init=False)
class Finished:
    """A request that reached its end; the caller replies to the client with it."""

    request: Request
    outcome: Literal["done", "cancelled", "failed"]
    bytes_done: int
    missed_deadline: bool = False
    error: Exception | None = None

    def __init__(
        self,
        request: Request,
        outcome: Literal["done", "cancelled", "failed"],
        bytes_done: int,
        missed_deadline: bool = False,
        error: Exception | None = None,
    ) -> None:
        d = self.__dict__
        d["request"], d["outcome"], d["bytes_done"], d["missed_deadline"], d["error"] = (
            request,
            outcome,
            bytes_done,
            missed_deadline,
            error,
        )


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
    batch_chunk_bytes: int = 0
    batch_inflight_bound: int = 0
    """The bound for bulk batch chunks while no urgent copy is recent (``batch_block_us``)."""
    beat_chunk_bytes: int = 0
    beat_inflight_bound: int = 0
    """The bound between the bursts of a steady urgent beat (``beat_block_us``; 0: off)."""
    beat_us: float | None = None
    """The lane's urgent beat as it uses it (the shortest recent gap between bursts), None
    while it knows none."""
    tenants: int = 0
    """Clients (uids, or connections where unknown) the lane keeps state for."""
    urgent_budget_bytes_per_s: float = 0.0
    """Each tenant's strict budget on this lane: the lower of the two settings."""
    device: int = 0
    """The lane's GPU by the daemon's ordinal; `Engine.device_uuid` gives its UUID (the ``gpu`` label)."""
    peer: int | None = None
    """A peer lane's destination GPU (the daemon's ordinal); None for other lanes."""
    host_scale: float = 1.0
    """A host lane's share of its rate now, where the host's memory bandwidth binds (1.0: not)."""


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
