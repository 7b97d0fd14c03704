"""The order in which each lane's queued work is handed out as chunks. Pure logic.

Part of the scheduler (scheduler.py drives it; nothing else imports it). This is where the
promise of docs/design.md is decided, chunk by chunk, per lane:

- Strict classes first, a chunk per tenant in turn: express where the lane has a path for the
  size and it is faster now (choice.py), else DMA within a budget of its own, so an urgent copy
  waits for at most the non-strict bytes already in flight. A strict request is charged to its
  tenant's urgent budget when it first comes up (budget.py); past it, it is *demoted*: served
  as the highest-weight non-strict class from then on.
- No non-strict chunk while a strict DMA chunk is queued or in flight, except one per class
  head that has waited ``aging_ms`` (aging: an urgent flood cannot starve the rest).
- Otherwise non-strict classes share by weight: deficit round robin by bytes, within the
  in-flight bound of `Lane.bound`; inside a class, a chunk per tenant and connection in turn
  (queues.py).
- mode "fifo": whole requests in arrival order, no bound.

A `Dispatcher` chooses which request, how many bytes and which path; the scheduler's
``hand_out`` (given to it) does the accounting and makes the `Chunk`. No clocks: the caller
passes ``now``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from priod.common.choice import PathChooser
from priod.common.types import Path
from priod.daemon.sched.budget import BULK, EXPRESS, STRICT, admit
from priod.daemon.sched.lanes import Lane
from priod.daemon.sched.policy import Policy
from priod.daemon.sched.queues import ClassQueue, Group, Track, leave_class, park, pick, push

if TYPE_CHECKING:
    from priod.daemon.sched.records import Chunk

_DMA, _EXPRESS = Path.DMA, Path.EXPRESS
"""Module globals: read per chunk, where ``Path.DMA`` costs ~55 ns more on Python 3.11
(EnumType's __getattr__ takes enum classes off the fast attribute path)."""

HandOut = Callable[[Track, int, Path, float], "Chunk"]
"""Cut the next ``size`` bytes of a request on ``path`` at ``now``, and account for them as in flight."""


class Dispatcher:
    """Chooses, lane by lane, the chunks to hand out now (see the module's docstring)."""

    __slots__ = ("below_strict", "chooser", "demoted", "hand_out", "policy")

    def __init__(self, policy: Policy, chooser: PathChooser, hand_out: HandOut) -> None:
        self.policy = policy
        self.below_strict = below_strict(policy)
        self.chooser = chooser
        self.hand_out = hand_out
        self.demoted = 0
        """Strict requests served as a lower class because their client was past its budget."""

    def configure(self, policy: Policy) -> None:
        self.policy = policy
        self.below_strict = below_strict(policy)

    def serve_fifo(self, lane: Lane, now: float, out: list[Chunk]) -> None:
        """mode "fifo": every request whole, in arrival order, no bound (a plain CUDA stream)."""
        q = lane.fifo
        while q:
            t = q.popleft()
            # A batch's chunks are cut by segment (scheduler's hand_out): all of them, in order.
            while t.queued:
                out.append(self.hand_out(t, t.req.nbytes - t.req.submitted_bytes, Path.DMA, now))

    def serve(self, lane: Lane, now: float, out: list[Chunk]) -> None:
        """mode "priod" for one lane: strict (express and DMA), then non-strict by weight."""
        chunk, bound = lane.bound(now)

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
        # behind it. Bulk resumes as soon as the urgent chunk lands. The same while a client's
        # own urgent copy is under way (holds.py): the engine switches to its context sooner.
        if not dma_ok or lane.strict_inflight or lane.held:
            self._serve_aged(lane, now, out)
            return

        # Deficit round robin by bytes across classes; within a class, one chunk per tenant in
        # turn. The head of ``rr`` holds the turn; a turn can span several calls when the
        # in-flight bound fills up, hence ``in_turn``. A class whose tenants are all at their
        # cap of chunks in flight is passed over and keeps its turn for when it comes round.
        rr = lane.rr
        # A tenant may fill the lane's queue: ``depth`` chunks, or the more short ones that
        # ``[tuning] urgent_queue_us`` keeps on a gated lane.
        cap = max(self.policy.depth, bound // chunk)
        batch_chunk, batch_bound = lane.bound(now, batch=True)
        skipped = 0
        while rr and skipped < len(rr):
            cq = rr[0]
            if not cq.live:
                rr.popleft()
                cq.active = cq.in_turn = False
                continue
            g = pick(cq, BULK, cap)
            if g is None:
                rr.rotate(-1)
                skipped += 1
                continue
            t = g.head()
            batch = t.req.segments is not None and t.req.segments.small_blocks()
            size = min(batch_chunk if batch else chunk, t.req.nbytes - t.req.submitted_bytes)
            if lane.inflight and lane.inflight + size > (batch_bound if batch else bound):
                return
            if not cq.in_turn:
                # quantum >= the lane's largest chunk >= size, so every turn hands out at least one chunk.
                cq.deficit += cq.quantum
                cq.in_turn = True
            if cq.deficit < size:
                cq.in_turn = False
                rr.rotate(-1)
                continue
            cq.deficit -= size
            handed = self.hand_out(t, size, _DMA, now)
            if handed.nbytes < size and cq.live:
                cq.deficit += size - handed.nbytes  # a batch's chunk, cut at its segments, came out shorter
            out.append(handed)
            skipped = 0
            g.ring.rotate(-1)
            cq.ring.rotate(-1)

    def _serve_strict(
        self, lane: Lane, cq: ClassQueue, chunk: int, bound: int, dma_ok: bool, now: float, out: list[Chunk]
    ) -> bool:
        """Hand out what one strict class may now, a chunk per tenant in turn. True: some of
        its DMA work waits for the lane's strict budget (or for a higher class's)."""
        ring = cq.ring
        cap = self.policy.depth
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
                if not t.admitted and not admit(t, now):
                    self._demote(t)
                    continue
                t.route = self._route(t, now)
            left = req.nbytes - req.submitted_bytes
            if t.route is _EXPRESS:
                # Express copies do not queue behind the copy engine: only the tenant's cap
                # bounds them (and its budget, already charged).
                if g.tenant.inflight[EXPRESS] >= cap:
                    park(g)
                    continue
                out.append(self.hand_out(t, left, _EXPRESS, now))
            else:
                if g.tenant.inflight[STRICT] >= cap:
                    park(g)
                    continue
                # An urgent batch: chunks of the lane's regular size, not of the short bound
                # (`batch.URGENT_DMA_SEGMENTS` says why); `Scheduler._hand_out` cuts them.
                size = min(max(chunk, lane.params.chunk_bytes) if req.segments is not None else chunk, left)
                if not dma_ok or (lane.strict_inflight and lane.strict_inflight + size > bound):
                    waiting = True
                    ring.rotate(-1)
                    skipped += 1
                    continue
                out.append(self.hand_out(t, size, _DMA, now))
            skipped = 0
            g.ring.rotate(-1)
            ring.rotate(-1)
        return waiting

    def _route(self, t: Track, now: float) -> Path:
        """A strict request's path: express where the lane has one for its size and it is
        faster now (choice.py), else DMA."""
        p, req = t.lane.params, t.req
        if (
            p.express_max
            and req.submitted_bytes == 0
            and p.express_min <= req.nbytes <= p.express_max
            and self.chooser.choose(t.lane.key, req.nbytes, now, req.segments is not None) is _EXPRESS
        ):
            return _EXPRESS
        return _DMA

    def _demote(self, t: Track) -> None:
        """Move a strict request past its tenant's budget (its sub-queue's head) to the class
        below strict, where it is served with the tenant's other work there."""
        sub = t.sub
        assert sub is not None
        sub.pop_head(t)
        t.cq.queued_bytes -= t.req.nbytes - t.req.submitted_bytes
        leave_class(t)
        req = t.req
        if req.demoted_from is None:
            req.demoted_from = req.cls
        req.cls = self.below_strict
        t.cq = t.lane.classes[req.cls]
        push(t, False)  # not mode "fifo": that serves whole copies and never demotes (`serve_fifo`)
        self.demoted += 1

    def _serve_aged(self, lane: Lane, now: float, out: list[Chunk]) -> None:
        """While strict work waits, let through one chunk per non-strict head waiting too long.

        Each class's head is the request its class would serve next (its turn's tenant and
        connection); the longest-waiting one goes first. Handing it a chunk restarts its wait,
        so a strict flood still leaves each class a chunk per ``aging_ms``. These chunks still
        respect the in-flight bound and the tenants' caps, and are not charged to the
        round-robin deficits.
        """
        chunk, bound = lane.bound(now)
        limit = now - self.policy.aging_ms / 1000.0
        cap = self.policy.depth
        while True:
            best: Track | None = None
            best_group: Group | None = None
            best_since = limit
            for cq in lane.nonstrict:
                if cq.live:
                    g = pick(cq, BULK, cap)
                    if g is not None:
                        t = g.head()
                        if t.since < best_since:
                            best, best_group, best_since = t, g, t.since
            if best is None or best_group is None:
                return
            size = min(chunk, best.req.nbytes - best.req.submitted_bytes)
            if lane.inflight and lane.inflight + size > bound:
                return
            out.append(self.hand_out(best, size, Path.DMA, now))
            best_group.ring.rotate(-1)
            best_group.cq.ring.rotate(-1)


def below_strict(policy: Policy) -> str:
    """Where strict work past its client's budget is served: the highest-weight non-strict
    class (the first such in the policy on a tie)."""
    return max((c for c in policy.classes if not c.strict), key=lambda c: c.weight).name
