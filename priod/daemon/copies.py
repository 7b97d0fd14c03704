"""A copy from the time it comes in until it is answered: its intake, payload, limits and reply.

The session (session.py) hands a decoded copy to `take_copy` (a batch to `take_batch`), which
checks its regions, bounds, limits and events and queues a `PendingCopy` with the scheduler; the
pump reports the end through `copy_finished`, and the session answers with `outcome_reply`.
Pure logic apart from the session whose counters it updates and which it calls back. That
session is named by what this module uses of it (`CopySession`, `CopyParts`): session.py
imports this module, not the other way round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from priod.common.types import LaneKey, Path
from priod.daemon.config import Config, LimitsConfig
from priod.daemon.engines.base import IpcEvent, Memory
from priod.daemon.gates import EventTable
from priod.daemon.log import error_fields
from priod.daemon.pump import Pump
from priod.daemon.regions import Holdings, Region, RegionTable, UidHoldings
from priod.daemon.rings import CopyRing, LandedWord
from priod.daemon.sched.scheduler import Finished, Scheduler
from priod.daemon.sched.scheduler import Request as QueuedCopy
from priod.errors import InvalidRequest, LimitExceeded, ShuttingDown
from priod.wire.batch import Segments
from priod.wire.messages import Copy, CopyBatch
from priod.wire.replies import CopyBatchReply, CopyReply, ErrorReply
from priod.wire.transport import Peer

__all__ = [
    "PendingCopy",
    "cancel_copy",
    "check_copy_bounds",
    "check_limits",
    "complete_on_ring",
    "copy_finished",
    "copy_log_fields",
    "count_pending",
    "outcome_reply",
    "signal_recorded",
    "take_batch",
    "take_copy",
]

_US = 1e6
_EXPRESS = Path.EXPRESS
"""A module global: ``Path.EXPRESS`` costs ~55 ns more on Python 3.11 (EnumType's __getattr__
takes enum classes off the fast attribute path), and the reply reads it per copy."""


def _reply_us(seconds: float) -> float:
    """Seconds as microseconds to the nanosecond, for a reply: ``round(seconds * 1e6, 3)``,
    computed as whole nanoseconds (``round`` to digits is ~0.16 us, three times per copy).
    `outcome_reply` writes it out for a finished copy's three timings (see there)."""
    return round(seconds * 1e9) / 1e3


_CANCEL_WHY = {
    "cancelled": "copy cancelled",
    "shutting_down": "the daemon is stopping and cancelled this copy; retry once it is back",
    "not_found": "a region this copy names was freed by its owner",
}


class Counts(Protocol):
    """What a connection has pending, for its limits (a `Session`)."""

    @property
    def pending(self) -> dict[int, QueuedCopy]: ...

    queued_bytes: int
    queued_segments: int


class CopyParts(Protocol):
    """What this module uses of the daemon's parts that every session reaches (a `session.Shared`)."""

    @property
    def cfg(self) -> Config: ...
    @property
    def regions(self) -> RegionTable: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def pump(self) -> Pump: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def request_ids(self) -> Iterator[int]: ...


class CopySession(Counts, Protocol):
    """What this module uses of the connection a copy came on (a `session.Session`), beside its `Counts`."""

    @property
    def id(self) -> int: ...
    @property
    def peer(self) -> Peer: ...
    @property
    def shared(self) -> CopyParts: ...
    @property
    def holdings(self) -> Holdings: ...
    @property
    def events(self) -> EventTable: ...

    def copy_finished(self, f: Finished, p: PendingCopy) -> None: ...

    def signal_recorded(self, p: PendingCopy, error: Exception | None) -> None: ...


@dataclass(eq=False, slots=True)
class PendingCopy:
    """A queued copy's payload: where its bytes go, and whom to answer."""

    session: CopySession
    client_id: int
    dst: Region
    dst_offset: int
    src: Region
    src_offset: int
    cancel_code: str = "cancelled"
    segments: Segments | None = None
    """A batch's segment table (offsets relative to the regions); None for a single copy."""
    wait_event: IpcEvent | None = None
    """The client's event the copy was held for (gates.py), if it named one."""
    signal_event: IpcEvent | None = None
    """The client's event the pump records behind the copy's last chunk, if it named one."""
    signal_error: Exception | None = None
    """Why the signal_event could not be recorded: the copy's reply then says so."""
    by_ring: bool = False
    """It came as a ring descriptor: once done, its completion goes back on the ring."""
    landed: LandedWord | None = None
    """Its descriptor asked for its landed word, stored behind its last chunk (pump.py)."""

    @property
    def dst_mem(self) -> Memory:
        return self.dst.mem

    @property
    def src_mem(self) -> Memory:
        return self.src.mem


