"""A session: one client connection, from its first frame to its last reply.

    frame -> messages.decode_request -> handler -> reply frame
    copy  -> copies.take_copy: checks (regions, bounds, limits) -> scheduler.enqueue -> pump.kick
    copy_batch -> copies.take_batch: the same, its segment table checked as a unit (batch.py)
          ... pump -> `Session.copy_finished` -> reply frame, metrics, log line

Requests are handled in arrival order, without awaiting, except region set-up (pinning takes
milliseconds per GiB, so it runs on a worker thread while other sessions go on). Nothing a
client sends can stop the daemon or touch another client's memory: every request is checked
against the regions this session may use, every failure is answered with an error reply, and a
session that breaks the protocol is closed alone.

A refused request (an error reply sent at once, `Session._refuse`: every code the metric
``priod_refused_requests_total`` counts) is counted for `priod status` (its connection's
`Refused`, the daemon's `Refusals`) and logged once as ``request_refused`` at info, within a
budget of lines per connection and for the daemon (`LineBudget`); what the budget holds back is
counted and summed up in a ``request_refusals_suppressed`` line (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import re
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from priod._version import __version__
from priod.common.types import Direction
from priod.daemon.config import Config
from priod.daemon.copies import (
    PendingCopy,
    cancel_copy,
    complete_on_ring,
    copy_finished,
    copy_log_fields,
    count_pending,
    outcome_reply,
    take_batch,
    take_copy,
)
from priod.daemon.engines.base import Engine
from priod.daemon.gates import EventTable
from priod.daemon.log import LineBudget, error_fields
from priod.daemon.metrics import Metrics
from priod.daemon.pump import Pump
from priod.daemon.rate import LoopAccount, LoopShare
from priod.daemon.region_requests import RegionRequests
from priod.daemon.regions import Holdings, RegionTable
from priod.daemon.rings import CopyRing, LandedWord
from priod.daemon.sched.scheduler import Finished, Scheduler
from priod.daemon.sched.scheduler import Request as QueuedCopy
from priod.errors import ConnectionClosed, InvalidRequest, NotFound, PriodError, ProtocolError, RequestError
from priod.wire.batch import MAX_SEGMENTS, SEGMENT_BYTES
from priod.wire.messages import (
    PROTOCOL_VERSION,
    AllocDevice,
    AllocHost,
    Cancel,
    Copy,
    CopyBatch,
    Free,
    Hello,
    Message,
    OpenHoldPage,
    OpenRing,
    Ping,
    RegisterDevice,
    RegisterHost,
    Share,
    StatusRequest,
    decode_request,
    request_id,
)
from priod.wire.replies import (
    PROGRESS_SIGNAL_RECORDED,
    CancelReply,
    Empty,
    ErrorReply,
    HelloReply,
    HoldPageReply,
    RingReply,
    StatusReply,
    progress_frame,
)
from priod.wire.ring import RING_ENTRIES, RING_VERSION, RingCorrupt, ring_supported
from priod.wire.transport import FramedSocket, Peer, close_received

# PendingCopy and copy_finished are copies.py's, for the server.
__all__ = ["PendingCopy", "Refusals", "Refused", "Session", "Shared", "copy_finished", "limit_name"]

log = structlog.get_logger("priod.daemon.session")

REQUESTS_PER_TURN = 64
"""Requests of one connection handled in one loop turn; the rest wait a turn, so a client
that sends thousands at once cannot hold the loop from the others."""
STATUS_TOKENS = 3
"""Request tokens (a copy's cost: ~25 us of daemon CPU for a pipelined 1-byte sim copy, 5 for a
ping) a `status` is charged, plus one per `STATUS_CONNECTIONS_PER_TOKEN` connections served:
measured 70 us with 1 connection, 110 with 33, 170 with 97 (2-vCPU VM, sim, 2026-12-06)."""
STATUS_CONNECTIONS_PER_TOKEN = 24
"""See `STATUS_TOKENS`: ~1 us of a status per connection listed, 24 of them a copy's 25 us."""
BATCH_SEGMENTS_PER_TOKEN = 40
"""A copy_batch of N segments is charged 1 + ceil(N / this) tokens, before its table is checked
(a refused batch too): taken and run, 48 us at 16 segments, 192 at 256, 2.5 ms at 4,096,
19.5 ms at 32,768, ~0.6 us a segment, 40 of them a copy's 25 us (2-vCPU VM, sim, 2026-12-06).
A table refused after its whole check costs ~0.06 us a segment: charged the same, by size."""
BATCH_RUN_S_PER_SEGMENT = 0.5e-6
"""Loop seconds a uid is charged, beyond its turn's measured time (`LoopShare`), for each batch
segment its turn queued: running a batch costs the loop later, in the pump, where no turn times
it: taken and run ~0.6 us a segment, of which the turn that checks and queues the table takes
~0.05 (1.7 ms of 19.5 at 32,768; 2-vCPU VM, sim, 2026-12-05)."""
SEGMENTS_PER_TURN = MAX_SEGMENTS
"""Batch segments one connection's requests may bring in one loop turn: checking a table costs
O(N log N) of the loop (a few milliseconds for the largest), so a client sending batch after
batch ends its turn after one of the largest and other clients are served between."""

