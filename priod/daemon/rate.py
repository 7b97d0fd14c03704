"""A uid's request rate: a token bucket of requests, shared by all the uid's connections. Pure logic.

Why: every request costs the daemon's one event loop some tens of microseconds whatever its
size, so a client that floods tiny copies (or pings) takes the loop, and with it every other
client's latency, even though the scheduler serves the classes fairly. A session takes tokens
before it handles requests; with none left it stops taking (the transport stops reading, so the
kernel holds the client back) and resumes when one has accrued. Nothing is refused: a fast
client is only slowed to ``[limits] max_requests_per_s_per_uid``.

A token is what a copy costs the loop; a request that costs more (a `status`, a batch of many
segments) is charged more by the session once it is decoded (session.py, `STATUS_TOKENS`,
`BATCH_SEGMENTS_PER_TOKEN`), past what was granted: the bucket goes negative and the uid waits
until it is positive again.

The loop's time among uids (`LoopShare`): a token counts requests, but what one uid's requests
take from the others is the loop's time, and N uids each within their own rate took N times the
loop. So each uid is also charged the loop time its requests take (session.py times each turn
with `time.perf_counter`) and gets an equal part of ``[limits] request_loop_share`` of every
second: deficit round robin over time. A uid whose credit is spent waits (its connections are
not read) until its part has paid the debt back, while the others go on; its connections share
its credit and are resumed in turn, so 32 of them get no more than one. uid 0 and the daemon's
own uid are charged (and counted among the uids sharing) but never wait; nor does a uid alone
(no other uid sent anything within `ACTIVE_S`): there is nobody to be fair to, and its turns
are not counted against it later.

No clocks: the caller passes ``now``.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

__all__ = ["ACTIVE_S", "CREDIT_MAX_S", "QUANTUM_S", "LoopAccount", "LoopShare", "RequestRate"]

ACTIVE_S = 0.5
"""A uid shares the loop while it sent a request (or waited for its turn) within this."""
QUANTUM_S = 0.0005
"""Credit a waiting uid gets back before its connections are read again (the round's quantum):
about five `status` turns or twenty copies, so a uid in debt wakes some tens of times a second,
not once per request."""
CREDIT_MAX_S = 0.002
"""Credit a uid may bank while it sends nothing: an honest burst of 64 copies (~1.6 ms of the
loop) is read at once, and eight uids coming back together hold the loop for 16 ms at most."""
_RECOUNT_S = 0.05
"""How often the uids sharing the loop are counted again (and those gone forgotten)."""


class RequestRate:
    """Tokens of one uid; ``rate`` (requests/s) and ``burst`` come from the settings of the moment."""

    __slots__ = ("stamp", "tokens")

    def __init__(self) -> None:
        self.tokens = 0.0
        """May go negative: a charge past the grant (`refund` of a negative count)."""
        self.stamp = -1.0
        """Negative until first used under a cap: a new uid starts with a full bucket."""

    def grant(self, want: int, rate: float, burst: int, now: float) -> int:
        """Take up to ``want`` whole tokens; how many were taken (0: wait `wait_s`). ``rate`` 0: no cap."""
        if rate <= 0:
            self.stamp = -1.0  # uncapped: books not kept; a cap set later starts from a full bucket
            return want
        # min() and max() written out: this runs once per loop turn of every connection, in
        # front of its requests (a builtin call is ~50 ns, four of them here).
        if self.stamp < 0:
            self.tokens = float(burst)
        elif now > self.stamp:
            tokens = self.tokens + rate * (now - self.stamp)
            self.tokens = tokens if tokens < burst else float(burst)
        if now > self.stamp:
            self.stamp = now
        granted = int(self.tokens) if self.tokens > 0 else 0
        if granted > want:
            granted = want
        self.tokens -= granted
        return granted

    def refund(self, n: int) -> None:
        """Give back tokens taken and not used (the connection had fewer requests than granted);
        negative: charge requests that cost more than granted (the bucket may go below zero)."""
        self.tokens += n

    def wait_s(self, rate: float) -> float:
        """Seconds until one whole token will have accrued."""
        return max(0.0, (1.0 - self.tokens) / rate) if rate > 0 else 0.0


class LoopAccount:
    """One uid's loop time: its credit (seconds; negative: in debt) and its waiting connections."""

    __slots__ = ("charged", "credit", "privileged", "seen", "stamp", "timer", "uid", "waiting")

    def __init__(self, uid: int, privileged: bool, now: float) -> None:
        self.uid = uid
        self.privileged = privileged
        """uid 0 or the daemon's own uid: charged, never made to wait."""
        self.credit = CREDIT_MAX_S
        self.stamp = now
        self.seen = now
        """When it last asked for a turn."""
        self.charged = 0.0
        """Loop seconds charged since it was first seen (for figures)."""
        self.waiting: deque[Any] = deque()
        """Its connections waiting for credit, in the order they came (session.py resumes them)."""
        self.timer: Any = None
        """The loop's timer that resumes them (session.py's), None while none is set."""


class LoopShare:
    """The daemon's loop time among the uids sending requests; ``total`` (a share of each second,
    ``[limits] request_loop_share``; 0: no bound) comes from the settings of the moment."""

    def __init__(self, own_uid: int | None = None) -> None:
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self._uids: dict[int, LoopAccount] = {}
        self.active = 0
        """Uids sharing the loop now: seen within `ACTIVE_S`, or waiting."""
        self._counted = -1.0

    def account(self, uid: int, now: float, total: float) -> LoopAccount:
        """The uid's account, its credit brought up to ``now`` (called at the start of a turn)."""
        a = self._uids.get(uid)
        if a is None:
            a = self._uids[uid] = LoopAccount(uid, uid == 0 or uid == self.own_uid, now)
            recount = True
        else:
            recount = now - a.seen > ACTIVE_S or now - self._counted > _RECOUNT_S  # new or back: at once
        a.seen = now
        if recount:
            self._recount(now)
        if now > a.stamp:
            if total > 0:
                credit = a.credit + (now - a.stamp) * total / (self.active or 1)
                a.credit = credit if credit < CREDIT_MAX_S else CREDIT_MAX_S
            a.stamp = now
        return a

    def _recount(self, now: float) -> None:
        self._counted = now
        n = 0
        for uid, a in list(self._uids.items()):
            if a.waiting or a.timer is not None or now - a.seen <= ACTIVE_S:
                n += 1
            elif a.credit >= CREDIT_MAX_S or now - a.seen > 10 * ACTIVE_S:
                del self._uids[uid]  # gone a while, no debt left: forgotten (a new one starts full)
        self.active = n

    def held(self, a: LoopAccount, total: float) -> bool:
        """Whether the uid must wait before its next turn: sharing (``total`` set, another uid
        active), not privileged, and its credit spent."""
        return total > 0 and not a.privileged and self.active > 1 and a.credit <= 0

    def budget(self, a: LoopAccount, total: float) -> float:
        """Seconds of the loop the uid's turn may take before it ends (inf: no bound)."""
        if total <= 0 or a.privileged or self.active <= 1:
            return float("inf")
        return a.credit

    def charge(self, a: LoopAccount, seconds: float, total: float) -> None:
        """Charge a turn's loop time. A uid that could not have been made to wait (alone, or no
        bound) keeps no debt for it; a privileged one does (its figures), but never waits."""
        a.charged += seconds
        a.credit -= seconds
        if a.credit < 0 and (total <= 0 or self.active <= 1):
            a.credit = 0.0

    def wait_s(self, a: LoopAccount, total: float) -> float:
        """Seconds until the uid's credit is back to `QUANTUM_S`, at its part of ``total``."""
        if total <= 0:
            return 0.0
        return max(0.0, (QUANTUM_S - a.credit) * (self.active or 1) / total)

    def figures(self) -> dict[str, Any]:
        """Per uid: loop seconds charged, credit, connections waiting."""
        return {
            "active": self.active,
            "uids": {
                str(u): {"charged_s": round(a.charged, 6), "credit_s": round(a.credit, 6), "waiting": len(a.waiting)}
                for u, a in sorted(self._uids.items())
            },
        }
