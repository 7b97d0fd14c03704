"""Direct urgent copies: a client's own DMA, for which the daemon holds bulk back.

A client may make its urgent copies itself (``cudaMemcpyAsync`` in its own CUDA context: no
round trip through the daemon) and announce each one on a page the daemon shares with it
(`priod.client.direct`). While a copy is announced and not yet over on a lane, the daemon submits no
bulk chunk there and runs the lane's short bound (``urgent_block_us``), as it does for its own
urgent copies. Why this works (measured on the H200, findings section 7): copy engines
time-slice between CUDA contexts, so the client's copy waits only for the bulk chunks already
in flight in the daemon's context, which the short bound keeps small; and no Python round trip
stands between the client and its copy.

The page: one 8 KiB memfd per connection, made by the daemon and sealed so that its size never
changes (the client cannot make the daemon's mapping fault). Slot ``i`` (lane ``i`` of the
reply's list) is two little-endian uint64 at ``16 * i``: ``begun`` and ``ended``, written only by
the client, each counting up by one per copy, each with one aligned 8-byte store (the daemon
reads them while they are written; a ``begun`` that reads lower than before is no copy). A lane
is held while ``begun != ended``, for at most ``direct_hold_max_ms`` per copy, and only while
the uid has hold budget left on that lane (a token bucket of held seconds:
``urgent_budget_share`` of the time, ``direct_hold_burst_ms`` deep; each copy costs at least
`BEGIN_CHARGE_S`). Holds of all uids together take at most ``direct_hold_total_share`` of a
lane's time: a second token bucket per lane, charged once for each stretch the lane was held
whoever held it, with the same depth (so several uids, each within its own budget, cannot
together hold bulk back for more). So a buggy or hostile client can delay bulk by that much and
no more; what it writes is only numbers to the daemon. This module is the bookkeeping; the pump calls
`Holds.scan` each turn and tells the scheduler which lanes are held.

The page's second half is the daemon's (`priod.wire.hold_page`): one word per slot, 1 while the
uid's hold budget on that lane is spent (its bucket empty; a copy announced then runs un-held,
so the client should send it through the daemon), or while the lane's total is (then on every
page, whatever its uid), 0 again once the empty buckets have refilled enough for a hold
(`Holds.regrant_s`). Until then a copy of that uid holds only within what its bucket has refilled,
and never puts the lane on its short bound. The daemon writes the word when that changes, on every
page concerned, and never reads it back: a client writing there changes only what it reads itself.
The word is kept current by the scans (before each submission, and on `priod status`): on a
daemon with nothing to do it may read 1 until the next scan.

The scans also time the direct copies, at scan granularity: a copy ran no longer than from the
look before the scan that saw its ``begun`` step to the scan that saw ``ended`` catch up, and no
shorter than from the scan that saw it begin to the last look that saw it under way. That upper
bound is recorded (`DirectTimes`: Prometheus's ``priod_request_duration_seconds`` with
``path="direct"``, and `priod status`) when the looks pin it down: to within `TIMED_WITHIN_S`,
or to within half of it. Looks are close together while bulk is held or on the short bound
(every loop turn); with no bulk about the daemon looks seldom and a copy is counted, not timed.
Copies that overlap or come several between two looks (``begun`` stepping by more than one
before ``ended`` catches up) are counted, not timed: their span is no one copy's duration.
"""

from __future__ import annotations

import bisect
import fcntl
import math
import mmap
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from priod.common.types import LaneKey
from priod.daemon.metrics import LATENCY_BUCKETS
from priod.errors import InvalidRequest
from priod.wire.hold_page import DAEMON_WORD, GRANTED, MAX_SLOTS, PAGE_BYTES, REFUSED, WORDS_PER_SLOT

__all__ = ["DirectTimes", "HoldPage", "Holds", "HoldsScan"]

MAX_COUNTED = 1_000_000
"""Copies counted from one scan's jump in ``begun`` at most (a client may write any number)."""
BACKWARDS = 1 << 63
"""A change in ``begun`` of this much or more, modulo 2**64, is a step back, not copies."""
BEGIN_CHARGE_S = 50e-6
"""What each announced copy costs its uid's hold budget at least, however short its hold: enough
that a flood of announcements empties the bucket (and an empty bucket starts no short bound),
little enough that one uid's honest clients (thousands of copies a second) stay inside it."""
TIMED_WITHIN_S = 250e-6
"""A direct copy's duration is recorded when the daemon's looks bound it to within this much
(or to within half the figure): while bulk is held or on the short bound the daemon looks every
loop turn, tens of microseconds apart."""
RECENT_TIMED = 1024
"""Timed direct copies per lane that `priod status`'s percentiles are taken over (the latest)."""