REFUSAL_LINES_BURST = 10
REFUSAL_LINES_PER_S = 1.0
"""``request_refused`` lines of one connection: 10 at once, then one a second. A client that is
refused is nearly always refused over and over for one reason (a loop that does not wait for
replies, a limit set too low): the first lines say who and why, `priod status` counts the rest,
and a client refused now and then (the usual case) has every refusal logged."""
DAEMON_REFUSAL_LINES_BURST = 1000
DAEMON_REFUSAL_LINES_PER_S = 100.0
"""``request_refused`` lines of all connections together: a backstop for a flood over many
connections. One uid's 64 connections (``[limits] max_connections_per_uid``) take at most 640
of the burst, so other clients' first refusals are still logged; at most 1000 + 30 * 100 = 4000
lines in journald's default 30 s window (RateLimitIntervalSec=30s, RateLimitBurst=10000), so
journald never drops the daemon's other lines for them."""
SUPPRESSED_SUMMARY_S = 10.0
"""A connection's refusals the budget held back are summed up in one
``request_refusals_suppressed`` line this long after the first of them (and when it closes)."""
CLOSED_REFUSED_KEPT = 64
"""Closed connections that had refusals, kept for `priod status` (a client that is refused, then
reconnects, and so on, stays visible)."""
REASON_CHARS = 400
"""A refusal's message in its log line, cut to this (it may quote what the client sent)."""

_SETTING = re.compile(r"\[(?:limits|server)\] (\w{1,64})")
_UNNAMED_LIMITS = (("IPC events open", "max_events_per_connection"),)
"""Limits whose message names no setting: a text of the message, and the name it stands for
(gates.py, MAX_EVENTS_PER_CONNECTION)."""


def limit_name(exc: PriodError) -> str | None:
    """The limit a refusal of code ``limit`` hit, named as its setting (``max_regions``,
    ``max_queued_requests_per_uid``, ``max_clients``...), else None.

    LimitExceeded carries no field for it: its message names the setting (``[limits] NAME`` or
    ``[server] NAME``, as regions.py, copies.py and admission.py write them), the few that do not
    are matched by `_UNNAMED_LIMITS`, and anything else is ``unnamed``. An exception with a
    ``limit`` attribute (a str) is taken at its word.
    """
    if exc.code != "limit":
        return None
    named = getattr(exc, "limit", None)
    if isinstance(named, str) and named:
        return named[:64]
    text = str(exc)
    m = _SETTING.search(text)
    if m is not None:
        return m.group(1)
    for part, name in _UNNAMED_LIMITS:
        if part in text:
            return name
    return "unnamed"


