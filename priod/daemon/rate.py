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

No clocks: the caller passes ``now``.
"""

from __future__ import annotations

__all__ = ["RequestRate"]


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