@dataclass(eq=False)
class _Bucket:
    """Hold budget of one uid on one lane, or of the whole lane (``total``), in seconds of
    holding, and what its pages are told."""

    lane: LaneKey
    tokens: float
    at: float
    total: bool = False
    """The lane's bucket, over all uids (refills at `Holds.total_share`), not one uid's."""
    refused: bool = False
    """Told to the uid's pages: the budget is spent (set at empty, cleared at `Holds.regrant_s`)."""
    clear_at: float = math.inf
    """While refused: when the bucket will have refilled to `Holds.regrant_s`, if nothing is
    charged meanwhile (the scan looks at it then, though no page of it changes)."""
    slots: list[_Slot] = field(default_factory=list)
    """The slots of open pages that draw on it (each page of the uid has one for the lane; for
    the lane's bucket, every page's slot of the lane)."""


@dataclass
class DirectTimes:
    """Direct copies the daemon timed on one lane (see the module's docstring): cumulative
    counts per `LATENCY_BUCKETS` bound (le: value <= bound) and one past the last, their sum,
    and the latest `RECENT_TIMED` figures."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_s: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_TIMED))

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_s += seconds
        self.recent.append(seconds)

    def percentiles_us(self) -> dict[str, float]:
        """p50 and p99 (nearest rank) of the latest timed copies, in microseconds."""
        ordered = sorted(self.recent)
        n = len(ordered)
        return {f"p{q}_us": round(ordered[max(0, math.ceil(q * n / 100) - 1)] * 1e6, 1) for q in (50, 99)}


@dataclass(eq=False)
class _Slot:
    lane: LaneKey
    bucket: _Bucket
    whole: _Bucket
    """The lane's bucket over all uids (`Holds.total_share`)."""
    told: memoryview
    """The page's daemon half as uint64 words: this slot's word is ``told[index]``. Written,
    never read: the client can write there too."""
    index: int
    refused: bool = False
    """What this slot's word was last set to by the daemon (the daemon's own record: the word
    itself is never read back): refused while its uid's bucket or its lane's is."""
    seen_begun: int = 0
    since: float = -math.inf
    """When the daemon saw the current copy begin (its ``begun`` change)."""
    held_at: float | None = None
    """The scan at which this slot last held its lane (for charging the bucket), else None."""
    cut: bool = False
    """The current copy's hold was cut short (too long, or out of budget): counted once."""
    open_copies: int = 0
    """Copies begun since ``ended`` last caught up with ``begun`` (0: none under way)."""
    open_after: float = 0.0
    """The look before the scan that saw the first of them begin: it began after this."""
    open_seen: float = 0.0
    """The scan that saw the first of them begin."""


@dataclass
class HoldPage:
    """One connection's page: the daemon's mapping and what it has seen of each slot."""

    owner: int
    uid: int | None
    fd: int
    view: mmap.mmap
    slots: list[_Slot]
    words: memoryview
    """The slots' counters as native uint64 words: read one aligned 8-byte load each, so a
    counter the client is writing reads as its old value or its new one, never a mix."""
    told: memoryview
    """The daemon's half, one word per slot (`_Slot.told`): written only, never read."""
    opened: float = -math.inf
    seen: list[int] = field(default_factory=list)
    """The counters as the last scan that looked at the slots read them."""
    holding: bool = False
    """Some slot held its lane at that scan."""

    def counters(self) -> list[int]:
        return self.words.tolist()


@dataclass
class HoldsScan:
    """What one scan found: lanes held now, lanes where a copy began since the last scan."""

    held: frozenset[LaneKey]
    begun: frozenset[LaneKey]


_NOTHING = HoldsScan(frozenset(), frozenset())