def take_copy(
    session: CopySession, req_id: int, req: Copy, by_ring: bool = False, landed: LandedWord | None = None
) -> None:
    """Check a copy (regions, bounds, limits, events) and queue it; its reply comes when it ends
    (`copy_finished`). Raises a RequestError naming the fix, and then nothing is queued.
    ``by_ring``: it came on the connection's copy ring (rings.py), where its completion goes;
    ``landed``: its descriptor asked for its landed word."""
    now = time.perf_counter()
    dst, src = _copy_regions(session, req_id, req.dst, req.src)
    nbytes = req.nbytes
    regions = session.shared.regions
    lane = regions.lane_between(dst, src)
    check_copy_bounds(regions, dst, req.dst_offset, src, req.src_offset, nbytes)
    check_limits(session.shared.cfg.limits, session, session.holdings.tally, nbytes, 0)
    payload = PendingCopy(session, req_id, dst, req.dst_offset, src, req.src_offset, by_ring=by_ring, landed=landed)
    if req.wait_event is not None or req.signal_event is not None:
        _open_events(session, payload, lane.device, req.wait_event, req.signal_event)
    _enqueue(session, req_id, now, payload, lane, req.priority, req.deadline_ms, nbytes)


def take_batch(
    session: CopySession, req_id: int, req: CopyBatch, by_ring: bool = False, landed: LandedWord | None = None
) -> None:
    """A batch: checked as a unit (every segment, or none, is queued), then one request.
    ``by_ring``, ``landed``: as `take_copy`'s."""
    now = time.perf_counter()
    dst, src = _copy_regions(session, req_id, req.dst, req.src)
    segments = Segments.decode(req.segments)
    regions = session.shared.regions
    lane = regions.lane_between(dst, src)
    check_limits(session.shared.cfg.limits, session, session.holdings.tally, segments.total, len(segments))
    segments.check_regions(dst.nbytes, src.nbytes, regions.memory_shift(dst, src), dst.id, src.id)
    payload = PendingCopy(session, req_id, dst, 0, src, 0, segments=segments, by_ring=by_ring, landed=landed)
    if req.wait_event is not None or req.signal_event is not None:
        _open_events(session, payload, lane.device, req.wait_event, req.signal_event)
    _enqueue(session, req_id, now, payload, lane, req.priority, req.deadline_ms, segments.total)


def _open_events(
    session: CopySession, payload: PendingCopy, device: int, wait: bytes | None, signal: bytes | None
) -> None:
    """Open the events a copy names (once per connection), on its lane's GPU: an IPC event
    can be used on its own GPU only. A handle that does not open refuses the copy."""
    regions, holdings = session.shared.regions, session.holdings

    def region(region_id: int) -> Memory:  # a sim event names a byte of a region the client may use
        return regions.usable(holdings, region_id).mem

    def opened(name: str, handle: bytes) -> IpcEvent:
        try:
            return session.events.open(handle, device, region)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{name}: {exc}") from exc

    if wait is not None:
        payload.wait_event = opened("wait_event", wait)
    if signal is not None:
        payload.signal_event = opened("signal_event", signal)


def _copy_regions(session: CopySession, req_id: int, dst_id: int, src_id: int) -> tuple[Region, Region]:
    """The two regions a copy names, once it may be taken at all."""
    if session.shared.stopping:
        raise ShuttingDown("the daemon is stopping and takes no new copies; retry once it is back")
    if req_id in session.pending:
        raise InvalidRequest(f"request id {req_id} is already pending on this connection; use a new id per request")
    regions = session.shared.regions
    return regions.usable(session.holdings, dst_id), regions.usable(session.holdings, src_id)


def _enqueue(
    session: CopySession,
    req_id: int,
    now: float,
    payload: PendingCopy,
    lane: LaneKey,
    priority: str,
    deadline_ms: float | None,
    nbytes: int,
) -> None:
    shared = session.shared
    deadline = now + deadline_ms / 1e3 if deadline_ms is not None else None
    segments = payload.segments
    peer = session.peer
    queued = QueuedCopy(
        id=next(shared.request_ids),
        owner=session.id,
        lane=lane,
        cls=priority,
        nbytes=nbytes,
        arrival=now,
        deadline=deadline,
        payload=payload,
        uid=peer.uid,
        gid=peer.gid,
        segments=segments,
    )
    held = payload.wait_event
    if held is None:
        shared.scheduler.enqueue(queued, now)  # raises InvalidRequest for an unknown class
    else:
        shared.scheduler.check(queued)  # the same refusals now; queued once its event completes
    session.pending[req_id] = queued
    count_pending(session, nbytes, segments, +1)
    payload.dst.users.add(queued.id)
    payload.src.users.add(queued.id)
    if held is None:
        shared.pump.kick()
    else:
        shared.pump.hold(queued, held, now)


