"""Which path an urgent copy takes: the one whose recent latency for its size is lower.

Two paths can carry an urgent copy (common/types.py): ``express`` (a copy kernel on the SMs)
and ``dma`` (the copy engine, with bulk held back). Which is faster depends on what the daemon
cannot see. Measured on an H200: with idle SMs a 64 KiB express copy took 240-280 us p50 end
to end, but as soon as another process ran GEMMs the kernel waited for that process's compute
time slice, 1.5-2.2 ms; DMA does not care about compute at all. So the choice is made by
measurement, per lane, form and power-of-two size bucket: an exponentially weighted average of
each path's observed latency (submission to completion seen), the lower one wins. The path not
chosen is tried again once ``explore_s`` has passed and `EXPLORE_EVERY` copies of the bucket
have gone the other way (a co-tenant comes and goes), so a path that recovered is found again
at the cost of one slow copy per look.

A batch (many segments) and a contiguous copy of one size are told apart: a path's per-segment
work makes them differ, differently on each path. On the H200 beside a GEMM process, through the
daemon, 16 MiB goes by DMA in 0.6 ms as one copy and 2.2 ms as 256 segments, by the copy kernel
in 1.9-2.0 ms either way (docs/benchmarks.md): in one bucket, the batches' DMA samples would
keep the contiguous copies off DMA, their fastest path, for seconds at a time.

Pure logic: the caller passes ``now`` and the latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from priod.common.types import LaneKey, Path

__all__ = ["EXPLORE_EVERY", "PathChooser", "PathEstimate", "PathFigures"]

ALPHA = 0.25
"""Weight of the newest sample: a co-tenant that starts shows within a few copies."""
EXPLORE_EVERY = 200
"""The path not chosen is looked at again at most once in this many copies of a bucket (and once
per ``explore_s``): a look costs its copy the slower path's time (beside a GEMM process, 1.1-2.1
ms by the copy kernel where DMA takes 0.6 on the H200), and one in 200 keeps the looks out of
the bucket's p99, which a look every ~100 copies does not (see docs/design.md, Defaults). The
price: where the faster path's cause goes away (a co-tenant stops computing), the copies notice
it up to this many copies later, not ``explore_s`` later. Where copies come faster than this many per ``explore_s``, ``explore_s`` alone decides."""


_PATHS = (Path.EXPRESS, Path.DMA)
"""The paths in the order `PathFigures` holds their figures."""


class PathFigures:
    """One lane's figures for one size bucket, per path as ``[express, dma]``.

    Lists indexed by path rather than dicts keyed by it: an enum member hashes through a Python
    method, and every Python function a copy's path touches costs microseconds on a thread that
    has just woken."""

    __slots__ = ("chosen", "latency", "seen", "streak", "tried")

    def __init__(self) -> None:
        self.latency: list[float | None] = [None, None]
        """Smoothed latency per path, seconds."""
        self.tried: list[float | None] = [None, None]
        """When each path was last chosen."""
        self.seen: list[float | None] = [None, None]
        """When each path's latency was last observed."""
        self.chosen = [0, 0]
        self.streak = 0
        """Choices since the path not chosen was last looked at."""


@dataclass(frozen=True)
class PathEstimate:
    """One lane and size bucket, for `priod status` and metrics."""

    lane: str
    size_bytes: int
    """Upper end of the bucket: copies of (size/2, size] bytes."""
    form: str
    """"copy" (one contiguous range) or "batch" (a segment table)."""
    express_us: float | None
    dma_us: float | None
    choice: str
    express_chosen: int
    dma_chosen: int


class PathChooser:
    """Per lane, size bucket and form, the recent latency of each path; `choose` picks the lower."""

    def __init__(self, explore_s: float = 2.0, explore_every: int = EXPLORE_EVERY) -> None:
        self.explore_s = explore_s
        self.explore_every = explore_every
        """The path not chosen is looked at again once ``explore_s`` has passed *and* this many
        copies of the bucket have taken the other since the last look (1: ``explore_s`` alone)."""
        self._buckets: dict[tuple[LaneKey, int, bool], PathFigures] = {}

    def bucket(self, lane: LaneKey, nbytes: int, batch: bool = False) -> PathFigures:
        """The figures for ``lane``, the size bucket of ``nbytes`` and the form (a ``batch`` or
        one contiguous copy), made on first use; a caller that keeps them between copies of one
        size passes them to `choose_in` and `observe_in` without this lookup.

        Not ``setdefault(key, PathFigures())``: that builds a bucket (four lists) per urgent copy,
        only to throw it away, and every urgent copy comes here once it is done (`observe`)."""
        key = (lane, (nbytes - 1 or 1).bit_length(), batch)  # copies of (2**(k-1), 2**k] bytes (nbytes >= 1)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = PathFigures()
        return b

    def choose(self, lane: LaneKey, nbytes: int, now: float, batch: bool = False) -> Path:
        """The path for an urgent copy (or ``batch``) of ``nbytes`` that both paths could carry."""
        return self.choose_in(self.bucket(lane, nbytes, batch), now)

    def observe(
        self, lane: LaneKey, path: Path, nbytes: int, latency_s: float, now: float, batch: bool = False
    ) -> None:
        """An urgent copy (or ``batch``) on ``path`` took ``latency_s`` from submission to completion seen (at ``now``)."""
        self.observe_in(self.bucket(lane, nbytes, batch), path, latency_s, now)

    def choose_in(self, b: PathFigures, now: float) -> Path:
        """`choose` for the copies of bucket ``b``."""
        ex, dma = b.latency
        if ex is None:
            i = 0  # the calibrated default: express where the engine offers it
        elif dma is None:
            i = 1
        else:
            i = 0 if ex <= dma else 1
            last = b.tried[1 - i]
            if last is not None and now - last >= self.explore_s and b.streak >= self.explore_every:
                i = 1 - i  # look again: what slowed it may have gone
                b.streak = 0
        b.tried[i] = now
        b.chosen[i] += 1
        b.streak += 1
        return _PATHS[i]

    def observe_in(self, b: PathFigures, path: Path, latency_s: float, now: float) -> None:
        """`observe` for a copy of bucket ``b``. A figure older than ``explore_s`` is replaced
        rather than averaged: it describes a GPU that may be gone (the co-tenant that slowed the
        path has stopped)."""
        i = 0 if path is Path.EXPRESS else 1
        old, seen = b.latency[i], b.seen[i]
        b.latency[i] = (
            latency_s
            if old is None or seen is None or now - seen >= self.explore_s
            else old + ALPHA * (latency_s - old)
        )
        b.seen[i] = now

    def estimates(self) -> list[PathEstimate]:
        out = []
        for (lane, bucket, batch), b in sorted(self._buckets.items(), key=lambda kv: kv[0]):
            ex, dma = b.latency
            choice = (
                "express"
                if ex is not None and (dma is None or ex <= dma)
                else ("dma" if dma is not None else "express")
            )
            out.append(
                PathEstimate(
                    str(lane),
                    1 << bucket,
                    "batch" if batch else "copy",
                    None if ex is None else round(ex * 1e6, 1),
                    None if dma is None else round(dma * 1e6, 1),
                    choice,
                    b.chosen[0],
                    b.chosen[1],
                )
            )
        return out
