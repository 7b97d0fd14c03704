"""Direct urgent copies: a client's own DMA, for which the daemon holds bulk back.

A client may make its urgent copies itself (``cudaMemcpyAsync`` in its own CUDA context: no
round trip through the daemon) and announce each one on a page the daemon shares with it
(`priod.client.direct`). While a copy is announced and not yet over on a lane, the daemon submits no
bulk chunk there and runs the lane's short bound (``urgent_block_us``), as it does for its own
urgent copies. Why this works (measured on the H200, findings section 7): copy engines
time-slice between CUDA contexts, so the client's copy waits only for the bulk chunks already
in flight in the daemon's context, which the short bound keeps small; and no Python round trip
stands between the client and its copy.

The page: one 4 KiB memfd per connection, made by the daemon and sealed so that its size never
changes (the client cannot make the daemon's mapping fault). Slot ``i`` (lane ``i`` of the
reply's list) is two little-endian uint64 at ``16 * i``: ``begun`` and ``ended``, written only by
the client, each counting up by one per copy, each with one aligned 8-byte store (the daemon
reads them while they are written; a ``begun`` that reads lower than before is no copy). A lane
is held while ``begun != ended``, for at most ``direct_hold_max_ms`` per copy, and only while
the uid has hold budget left on that lane (a token bucket of held seconds:
``urgent_budget_share`` of the time, ``direct_hold_burst_ms`` deep; each copy costs at least
`BEGIN_CHARGE_S`). So a buggy or hostile client can delay bulk by that much and no more; what it
writes is only numbers to the daemon. This module is the bookkeeping; the pump calls
`Holds.scan` each turn and tells the scheduler which lanes are held.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from priod.common.types import LaneKey
from priod.errors import InvalidRequest
from priod.wire.hold_page import PAGE_BYTES, SLOT_BYTES

__all__ = ["HoldPage", "Holds", "HoldsScan"]

MAX_COUNTED = 1_000_000
"""Copies counted from one scan's jump in ``begun`` at most (a client may write any number)."""
BACKWARDS = 1 << 63
"""A change in ``begun`` of this much or more, modulo 2**64, is a step back, not copies."""
BEGIN_CHARGE_S = 50e-6
"""What each announced copy costs its uid's hold budget at least, however short its hold: enough
that a flood of announcements empties the bucket (and an empty bucket starts no short bound),
little enough that one uid's honest clients (thousands of copies a second) stay inside it."""


@dataclass
class _Bucket:
    """Hold budget of one uid on one lane, in seconds of holding."""

    tokens: float
    at: float


@dataclass
class _Slot:
    lane: LaneKey
    bucket: _Bucket
    seen_begun: int = 0
    since: float = -math.inf
    """When the daemon saw the current copy begin (its ``begun`` change)."""
    held_at: float | None = None
    """The scan at which this slot last held its lane (for charging the bucket), else None."""
    cut: bool = False
    """The current copy's hold was cut short (too long, or out of budget): counted once."""


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
    _buckets: dict[tuple[int | None, LaneKey], _Bucket] = field(default_factory=dict)

    def configure(self, hold_max_ms: float, share: float, burst_ms: float) -> None:
        self.hold_max_s, self.share, self.burst_s = hold_max_ms / 1e3, share, burst_ms / 1e3

    def open(self, owner: int, uid: int | None, lanes: Sequence[LaneKey], now: float) -> HoldPage:
        """Make ``owner``'s page (one per connection), slots for ``lanes`` in that order.
        The caller sends ``page.fd`` to the client and keeps nothing else of it."""
        if owner in self.pages:
            raise InvalidRequest(
                "this connection already has its hold page; use the one it got (one page per connection)"
            )
        if not lanes or len(lanes) * SLOT_BYTES > PAGE_BYTES:
            raise InvalidRequest(f"this daemon serves {len(lanes)} host lanes, which do not fit one hold page")
        fd = os.memfd_create("priod-holds", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            # Sealed before the client sees it: it can write the counters, never resize the file
            # under the daemon's mapping (a shrink would make the daemon's next read fault).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            view = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        slots = [_Slot(lane, self._bucket(uid, lane, now)) for lane in lanes]
        page = HoldPage(owner, uid, fd, view, slots, memoryview(view).cast("Q")[: 2 * len(lanes)])
        self.pages[owner] = page
        return page

    def close(self, owner: int) -> None:
        """Forget ``owner``'s page (the connection ended): its holds end with it."""
        page = self.pages.pop(owner, None)
        if page is not None:
            page.words.release()  # the mapping cannot close while a view of it is exported
            page.view.close()
            os.close(page.fd)

    def _bucket(self, uid: int | None, lane: LaneKey, now: float) -> _Bucket:
        # Shared by a uid's connections: more connections do not buy more holding.
        return self._buckets.setdefault((uid, lane), _Bucket(self.burst_s, now))

    def scan(self, now: float) -> HoldsScan:
        """Read every page once: which lanes are held now, and where copies began.

        A slot holds its lane while its copy is announced and not over, for at most
        ``hold_max_s`` from when the daemon first saw it, and while its uid's bucket for the
        lane has tokens; held time is charged to the bucket at the next scan.
        """
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
            for i, slot in enumerate(page.slots):
                b, e = values[2 * i], values[2 * i + 1]
                lane = slot.lane
                bucket = slot.bucket
                bucket.tokens = min(self.burst_s, bucket.tokens + (now - bucket.at) * self.share)
                bucket.at = now
                step = (b - slot.seen_begun) % (1 << 64)
                if 0 < step < BACKWARDS:
                    # A step back is no copy: ``begun`` only counts up, and reads lower only from
                    # a writer that is not one 8-byte store (Python's struct.pack_into zeroes a
                    # field before it packs) or a buggy one. Counted from the last good value,
                    # an honest client is not charged for a copy it did not announce.
                    n = min(step, MAX_COUNTED)
                    self.copies[lane] = self.copies.get(lane, 0) + n
                    slot.seen_begun, slot.since, slot.cut = b, now, False
                    # A copy costs its uid at least BEGIN_CHARGE_S of holding however short it is
                    # (it puts the lane on its short bound), and with nothing left in the bucket
                    # it neither holds nor starts the short bound: a flood of announcements is
                    # held to the budget too, not only long holds.
                    bucket.tokens = max(
                        -self.burst_s, bucket.tokens - n * BEGIN_CHARGE_S
                    )  # a debt of one burst at most
                    if bucket.tokens > 0:
                        begun.add(lane)
                elif step:
                    self.stepped_back[lane] = self.stepped_back.get(lane, 0) + 1
                if slot.held_at is not None:
                    bucket.tokens -= now - slot.held_at
                    slot.held_at = None
                if b == e or slot.cut:
                    continue
                if now - slot.since > self.hold_max_s or bucket.tokens <= 0:
                    slot.cut = True
                    self.cut[lane] = self.cut.get(lane, 0) + 1
                    continue
                slot.held_at = now
                page.holding = True
                held.add(lane)
        frozen = frozenset(held) if held != self.held else self.held
        self.held = frozen
        return HoldsScan(frozen, frozenset(begun)) if begun or frozen else _NOTHING

    def figures(self) -> dict[str, object]:
        """For `priod status`: pages open, copies announced, holds cut short and counters read
        stepping back, per lane."""
        return {
            "pages": len(self.pages),
            "held": sorted(str(k) for k in self.held),
            "copies": {str(k): n for k, n in sorted(self.copies.items())},
            "cut": {str(k): n for k, n in sorted(self.cut.items())},
            "stepped_back": {str(k): n for k, n in sorted(self.stepped_back.items())},
        }