def count_pending(session: CopySession, nbytes: int, segments: Segments | None, sign: int) -> None:
    """Count a copy into (``sign`` +1) or out of (-1) what its connection and its uid have
    pending, the figures `check_limits` holds against the limits: one place, so the two stay
    in step."""
    tally = session.holdings.tally
    session.queued_bytes += sign * nbytes
    tally.queued_requests += sign
    tally.queued_bytes += sign * nbytes
    if segments is not None:
        session.queued_segments += sign * len(segments)
        tally.queued_segments += sign * len(segments)


def copy_finished(f: Finished) -> None:
    """The pump's report that a copy ended: its session answers."""
    payload = f.request.payload
    assert isinstance(payload, PendingCopy)
    payload.session.copy_finished(f, payload)


def signal_recorded(req: QueuedCopy, error: Exception | None) -> None:
    """The pump's report that a copy's signal_event was recorded (or why not): its session
    tells the client, who may now make a stream wait on the event."""
    payload = req.payload
    assert isinstance(payload, PendingCopy)
    payload.session.signal_recorded(payload, error)


def cancel_copy(pump: Pump, req: QueuedCopy, code: str) -> bool:
    """Cancel ``req`` at its next chunk boundary, answering with ``code``; True if it ended at once."""
    payload = req.payload
    assert isinstance(payload, PendingCopy)
    payload.cancel_code = code
    return pump.cancel(req.id)


def check_limits(lim: LimitsConfig, conn: Counts, tally: UidHoldings, nbytes: int, segments: int) -> None:
    """Refuse (LimitExceeded) a copy of ``nbytes`` (``segments`` for a batch) past a limit of
    its connection (``conn``) or of its uid (``tally``)."""
    if len(conn.pending) >= lim.max_queued_requests:
        raise LimitExceeded(
            f"this connection has {len(conn.pending)} copies pending ([limits] max_queued_requests = {lim.max_queued_requests}); "
            "wait for replies before sending more"
        )
    if conn.queued_bytes + nbytes > lim.max_queued_bytes:
        raise LimitExceeded(
            f"{nbytes} more bytes would exceed [limits] max_queued_bytes = {lim.max_queued_bytes} pending on this connection; "
            "wait for replies before sending more"
        )
    if tally.queued_requests >= lim.max_queued_requests_per_uid:
        raise LimitExceeded(
            f"uid {tally.uid} has {tally.queued_requests} copies pending over its connections "
            f"([limits] max_queued_requests_per_uid = {lim.max_queued_requests_per_uid}); wait for replies before sending more"
        )
    if tally.queued_bytes + nbytes > lim.max_queued_bytes_per_uid:
        raise LimitExceeded(
            f"{nbytes} more bytes would exceed [limits] max_queued_bytes_per_uid = {lim.max_queued_bytes_per_uid} pending over "
            f"uid {tally.uid}'s connections; wait for replies before sending more"
        )
    if segments and conn.queued_segments + segments > lim.max_queued_segments:
        raise LimitExceeded(
            f"{segments} more segments would exceed [limits] max_queued_segments = {lim.max_queued_segments} pending on this "
            "connection; wait for replies before sending more"
        )
    if segments and tally.queued_segments + segments > lim.max_queued_segments_per_uid:
        raise LimitExceeded(
            f"{segments} more segments would exceed [limits] max_queued_segments_per_uid = {lim.max_queued_segments_per_uid} "
            f"pending over uid {tally.uid}'s connections; wait for replies before sending more"
        )