def _add(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


@dataclass(eq=False, slots=True)
class Refused:
    """One connection's refused requests: how many, by code and by limit, and the latest."""

    conn: int
    pid: int
    uid: int
    name: str = ""
    """The name its hello gave (empty before it)."""
    total: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    by_limit: dict[str, int] = field(default_factory=dict)
    last: dict[str, Any] | None = None
    """The latest: op, id, code, limit, error."""
    last_at: float = 0.0
    """When, in `time.monotonic`."""
    open: bool = True

    def figures(self, now: float) -> dict[str, Any]:
        """This connection's entry under ``refusals.clients`` in `priod status`."""
        last = None if self.last is None else {**self.last, "ago_s": round(now - self.last_at, 3)}
        return {
            "conn": self.conn,
            "pid": self.pid,
            "uid": self.uid,
            "name": self.name,
            "open": self.open,
            "refused": self.total,
            "by_code": dict(sorted(self.by_code.items())),
            "by_limit": dict(sorted(self.by_limit.items())),
            "last": last,
        }


@dataclass(eq=False)
class Refusals:
    """The daemon's book of refusals, for `priod status` (report.py, through `Admission.refusals`):
    requests refused (by code, by limit, by uid, and the connections closed lately that had any),
    connections refused at connect (admission.py), and the ``request_refused`` lines' budget."""

    by_code: dict[str, int] = field(default_factory=dict)
    by_limit: dict[str, int] = field(default_factory=dict)
    by_uid: dict[int, int] = field(default_factory=dict)
    closed: deque[Refused] = field(default_factory=lambda: deque(maxlen=CLOSED_REFUSED_KEPT))
    lines: LineBudget = field(
        default_factory=lambda: LineBudget(DAEMON_REFUSAL_LINES_PER_S, DAEMON_REFUSAL_LINES_BURST, time.monotonic())
    )
    logged: int = 0
    """``request_refused`` lines written."""
    suppressed: int = 0
    """Refusals the budget kept out of the log (summed up in ``request_refusals_suppressed``)."""
    connect_by_code: dict[str, int] = field(default_factory=dict)
    connect_by_limit: dict[str, int] = field(default_factory=dict)
    connect_by_uid: dict[int, int] = field(default_factory=dict)

    def count(self, uid: int, code: str, limit: str | None) -> None:
        _add(self.by_code, code)
        if limit is not None:
            _add(self.by_limit, limit)
        self.by_uid[uid] = self.by_uid.get(uid, 0) + 1

    def connection_refused(self, uid: int, exc: PriodError) -> None:
        """A connection turned away at connect (admission.py; its line is ``connection_refused``)."""
        _add(self.connect_by_code, exc.code)
        limit = limit_name(exc)
        if limit is not None:
            _add(self.connect_by_limit, limit)
        self.connect_by_uid[uid] = self.connect_by_uid.get(uid, 0) + 1

    def figures(self, sessions: Iterable[Session], mine: int | None) -> dict[str, Any]:
        """``refusals`` in `priod status`; ``mine``: the only uid the viewer may see (None: all)."""
        now = time.monotonic()
        clients = [s.refusals for s in sessions if s.refusals.total and (mine is None or s.peer.uid == mine)]
        clients += [r for r in self.closed if mine is None or r.uid == mine]
        clients.sort(key=lambda r: (-r.total, r.conn))
        return {
            "total": sum(self.by_code.values()),
            "by_code": dict(sorted(self.by_code.items())),
            "by_limit": dict(sorted(self.by_limit.items())),
            "by_uid": {str(u): n for u, n in sorted(self.by_uid.items()) if mine is None or u == mine},
            "clients": [r.figures(now) for r in clients],
            "log": {
                "lines": self.logged,
                "suppressed": self.suppressed,
                "per_connection": {"burst": REFUSAL_LINES_BURST, "per_s": REFUSAL_LINES_PER_S},
                "daemon": {"burst": DAEMON_REFUSAL_LINES_BURST, "per_s": DAEMON_REFUSAL_LINES_PER_S},
                "summary_after_s": SUPPRESSED_SUMMARY_S,
            },
            "connections": {
                "total": sum(self.connect_by_code.values()),
                "by_code": dict(sorted(self.connect_by_code.items())),
                "by_limit": dict(sorted(self.connect_by_limit.items())),
                "by_uid": {str(u): n for u, n in sorted(self.connect_by_uid.items()) if mine is None or u == mine},
            },
        }


@dataclass(eq=False)
class Shared:
    """What every session reaches: the daemon's parts and its settings of the moment."""

    cfg: Config
    """Replaced on reload."""
    engine: Engine
    scheduler: Scheduler
    pump: Pump
    regions: RegionTable
    metrics: Metrics
    status: Callable[[Peer | None], dict[str, Any]]
    """`Daemon.status`, given who asks (None: everything)."""
    sessions: dict[int, Session] = field(default_factory=dict)
    totals: dict[str, int] = field(
        default_factory=lambda: {"copies": 0, "bytes": 0, "refused": 0, "protocol_errors": 0}
    )
    stopping: bool = False
    request_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    refusals: Refusals = field(default_factory=Refusals)
    loop: LoopShare = field(default_factory=LoopShare)
    """The loop's time among uids (``[limits] request_loop_share``; rate.py)."""


def _resume_uid(a: LoopAccount) -> None:
    """A uid's credit is back: its waiting connections are read again, one after another in the
    order they waited, until one's turn spends the credit (it waits again, at the back, and sets
    the next timer): deficit round robin among a uid's connections too."""
    a.timer = None
    waiting = a.waiting
    while waiting and a.timer is None:
        session = waiting.popleft()
        session._loop_wait = False
        if not session.closed:
            session._on_ready()


class Session:
    """One client connection: its pending copies, its regions, its replies."""

    def __init__(self, session_id: int, sock: FramedSocket, peer: Peer, shared: Shared) -> None:
        self.id = session_id
        self.sock = sock
        self.peer = peer
        self.shared = shared
        self.holdings: Holdings = shared.regions.holdings(peer.uid)
        self.pending: dict[int, QueuedCopy] = {}
        """Copies queued or in flight, by the client's request id."""
        self.queued_bytes = 0
        self.queued_segments = 0
        """Segments of this connection's pending batches ([limits] max_queued_segments)."""
        self._turn_segments = 0
        self._turn_extra = 0
        """Tokens this turn's requests cost beyond one each (`STATUS_TOKENS`, batches)."""
        self.events = EventTable(shared.engine)
        """The IPC events this connection's copies named, opened once each (gates.py)."""
        self._hold_doorbell = -1
        """The eventfd a client writes after announcing a direct copy (-1: none)."""
        self.ring: CopyRing | None = None
        """Its copy ring, once the client asked for one (rings.py)."""
        self.greeted = False
        self.closed = False
        self.copies = 0
        self.connected_at = self.last_active = time.monotonic()
        """When it connected, and when it last sent a request or held something (for [server]
        hello_timeout_s and idle_timeout_s; the daemon's sweep keeps the second up to date)."""
        self._setup: asyncio.Task[None] | None = None
        """A region set-up under way; the requests behind it wait."""
        self._draining = False
        self._again = False
        self._rate_timer: asyncio.TimerHandle | None = None
        """Set while the uid is out of request tokens (``[limits] max_requests_per_s_per_uid``)."""
        self._loop_wait = False
        """Set while it waits in its uid's `LoopAccount.waiting` for the uid's loop credit."""
        self._ended: asyncio.Future[ProtocolError | None]
        self._context: contextvars.Context
        # The per-copy log line runs thousands of times a second: resolve the logger once
        # (not through structlog's lazy proxy on every call).
        self._copy_log = structlog.get_logger("priod.daemon.session").bind()
        self.refusals = Refused(session_id, peer.pid, peer.uid)
        """Its refused requests, for `priod status` (kept in `Refusals.closed` once it closes)."""
        self._refusal_lines = LineBudget(REFUSAL_LINES_PER_S, REFUSAL_LINES_BURST, self.connected_at)
        self._quiet = Refused(session_id, peer.pid, peer.uid)
        """Refusals the line budget kept out of the log since the last summary."""
        self._quiet_since = 0.0
        self._quiet_timer: asyncio.TimerHandle | None = None
        regions = RegionRequests(shared, self.holdings, lambda: [q.id for q in self.pending.values()])
        self._handlers: dict[type, Callable[[Any, list[int]], Any]] = {
            Hello: self._hello,
            Ping: self._ping,
            StatusRequest: self._status,
            AllocHost: regions.alloc_host,
            RegisterHost: regions.register_host,
            AllocDevice: regions.alloc_device,
            RegisterDevice: regions.register_device,
            Free: regions.free,
            Share: regions.share,
            Cancel: self._cancel,
            OpenHoldPage: self._hold_page,
            OpenRing: self._open_ring,
        }
        """Every request type but Copy, whose reply comes later (`copy_finished`)."""

    # -- the connection --------------------------------------------------------------------
    async def serve(self) -> None:
        """Handle requests until the client leaves or breaks the protocol; then release all.

        Requests are handled in the transport's read callback (`_on_ready`), in arrival order;
        this coroutine only waits for the end. A request that sets up a region runs as a task,
        and the requests behind it wait for it (a copy may name the region it makes).
        """
        loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        self._context = contextvars.copy_context()  # the connection's log context, for callbacks
        self.sock.set_listener(self._on_ready)
        self._on_ready()
        try:
            exc = await self._ended
            if isinstance(exc, ProtocolError):
                self.shared.totals["protocol_errors"] += 1
                log.warning("protocol_error", **error_fields(exc))
                if not self.sock.closed:
                    self.sock.send(ErrorReply(exc.code, f"{exc}; the connection is closed").encode(0))
        finally:
            self.sock.set_listener(None)
            if self._rate_timer is not None:
                self._rate_timer.cancel()
            if self._setup is not None:
                self._setup.cancel()
            self.drop()
            self._close_refusals()
            await self.flush_and_close(timeout=1.0)
            log.info("client_disconnected", copies=self.copies, refused=self.refusals.total)

    def _on_ready(self) -> None:
        if self._draining:
            self._again = True  # called from inside _drain (a reply was sent): it goes on
            return
        # The pump is kicked once when the turn is over, not once per copy (`Pump.begin_batch`),
        # and outside the connection's context: the kick may answer copies, and a reply that
        # finds the connection gone calls back here.
        pump = self.shared.pump
        pump.begin_batch()
        try:
            self._context.run(self._drain)
        finally:
            pump.end_batch()

    def _drain(self) -> None:
        """Handle the requests the transport has, up to a bound per loop turn (other clients
        are served between), unless a region set-up is under way.

        The turn is timed and its uid charged the loop time it took (`LoopShare`): a uid past
        its part of ``[limits] request_loop_share`` waits for its credit (`_loop_park`), with all
        its connections, while other uids' are read."""
        if self._rate_timer is not None or self._loop_wait:
            return  # out of tokens, or of loop time: a timer resumes it
        lim = self.shared.cfg.limits
        rate = self.holdings.tally.requests
        granted = rate.grant(
            REQUESTS_PER_TURN, lim.max_requests_per_s_per_uid, lim.request_burst_per_uid, time.monotonic()
        )
        share, total = self.shared.loop, lim.request_loop_share
        t0 = time.perf_counter()
        acct = share.account(self.peer.uid, t0, total)
        if share.held(acct, total):
            rate.refund(granted)
            self._loop_park(acct, total)
            return
        until = t0 + share.budget(acct, total)
        segments = self.queued_segments
        used = 0
        self._draining = True
        self._turn_segments = self._turn_extra = 0
        try:
            while used + self._turn_extra < granted:
                if self._setup is not None or self._ended.done():
                    return
                if self._turn_segments >= SEGMENTS_PER_TURN:
                    break  # checked a large batch this turn: the others go first
                if used and time.perf_counter() >= until:
                    break  # the uid's loop credit is spent: it waits, the others go first
                if self.ring is not None and self.ring.submissions.pending():
                    # The ring first: a client publishes a copy there before it sends the frames
                    # that may name it (a cancel, a status), so each finds it taken. Under the same
                    # turn bound and request tokens as a frame.
                    used += 1
                    if not self._take_from_ring(self.ring):
                        return
                    continue
                try:
                    item = self.sock.take()
                except ConnectionClosed:
                    self._end(None)
                    return
                except ProtocolError as exc:
                    self._end(exc)
                    return
                if item is None:
                    if not self._again:
                        return
                    self._again = False
                    continue
                used += 1
                self.last_active = time.monotonic()
                try:
                    setup = self._handle(*item)
                except ConnectionClosed:
                    self._end(None)
                    return
                if setup is not None:
                    self._setup = asyncio.ensure_future(setup)  # in this context: keeps the log context
                    self._setup.add_done_callback(self._setup_done)
            loop = asyncio.get_running_loop()
            # Settle now (the finally then settles nothing): what the turn cost decides the wait.
            rate.refund(granted - used - self._turn_extra)
            granted = used + self._turn_extra
            share.charge(acct, self._turn_cost(t0, segments), total)
            t0 = -1.0
            if lim.max_requests_per_s_per_uid > 0 and rate.tokens < 1:
                # The uid is out of tokens, or in debt after an expensive request: come back when
                # its bucket holds a whole token again, not on the next turn.
                self._rate_timer = loop.call_later(rate.wait_s(lim.max_requests_per_s_per_uid), self._rate_resume)
            elif share.held(acct, total):
                self._loop_park(acct, total)
            else:
                loop.call_soon(self._on_ready)
        finally:
            rate.refund(granted - used - self._turn_extra)
            if t0 >= 0:
                share.charge(acct, self._turn_cost(t0, segments), total)
            self._draining = False

    def _turn_cost(self, t0: float, segments: int) -> float:
        """What a turn begun at ``t0`` costs the loop: its time, and the run of the batch
        segments it queued (``segments``: this connection's queued before it)."""
        queued = self.queued_segments - segments
        return time.perf_counter() - t0 + (queued * BATCH_RUN_S_PER_SEGMENT if queued > 0 else 0.0)

    def _loop_park(self, acct: LoopAccount, total: float) -> None:
        """Wait, with the uid's other connections, until the uid has loop credit again."""
        self._loop_wait = True
        acct.waiting.append(self)
        if acct.timer is None:
            acct.timer = asyncio.get_running_loop().call_later(self.shared.loop.wait_s(acct, total), _resume_uid, acct)

    def _charge_batch(self, req: CopyBatch) -> None:
        """Count a batch into this turn before its checks: a turn ends after the largest table,
        taken or refused (SEGMENTS_PER_TURN), and the uid is charged for it by size
        (BATCH_SEGMENTS_PER_TOKEN): a refused table cost its check too."""
        n = len(req.segments) // SEGMENT_BYTES
        self._turn_segments += n
        self._turn_extra += (n + BATCH_SEGMENTS_PER_TOKEN - 1) // BATCH_SEGMENTS_PER_TOKEN

    def _take_from_ring(self, ring: CopyRing) -> bool:
        """Queue the ring's next copy, or refuse it on the socket; False if the ring is broken
        (the connection then ends, as for a bad frame)."""
        try:
            taken = ring.submissions.take()
        except RingCorrupt as corrupt:  # each clause its own name: compiled (setup.py), a name keeps its first type
            self._end(ProtocolError(f"copy ring: {corrupt}"))
            return False
        if taken is None:
            return True
        req_id, req, landed_seq = taken
        landed = LandedWord(ring, landed_seq) if landed_seq is not None and ring.landed is not None else None
        self.last_active = time.monotonic()
        op = "copy_batch" if isinstance(req, CopyBatch) else "copy"
        try:
            if isinstance(req, PriodError):
                raise req
            if isinstance(req, CopyBatch):
                self._charge_batch(req)
                req.check()  # as decode_request checks a frame's batch: the same refusals
                take_batch(self, req_id, req, by_ring=True, landed=landed)
            else:
                req.check()  # as decode_request checks a frame's copy: the same refusals
                take_copy(self, req_id, req, by_ring=True, landed=landed)
        except RequestError as exc:
            self._refuse(req_id, exc, op)
        except Exception as bug:  # a bug of ours: answer, log, keep serving everyone else
            log.exception("request_failed", op=op)
            self._refuse(req_id, PriodError(f"internal error ({type(bug).__name__}: {bug}); the daemon logged it"), op)
        return True

    def _rate_resume(self) -> None:
        self._rate_timer = None
        self._on_ready()

    def limits_changed(self) -> None:
        """A reload changed the limits: a connection waiting for a request token, or for its
        uid's loop credit, asks again at once, under the new settings, instead of waiting out a
        timer the old ones set."""
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
            asyncio.get_running_loop().call_soon(self._on_ready)
        if self._loop_wait:
            acct = self.shared.loop.account(
                self.peer.uid, time.perf_counter(), self.shared.cfg.limits.request_loop_share
            )
            if isinstance(acct.timer, asyncio.TimerHandle):  # once per uid: then a plain Handle
                acct.timer.cancel()
                acct.timer = asyncio.get_running_loop().call_soon(_resume_uid, acct)

    def _setup_done(self, task: asyncio.Task[None]) -> None:
        self._setup = None
        if not task.cancelled() and isinstance(task.exception(), ConnectionClosed):
            self._end(None)
        else:
            self._on_ready()

    def _end(self, exc: ProtocolError | None) -> None:
        if not self._ended.done():
            self._ended.set_result(exc)

    @property
    def idle(self) -> bool:
        """Nothing of the client's is held: no copy pending, no region, no set-up under way."""
        return not self.pending and not self.holdings.regions and self._setup is None

    def expire(self, why: PriodError) -> None:
        """Close the connection for a reason of the daemon's (a timeout): ``why`` goes to the
        client in an error frame with id 0, then the connection ends as if the client had left."""
        if self.closed or not hasattr(self, "_ended") or self._ended.done():
            return
        self._context.run(log.info, "connection_expired", reason=str(why))
        if not self.sock.closed:
            self.sock.send(ErrorReply.of(why).encode(0))
        self._end(None)

    async def flush_and_close(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.sock.drain(), timeout)
        except (TimeoutError, PriodError):
            pass
        self.sock.close()

    def drop(self) -> None:
        """Release what the session held; chunks in flight finish, nothing else is touched."""
        if self.closed:
            return
        self.closed = self.holdings.closed = True
        self.shared.sessions.pop(self.id, None)
        self.shared.pump.drop_owner(self.id)
        self.shared.pump.close_holds(self.id)
        self.events.close()  # after drop_owner: no held copy polls them any more
        if self.ring is not None:
            self.ring.close()
        if self._hold_doorbell >= 0:
            asyncio.get_running_loop().remove_reader(self._hold_doorbell)
            os.close(self._hold_doorbell)
            self._hold_doorbell = -1
        self.shared.regions.release_all(self.holdings)

    def cancel_all(self, code: str) -> None:
        """Cancel every pending copy (the daemon is stopping)."""
        for req in list(self.pending.values()):
            cancel_copy(self.shared.pump, req, code)

    def figures(self) -> dict[str, Any]:
        """This client's line in `priod status`."""
        h = self.holdings
        return {
            "conn": self.id,
            "pid": self.peer.pid,
            "uid": self.peer.uid,
            "name": self.refusals.name,
            "regions": len(h.regions),
            "pinned_bytes": h.pinned_bytes,
            "device_bytes": h.device_bytes,
            "pending": len(self.pending),
            "queued_bytes": self.queued_bytes,
            "copies": self.copies,
            "events": len(self.events),
            "ring_completions": self.ring.completed if self.ring is not None else None,
            "ring_landed": self.ring.landed_stored if self.ring is not None else None,
            "output_buffered": self.sock.output_buffered,
            "refused": self.refusals.total,
        }

    # -- requests --------------------------------------------------------------------------
    def _handle(self, msg: Message, fds: list[int]) -> Coroutine[Any, Any, None] | None:
        """Answer one request now, or return the coroutine that will (region set-up)."""
        req_id = request_id(msg)
        try:
            req = decode_request(msg, greeted=self.greeted, fds=len(fds))
            if type(req) is Copy:  # first and direct: the one request that comes thousands a second
                take_copy(self, req_id, req)  # answered when it ends (copy_finished)
                return None
            if type(req) is CopyBatch:
                self._charge_batch(req)
                take_batch(self, req_id, req)
                return None
            reply = self._handlers[type(req)](req, fds)
            if asyncio.iscoroutine(reply):
                owned, fds = fds, []
                return self._answer_later(req_id, msg.get("op"), reply, owned)
            if type(reply) is tuple:  # (reply, fds to send beside it)
                reply, out_fds = reply
                self._reply(req_id, reply, out_fds)
            else:
                self._reply(req_id, reply, [])
        except RequestError as exc:
            self._refuse(req_id, exc, msg.get("op"))
        except ConnectionClosed:
            raise
        except Exception as bug:  # a bug of ours: answer, log, keep serving everyone else
            log.exception("request_failed", op=msg.get("op"))
            self._refuse(
                req_id, PriodError(f"internal error ({type(bug).__name__}: {bug}); the daemon logged it"), msg.get("op")
            )
        finally:
            if fds:  # the usual request brings none: no call
                close_received(fds)  # the engine keeps its own mapping of a registered memfd
        return None

    async def _answer_later(
        self, req_id: int, op: object, pending: Coroutine[Any, Any, tuple[Any, list[int]]], fds: list[int]
    ) -> None:
        try:
            reply, out_fds = await pending
            self._reply(req_id, reply, out_fds)
        except RequestError as exc:
            self._refuse(req_id, exc, op)
        except (ConnectionClosed, asyncio.CancelledError):
            raise
        except Exception as bug:
            log.exception("request_failed", op=op)
            self._refuse(req_id, PriodError(f"internal error ({type(bug).__name__}: {bug}); the daemon logged it"), op)
        finally:
            close_received(fds)

    def _reply(self, req_id: int, reply: Any, fds: list[int]) -> None:
        if not self.closed:
            self.sock.send(reply.encode(req_id), fds)
        else:
            for fd in fds:
                os.close(fd)

    def _refuse(self, req_id: int, exc: PriodError, op: object = None) -> None:
        """Answer request ``req_id`` (of ``op``, as the client sent it) with an error at once;
        then count it and log it (`_note_refusal`)."""
        self.shared.totals["refused"] += 1
        self.shared.metrics.refused.labels(exc.code).inc()
        try:
            if not self.closed:
                self.sock.send(ErrorReply.of(exc).encode(req_id))
        finally:
            self._note_refusal(req_id, exc, op)

    def _note_refusal(self, req_id: int, exc: PriodError, op: object) -> None:
        """Count a refusal (this connection's `Refused`, the daemon's `Refusals`) and log it once
        as ``request_refused``, unless the connection's or the daemon's line budget is spent:
        then it is counted for the next ``request_refusals_suppressed`` line instead."""
        code, limit = exc.code, limit_name(exc)
        book, mine = self.shared.refusals, self.refusals
        book.count(self.peer.uid, code, limit)
        mine.total += 1
        _add(mine.by_code, code)
        if limit is not None:
            _add(mine.by_limit, limit)
        fields = error_fields(exc)
        if len(fields["error"]) > REASON_CHARS:
            fields["error"] = fields["error"][:REASON_CHARS] + "..."
        name = op[:32] if isinstance(op, str) else None  # what the client sent: any type, any length
        now = mine.last_at = time.monotonic()
        mine.last = {"op": name, "id": req_id, "code": code, "limit": limit, "error": fields["error"]}
        if self._refusal_lines.take(now) and book.lines.take(now):
            book.logged += 1
            log.info(
                "request_refused",
                conn=self.id,
                client=mine.name,
                client_pid=self.peer.pid,
                uid=self.peer.uid,
                op=name,
                id=req_id,
                code=code,
                **({"limit": limit} if limit is not None else {}),
                **fields,
            )
            return
        book.suppressed += 1
        quiet = self._quiet
        if not quiet.total:
            self._quiet_since = now
            if self._quiet_timer is None and not self.closed:
                self._quiet_timer = asyncio.get_running_loop().call_later(
                    SUPPRESSED_SUMMARY_S, self._summarize_refusals
                )
        quiet.total += 1
        _add(quiet.by_code, code)
        if limit is not None:
            _add(quiet.by_limit, limit)

    def _summarize_refusals(self) -> None:
        """The ``request_refusals_suppressed`` line: the refusals kept out of the log since the
        first of them (`SUPPRESSED_SUMMARY_S` ago, or fewer when the connection closes)."""
        self._quiet_timer = None
        quiet = self._quiet
        if not quiet.total:
            return
        log.info(
            "request_refusals_suppressed",
            conn=self.id,
            client=self.refusals.name,
            client_pid=self.peer.pid,
            uid=self.peer.uid,
            suppressed=quiet.total,
            by_code=dict(sorted(quiet.by_code.items())),
            **({"by_limit": dict(sorted(quiet.by_limit.items()))} if quiet.by_limit else {}),
            window_s=round(time.monotonic() - self._quiet_since, 3),
        )
        quiet.total = 0
        quiet.by_code.clear()
        quiet.by_limit.clear()

    def _close_refusals(self) -> None:
        """The connection ended: the last summary, and its refusals kept for `priod status`."""
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
        self._summarize_refusals()
        self.refusals.open = False
        if self.refusals.total:
            self.shared.refusals.closed.append(self.refusals)

    def _hello(self, req: Hello, fds: list[int]) -> HelloReply:
        self.greeted = True
        if req.client:
            self.refusals.name = req.client[:64]
            structlog.contextvars.bind_contextvars(client=self.refusals.name)
        cfg = self.shared.cfg
        return HelloReply(
            v=PROTOCOL_VERSION,
            server="priod",
            version=__version__,
            backend=self.shared.engine.name,
            max_frame_bytes=cfg.server.max_frame_bytes,
            classes=[c.name for c in cfg.classes],
            peer={"pid": self.peer.pid, "uid": self.peer.uid, "gid": self.peer.gid},
            ring=RING_VERSION if ring_supported() else 0,
        )

    def _ping(self, req: Ping, fds: list[int]) -> Empty:
        return Empty()

    def _status(self, req: StatusRequest, fds: list[int]) -> StatusReply:
        # Charged by what it costs the loop (STATUS_TOKENS): ~3 copies, more with many clients.
        self._turn_extra += STATUS_TOKENS - 1 + len(self.shared.sessions) // STATUS_CONNECTIONS_PER_TOKEN
        return StatusReply(self.shared.status(self.peer))

    def _hold_page(self, req: OpenHoldPage, fds: list[int]) -> tuple[HoldPageReply, list[int]]:
        """This connection's hold page for direct urgent copies (holds.py): one slot per host
        lane; a duplicate of the page's fd goes to the client, the daemon keeps its own."""
        engine = self.shared.engine
        lanes = [i.key for i in engine.lanes() if i.key.direction in (Direction.H2D, Direction.D2H)]
        page = self.shared.pump.holds.open(self.id, self.peer.uid, lanes, time.perf_counter())
        fds = [os.dup(page.fd)]
        if req.doorbell:
            # The client writes it after announcing a copy: a daemon asleep (urgent_poll "timer")
            # reads the page at once instead of polling for it.
            self._hold_doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            asyncio.get_running_loop().add_reader(self._hold_doorbell, self._hold_rung)
            fds.append(os.dup(self._hold_doorbell))
        uuids = engine.device_uuids()
        described = [
            {"device": k.device, "device_uuid": uuids.get(k.device), "direction": k.direction.value} for k in lanes
        ]
        return HoldPageReply(described), fds

    def _hold_rung(self) -> None:
        try:
            os.eventfd_read(self._hold_doorbell)
        except BlockingIOError:
            pass
        self.shared.pump.hold_rung()

    def _open_ring(self, req: OpenRing, fds: list[int]) -> tuple[RingReply, list[int]]:
        """This connection's copy ring (rings.py); duplicates of its three fds go to the client."""
        if not ring_supported():
            raise InvalidRequest("this daemon's machine has no copy ring (x86-64 only); send copies on the socket")
        if self.ring is not None:
            raise InvalidRequest("this connection has its copy ring already (one per connection); use the one you have")
        shared = self.shared
        ring = CopyRing(asyncio.get_running_loop(), self._on_ready, shared.engine, shared.regions.release_host_later)
        try:
            fds = ring.client_fds()
        except BaseException:
            ring.close()
            raise
        self.ring = ring
        return RingReply(RING_ENTRIES, RING_VERSION), fds

    # -- copies ----------------------------------------------------------------------------
    def _cancel(self, req: Cancel, fds: list[int]) -> CancelReply:
        queued = self.pending.get(req.target)
        if queued is None:
            raise NotFound(f"no copy with id {req.target} is pending on this connection; it may have finished already")
        ended = cancel_copy(self.shared.pump, queued, "cancelled")
        return CancelReply(req.target, "cancelled" if ended else "stopping")

    def signal_recorded(self, p: PendingCopy, error: Exception | None) -> None:
        """A copy's signal_event was recorded behind its last chunk: tell the client at once (a
        progress frame; the reply comes when the bytes land), so its stream can wait on the event
        while the copy is still in flight. If it could not be, the reply says so."""
        if error is not None:
            p.signal_error = error
        elif not self.closed:
            self.sock.send(progress_frame(p.client_id, PROGRESS_SIGNAL_RECORDED))

    def copy_finished(self, f: Finished, p: PendingCopy) -> None:
        """Answer a copy that ended (done, cancelled or failed), then count and log it."""
        req = f.request
        shared = self.shared
        end = req.last_done if req.last_done is not None else time.perf_counter()
        first = req.first_submit if req.first_submit is not None else end
        # A copy held for its wait_event was queued (``arrival``) held_s after it came.
        queued_s, total_s = first - req.arrival, end - req.arrival + req.held_s
        # The reply goes first: the client waits for it, while the counts, the metrics and the
        # log line below wait for no one (they cost tens of microseconds, most of a small copy's time).
        try:
            if self.closed:
                pass
            elif p.by_ring and f.outcome == "done" and p.signal_error is None and self.ring is not None:
                # On the ring when it has room; the socket otherwise (a client that never reads it).
                if not complete_on_ring(self.ring, f, p, queued_s, end - first, total_s):
                    self.sock.send(outcome_reply(f, p, queued_s, end - first, total_s).encode(p.client_id))
            else:
                self.sock.send(outcome_reply(f, p, queued_s, end - first, total_s).encode(p.client_id))
        finally:
            # Then the books, in this same callback: the client's next request is read after it.
            if p.landed is not None:
                p.landed.ended()
            if f.outcome == "done":
                self.copies += 1
                shared.totals["copies"] += 1
                shared.totals["bytes"] += req.nbytes
            if self.pending.get(p.client_id) is req:
                del self.pending[p.client_id]
                count_pending(self, req.nbytes, p.segments, -1)
                if self.closed:
                    shared.regions.forget_if_unused(self.holdings.tally)
            shared.regions.copy_ended(req.id, p.dst, p.src)
        outcome = f.outcome if f.outcome != "cancelled" else p.cancel_code
        shared.metrics.copy_finished(
            req.cls, outcome, req.lane, req.path, f.bytes_done, queued_s, total_s, f.missed_deadline
        )
        # One line per copy at debug level: at thousands of copies a second an info line each
        # would flood the journal (and cost ~19 us of the loop per copy); errors are warnings.
        # Its fields are not even built when the line would be dropped.
        failed = f.outcome == "failed"
        if not failed and shared.cfg.log.level != "debug":
            return
        (self._copy_log.warning if failed else self._copy_log.debug)(
            "copy",
            conn=self.id,
            client_pid=self.peer.pid,
            uid=self.peer.uid,
            **copy_log_fields(f, p, outcome, shared.engine.device_uuid(req.lane.device), queued_s, total_s),
        )