@dataclass
class Holds:
    """Every connection's hold page, and the budgets of their uids."""

    hold_max_s: float = 0.005
    share: float = 0.25
    burst_s: float = 0.05
    total_share: float = 0.5
    """Of a lane's time, what the holds of all uids together may take (``burst_s`` deep)."""
    pages: dict[int, HoldPage] = field(default_factory=dict)
    copies: dict[LaneKey, int] = field(default_factory=dict)
    """Direct copies announced per lane (for status and metrics)."""
    cut: dict[LaneKey, int] = field(default_factory=dict)
    """Holds cut short per lane: a copy announced for longer than hold_max, or past its budget."""
    stepped_back: dict[LaneKey, int] = field(default_factory=dict)
    """Reads of a ``begun`` lower than the last one per lane: a page writer that is not one 8-byte
    store per counter, or a buggy one (no copy is counted for them)."""
    held: frozenset[LaneKey] = frozenset()
    """Lanes held at the last scan."""
    timed: dict[LaneKey, DirectTimes] = field(default_factory=dict)
    """Direct copies timed per lane (for status and metrics)."""
    _buckets: dict[tuple[int | None, LaneKey], _Bucket] = field(default_factory=dict)
    _lanes: dict[LaneKey, _Bucket] = field(default_factory=dict)
    """Each lane's bucket over all uids."""
    _refusing: set[_Bucket] = field(default_factory=set)
    """Buckets whose pages are told the budget is spent: looked at each scan until refilled."""
    _looked: float = -math.inf
    """When the last scan read the pages."""

    def configure(self, hold_max_ms: float, share: float, burst_ms: float, total_share: float) -> None:
        self.hold_max_s, self.share, self.burst_s = hold_max_ms / 1e3, share, burst_ms / 1e3
        self.total_share = total_share
        for bucket in self._refusing:
            bucket.clear_at = -math.inf  # the limits changed: judged afresh at the next scan

    @property
    def regrant_s(self) -> float:
        """Tokens a bucket whose pages were told "refused" must have again before they are told
        "granted": one hold as long as any may last, or the whole burst where that is less. Less
        would tell a client to come back for a copy or two and then refuse it again."""
        return min(self.burst_s, self.hold_max_s)

    def open(self, owner: int, uid: int | None, lanes: Sequence[LaneKey], now: float) -> HoldPage:
        """Make ``owner``'s page (one per connection), slots for ``lanes`` in that order.
        The caller sends ``page.fd`` to the client and keeps nothing else of it."""
        if owner in self.pages:
            raise InvalidRequest(
                "this connection already has its hold page; use the one it got (one page per connection)"
            )
        if not lanes or len(lanes) > MAX_SLOTS:
            raise InvalidRequest(f"this daemon serves {len(lanes)} host lanes, which do not fit one hold page")
        fd = os.memfd_create("priod-holds", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            # Sealed before the client sees it: it can write the counters, never resize the file
            # under the daemon's mapping (a shrink would make the daemon's next read fault).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            # Read-write for the daemon's half (the refused words). The client can write all of
            # it: the daemon reads only the counters, and writes its words without reading them.
            view = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        words = memoryview(view).cast("Q")
        counters = words[: WORDS_PER_SLOT * len(lanes)]
        told = words[DAEMON_WORD : DAEMON_WORD + len(lanes)]
        words.release()
        slots = [
            _Slot(lane, self._bucket(uid, lane, now), self._whole(lane, now), told, i) for i, lane in enumerate(lanes)
        ]
        page = HoldPage(owner, uid, fd, view, slots, counters, told, opened=now)
        for slot in slots:
            slot.bucket.slots.append(slot)
            slot.whole.slots.append(slot)
            # Another connection of the uid spent its budget, or the uids together the lane's.
            self._word(slot)
        self.pages[owner] = page
        return page

    def close(self, owner: int) -> None:
        """Forget ``owner``'s page (the connection ended): its holds end with it."""
        page = self.pages.pop(owner, None)
        if page is not None:
            for slot in page.slots:
                slot.bucket.slots.remove(slot)
                slot.whole.slots.remove(slot)
            page.words.release()  # the mapping cannot close while a view of it is exported
            page.told.release()
            page.view.close()
            os.close(page.fd)

    def _bucket(self, uid: int | None, lane: LaneKey, now: float) -> _Bucket:
        # Shared by a uid's connections: more connections do not buy more holding.
        bucket = self._buckets.get((uid, lane))
        if bucket is None:
            bucket = self._buckets[(uid, lane)] = _Bucket(lane, self.burst_s, now)
        return bucket

    def _whole(self, lane: LaneKey, now: float) -> _Bucket:
        bucket = self._lanes.get(lane)
        if bucket is None:
            bucket = self._lanes[lane] = _Bucket(lane, self.burst_s, now, total=True)
        return bucket

    def _rate(self, bucket: _Bucket) -> float:
        return self.total_share if bucket.total else self.share

    def _refill(self, bucket: _Bucket, now: float) -> None:
        bucket.tokens = min(self.burst_s, bucket.tokens + (now - bucket.at) * self._rate(bucket))
        bucket.at = now

    def scan(self, now: float) -> HoldsScan:
        """Read every page once: which lanes are held now, and where copies began.

        A slot holds its lane while its copy is announced and not over, for at most
        ``hold_max_s`` from when the daemon first saw it, and while its uid's bucket for the
        lane has tokens, and the lane's bucket over all uids too; held time is charged to the
        uid's bucket at the next scan, and to the lane's once however many uids held it. Each page
        is told when its uid's bucket for a lane, or the lane's, runs empty or has refilled
        (`regrant_s`), and direct copies are timed where the looks bound them closely (the
        module's docstring).
        """
        looked, self._looked = self._looked, now
        for lane in self.held:  # held since the last scan: charged to the lane's total once
            whole = self._lanes[lane]
            self._refill(whole, now)
            # A debt of one burst at most: a loop that stalled with a lane held does not refuse
            # every uid on it for long after.
            whole.tokens = max(-self.burst_s, whole.tokens - (now - looked))
            if whole.tokens <= 0 and not whole.refused:
                self._judge(whole, whole.tokens, now)
        if self._refusing:
            self._look_at_refusing(now)
        if not self.pages:
            if self.held:
                self.held = frozenset()
            return _NOTHING
        held: set[LaneKey] = set()
        begun: set[LaneKey] = set()
        for page in self.pages.values():
            values = page.counters()
            if values == page.seen and not page.holding:
                # Nothing written since the last look and nothing held: nothing to do (a bucket
                # refills from its own timestamp whenever it is next looked at). Most pages are
                # idle at any moment, and the pump scans every loop turn under the short bound.
                continue
            page.seen, page.holding = values, False
            before = max(looked, page.opened)  # the page's last look: it was open then
            for i, slot in enumerate(page.slots):
                b, e = values[2 * i], values[2 * i + 1]
                lane = slot.lane
                bucket = slot.bucket
                self._refill(bucket, now)
                step = (b - slot.seen_begun) % (1 << 64)
                if 0 < step < BACKWARDS:
                    # A step back is no copy: ``begun`` only counts up, and reads lower only from
                    # a writer that is not one 8-byte store (Python's struct.pack_into zeroes a
                    # field before it packs) or a buggy one. Counted from the last good value,
                    # an honest client is not charged for a copy it did not announce.
                    n = min(step, MAX_COUNTED)
                    self.copies[lane] = self.copies.get(lane, 0) + n
                    slot.seen_begun, slot.since, slot.cut = b, now, False
                    if slot.open_copies:
                        slot.open_copies = min(slot.open_copies + n, MAX_COUNTED)
                    else:
                        slot.open_copies, slot.open_after, slot.open_seen = n, before, now
                    # A copy costs its uid at least BEGIN_CHARGE_S of holding however short it is
                    # (it puts the lane on its short bound), and with nothing left in the bucket
                    # it neither holds nor starts the short bound: a flood of announcements is
                    # held to the budget too, not only long holds. Nor does it while the lane's
                    # total is spent: it runs un-held, and bulk keeps its long chunks (else uids
                    # taking turns past the total would keep bulk on short ones throughout).
                    # Nor, though it holds, while the uid's pages read refused (spent, and not yet
                    # refilled to `regrant_s`): a client that announces on the edge of its budget
                    # would keep bulk on short chunks between its holds (attack.py's ``holds``:
                    # bulk beside it 0.68-0.71x of alone so, 0.84-0.85x with long chunks).
                    bucket.tokens = max(
                        -self.burst_s, bucket.tokens - n * BEGIN_CHARGE_S
                    )  # a debt of one burst at most
                    if bucket.tokens > 0 and not bucket.refused and not slot.whole.refused:
                        begun.add(lane)
                elif step:
                    self.stepped_back[lane] = self.stepped_back.get(lane, 0) + 1
                if slot.held_at is not None:
                    bucket.tokens -= now - slot.held_at
                    slot.held_at = None
                if bucket.refused or bucket.tokens <= 0:
                    self._judge(bucket, bucket.tokens, now)
                if b == e:
                    if slot.open_copies:
                        self._over(slot, before, now)
                    continue
                if slot.cut:
                    continue
                if now - slot.since > self.hold_max_s or bucket.tokens <= 0 or slot.whole.refused:
                    slot.cut = True
                    self.cut[lane] = self.cut.get(lane, 0) + 1
                    continue
                slot.held_at = now
                page.holding = True
                held.add(lane)
        frozen = frozenset(held) if held != self.held else self.held
        self.held = frozen
        return HoldsScan(frozen, frozenset(begun)) if begun or frozen else _NOTHING

    def _over(self, slot: _Slot, before: float, now: float) -> None:
        """``ended`` caught up with ``begun``: the copies under way on the slot are over. One
        copy is timed where the looks bound its duration closely (the module's docstring)."""
        copies, slot.open_copies = slot.open_copies, 0
        if copies != 1:
            return  # several at once: their span is no one copy's duration
        longest = now - slot.open_after  # it began after that look and ended before this one
        shortest = before - slot.open_seen if before > slot.open_seen else 0.0  # under way at both
        if longest - shortest <= max(TIMED_WITHIN_S, longest / 2):
            times = self.timed.get(slot.lane)
            if times is None:
                times = self.timed[slot.lane] = DirectTimes()
            times.observe(longest)

    def _judge(self, bucket: _Bucket, tokens: float, at: float) -> None:
        """Tell the bucket's pages when it runs empty, and again once it has `regrant_s`
        (``tokens``: what it has at ``at``); only then is the page written (the words are the
        daemon's: nothing is read back from them)."""
        if bucket.refused:
            if tokens >= self.regrant_s:
                self._tell(bucket, False)
                return
        elif tokens <= 0:
            self._tell(bucket, True)
        else:
            return
        rate = self._rate(bucket)
        bucket.clear_at = at + (self.regrant_s - tokens) / rate if rate > 0 else math.inf

    def _tell(self, bucket: _Bucket, refused: bool) -> None:
        bucket.refused = refused
        for slot in bucket.slots:
            self._word(slot)
        if refused:
            self._refusing.add(bucket)
        else:
            self._refusing.discard(bucket)
            bucket.clear_at = math.inf

    @staticmethod
    def _word(slot: _Slot) -> None:
        """Set the slot's word where what it should say changed: refused while its uid's bucket
        or its lane's is (one aligned 8-byte store; the word itself is never read back)."""
        refused = slot.bucket.refused or slot.whole.refused
        if refused != slot.refused:
            slot.refused = refused
            slot.told[slot.index] = REFUSED if refused else GRANTED

    def _look_at_refusing(self, now: float) -> None:
        """Tell the pages of a refused bucket that has refilled meanwhile (its pages may all be
        idle: a refused client sends its copies through the daemon, and a scan skips a page with
        nothing new). The bucket itself refills when a page of it is next looked at."""
        for bucket in list(self._refusing):
            if now >= bucket.clear_at:
                tokens = min(self.burst_s, bucket.tokens + (now - bucket.at) * self._rate(bucket))
                self._judge(bucket, tokens, now)

    def figures(self) -> dict[str, object]:
        """For `priod status`: pages open, copies announced, holds cut short and counters read
        stepping back, per lane; the direct copies timed and their p50 and p99 over the latest
        `RECENT_TIMED` (microseconds); the uids whose hold budget is spent now, counted per lane,
        and the lanes whose total for all uids is spent now."""
        refused: dict[str, int] = {}
        for bucket in self._refusing:
            if not bucket.total:
                refused[str(bucket.lane)] = refused.get(str(bucket.lane), 0) + 1
        return {
            "pages": len(self.pages),
            "held": sorted(str(k) for k in self.held),
            "copies": {str(k): n for k, n in sorted(self.copies.items())},
            "cut": {str(k): n for k, n in sorted(self.cut.items())},
            "stepped_back": {str(k): n for k, n in sorted(self.stepped_back.items())},
            "timed": {str(k): {"copies": t.count, **t.percentiles_us()} for k, t in sorted(self.timed.items())},
            "refused": dict(sorted(refused.items())),
            "refused_lanes": sorted(str(b.lane) for b in self._refusing if b.total),
        }