def outcome_reply(
    f: Finished, p: PendingCopy, queued_s: float, transfer_s: float, total_s: float
) -> CopyReply | CopyBatchReply | ErrorReply:
    """The reply that ends a copy: its timings when done, else why not and how far it got
    (for a batch, in whole segments too)."""
    req = f.request
    segments = p.segments
    if f.outcome == "done" and p.signal_error is None:
        path = (
            "express" if req.path is _EXPRESS else "dma"
        )  # not ``req.path.value``: an enum's value is a slow property
        # `_reply_us` written out: three calls cost ~0.5 us of the loop, before the reply goes.
        queued_us, transfer_us, total_us = (
            round(queued_s * 1e9) / 1e3,
            round(transfer_s * 1e9) / 1e3,
            round(total_s * 1e9) / 1e3,
        )
        waited = _reply_us(req.held_s) if p.wait_event is not None else None
        if segments is not None:
            return CopyBatchReply(
                req.nbytes, len(segments), queued_us, transfer_us, total_us, path, f.missed_deadline, waited
            )
        return CopyReply(req.nbytes, queued_us, transfer_us, total_us, path, f.missed_deadline, waited)
    progress = f"after {f.bytes_done} of {req.nbytes} bytes"
    done = None
    if segments is not None:
        done = segments.segments_done(f.bytes_done)
        progress += f" ({done} of {len(segments)} segments whole)"
    if f.outcome == "done":
        # The bytes landed, but the client's stream has nothing to wait on: an error, so a
        # client that waits for the event never takes stale ordering for a guarantee.
        return ErrorReply(
            "engine",
            f"the copy landed ({progress}) but its signal_event could not be recorded: {p.signal_error}",
            f.bytes_done,
            done,
        )
    if f.outcome == "failed":
        return ErrorReply("engine", f"copy failed {progress}: {f.error}", f.bytes_done, done)
    if f.error is not None:  # cancelled by the daemon for a reason of its own (gates.py: a wait_event's limit)
        return ErrorReply(p.cancel_code, f"copy cancelled {progress}: {f.error}", f.bytes_done, done)
    return ErrorReply(p.cancel_code, f"{_CANCEL_WHY[p.cancel_code]} {progress}", f.bytes_done, done)


def complete_on_ring(
    ring: CopyRing, f: Finished, p: PendingCopy, queued_s: float, transfer_s: float, total_s: float
) -> bool:
    """Write a copy that is done (as `outcome_reply`'s first case) to its connection's ring;
    False if the ring has no room (then the reply goes on the socket)."""
    req = f.request
    if ring.closed or not ring.completions.try_complete(
        p.client_id,
        req.nbytes,
        round(queued_s * 1e9) / 1e3,
        round(transfer_s * 1e9) / 1e3,
        round(total_s * 1e9) / 1e3,
        "express" if req.path is _EXPRESS else "dma",
        f.missed_deadline,
        len(p.segments) if p.segments is not None else 0,
    ):
        return False
    ring.completed_one()
    return True


def check_copy_bounds(
    regions: RegionTable, dst: Region, dst_offset: int, src: Region, src_offset: int, nbytes: int
) -> None:
    """Refuse (InvalidRequest, naming the fix) a single copy outside its regions, or whose source
    and destination overlap in memory: within one region, or between two regions over the same
    pages (`RegionTable.memory_shift`: one memfd registered twice, two imports of one device
    allocation). A copy engine does not copy overlapping ranges as memmove does: it moves chunks
    in no set direction (DMA, and the daemon's own chunking), so the result would be neither the
    source's old bytes nor an error; refusing is what keeps every copy's outcome defined."""
    if (
        dst_offset + nbytes <= dst.nbytes
        and src_offset + nbytes <= src.nbytes
        and dst.kind != src.kind
        and (dst.file is None or dst.file != src.file)
    ):
        return  # the usual copy (host <-> device, not one memfd) in one test: it runs once per copy on the loop
    for name, region, offset in (("dst", dst, dst_offset), ("src", src, src_offset)):
        if offset + nbytes > region.nbytes:
            raise InvalidRequest(
                f"{name}_offset {offset} + nbytes {nbytes} is outside region {region.id} of {region.nbytes} bytes; "
                "copy within the region's size"
            )
    if regions.overlapping(dst, dst_offset, src, src_offset, nbytes):
        same = (
            ""
            if dst is src
            else f" (regions {src.id} and {dst.id} are views of the same memory: one memfd or one device allocation)"
        )
        raise InvalidRequest(
            f"source bytes {src_offset}..{src_offset + nbytes} of region {src.id} overlap destination bytes "
            f"{dst_offset}..{dst_offset + nbytes} of region {dst.id}{same}; a copy engine does not copy overlapping ranges "
            "as memmove does: copy through another region, or in pieces that do not overlap"
        )


def copy_log_fields(
    f: Finished, p: PendingCopy, outcome: str, gpu: str, queued_s: float, total_s: float
) -> dict[str, Any]:
    """The per-copy log line's fields (built only when the line is written: debug, or a failure)."""
    req = f.request
    return {
        "id": p.client_id,
        "priority": req.cls,
        "lane": str(req.lane),
        "gpu": gpu,
        "path": req.path.value if req.path else None,
        "nbytes": req.nbytes,
        "bytes_done": f.bytes_done,
        **({"segments": len(p.segments)} if p.segments is not None else {}),
        "outcome": outcome,
        "queued_us": round(queued_s * _US, 1),
        "total_us": round(total_s * _US, 1),
        **(error_fields(f.error) if f.error else {}),
    }
