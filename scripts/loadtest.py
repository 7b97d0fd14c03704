#!/usr/bin/env python3
"""priod load test: synthetic client processes, every copied byte checked.

    python scripts/loadtest.py --spawn-daemon --backend sim --duration 20 --out out/load
    python scripts/loadtest.py --socket /run/priod/priod.sock --clients 24 --duration 60 --out out/load
    python scripts/loadtest.py --spawn-daemon --soak --duration 120 --out out/soak
    python scripts/loadtest.py --spawn-daemon --soak --duration 120 --kill-every 10-20 --out out/soak-restarts

Each client is its own process with its own connection and a profile (``--client SPEC``,
repeatable; SPEC is comma-separated ``key=value``):

    class=urgent          priority class (default normal)
    dir=h2d|d2h|d2d       direction (default h2d)
    size=1MiB             fixed; ``64KiB..4MiB`` log-uniform; ``64KiB|1MiB|16MiB`` one of
    rate=100              open loop: Poisson arrivals per second, at most ``window`` outstanding
    window=4              open loop: outstanding copies at most (default 4)
    concurrency=2         closed loop: this many copies always outstanding (used without rate)
    requests=1000         this client stops after that many copies (default --requests)
    count=3               this many client processes with this profile
    deadline_ms=5         optional deadline sent with each copy
    device=0              GPU index
    churn=200             close the connection and open a new one (new regions) every 200 copies

Without ``--client`` the default mix (`DEFAULT_MIX`) is cycled to ``--clients`` processes. A run
ends by itself after ``--duration`` seconds or when every client has sent its ``--requests``.

Verification: each copy's source is filled with a pattern unique to that request (64-bit words
``key + i``) and its destination is compared after the reply. Where both ends are mapped in the
client (the sim engine maps device regions too) that is direct. Where a device region is not
mapped (the cuda engine), the pattern goes in and comes out through host staging regions: an
extra h2d copy before a copy whose source is on the device, an extra d2h copy after a copy whose
destination is. Those extra copies run at the same class, are counted as ``aux``, and are not
in the latency figures. ``--verify staged`` forces the staged path on sim as well.

Reported per class: requests, bytes, throughput, client latency p50/p99/p99.9/max, the daemon's
own total_us, errors by kind, bytes corrupted (a success whose destination differs), bytes lost
(no reply, or a success for fewer bytes than asked) and bytes unverified. JSON and PNG plots go
under ``--out``. Exit status: 0 clean; 1 errors, corruption, loss, a leak or a crashed client;
2 a soak whose figures did not stay flat.

Restarts (``--kill-every 10-20``, with ``--spawn-daemon``): the daemon is killed every 10 to 20
seconds (uniform; ``--kill-signal KILL|TERM|mixed``) while the load runs, and a new one started
at once on the same socket path. The clients reconnect by themselves (``--reconnect-s``; with
``--retry-copies`` the client library also sends interrupted copies again). Each copy's
destination range first gets "old bytes", so that every word is known to be new, old or
neither. Counted per class: copies succeeded and verified; copies failed with a documented
restart error (`restart_kind`: ``lost_reply``, ``shutting_down``, ``reconnecting``), each sent
again by the client (``--restart-resubmits``) and how many of those then succeeded; copies lost
(no reply and no error by the end of the drain); corrupted (a word neither old nor new, in a
copy's range after success or failure, or a source changed); false successes (reported done,
old bytes still there); and clients alive at the end (ran to the end, a ping answered). Any
lost, corrupted or falsely successful copy, or a client not alive, fails the run. With
``--soak`` the flatness checks run per daemon and across daemons (`soak_verdict_restarts`).

Needs only numpy, msgpack, uvloop and structlog (priod's own dependencies); matplotlib is
optional (no plots without it); psutil is not used (``/proc`` is read directly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

# Runs from a checkout without installing priod (like scripts/bench.py); the spawned daemon and
# client processes get the same path through PYTHONPATH (see main()).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from priod.client import Client, Region, SyncClient
from priod.errors import ConnectionClosed, PriodError
from priod.testing import (
    DaemonProcess,
    daemon_pid,
    daemon_process,
    memory_and_fds,
    percentile,
    summarize,
)

MASK = (1 << 64) - 1
BLOCK_WORDS = 1 << 17
"""Patterns are written and checked 1 MiB at a time: no temporary as large as a copy."""
_BASE = np.arange(BLOCK_WORDS, dtype=np.uint64)
SLOT_ALIGN = 4096
T = TypeVar("T")

DEFAULT_MIX = (
    "class=urgent,dir=h2d,size=64KiB..2MiB,rate=100",
    "class=urgent,dir=d2h,size=4KiB..1MiB,rate=50",
    "class=bulk,dir=h2d,size=32MiB,concurrency=2",
    "class=bulk,dir=d2h,size=16MiB..64MiB,concurrency=2",
    "class=normal,dir=d2d,size=1MiB..8MiB,rate=40",
)
"""The default clients: urgent copies both ways under bulk streams both ways, and a d2d client."""

SOAK_MIX = (
    "class=urgent,dir=h2d,size=64KiB..1MiB,rate=50,churn=500",
    "class=urgent,dir=d2h,size=4KiB..256KiB,rate=30",
    "class=bulk,dir=h2d,size=8MiB..16MiB,concurrency=1,churn=100",
    "class=bulk,dir=d2h,size=8MiB,concurrency=1",
    "class=normal,dir=d2d,size=256KiB..2MiB,rate=20,churn=50",
)
"""The soak's default clients: lighter than `DEFAULT_MIX` (the point is time, not load), and
three of them reconnect with new regions over and over, so a per-connection leak shows."""

RESTART_EXTRA = ("class=normal,dir=h2d,size=64KiB..1MiB,rate=20,window=1,api=sync",)
"""With --kill-every the default mixes gain a blocking client (`SyncClient`), which finds a lost
connection at its next request rather than when the socket closes."""


# -- sizes and profiles ---------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """``4096``, ``64KiB``, ``1.5MiB``, ``2GB`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write it like 4096, 64KiB, 1.5MiB or 2GB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return n


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}B"


class SizeDist:
    """Copy sizes: fixed (``1MiB``), log-uniform (``64KiB..4MiB``) or a choice (``4KiB|1MiB``)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lo = self.hi = 0
        self.choices: list[int] = []
        if ".." in text:
            lo, hi = (parse_bytes(t) for t in text.split("..", 1))
            if lo > hi:
                raise ValueError(f"size range {text!r} runs backwards; write it low..high")
            self.lo, self.hi = lo, hi
        else:
            self.choices = [parse_bytes(t) for t in text.split("|")]
        self.max = max(self.choices) if self.choices else self.hi

    def sample(self, rng: random.Random) -> int:
        if self.choices:
            return rng.choice(self.choices)
        if self.lo == self.hi:
            return self.lo
        return min(self.hi, max(self.lo, int(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi))))))

    def __str__(self) -> str:
        return self.text


@dataclass
class Profile:
    """What one synthetic client does."""

    cls: str = "normal"
    direction: str = "h2d"
    size: str = "1MiB"
    rate: float = 0.0
    """Open loop arrivals per second; 0: closed loop."""
    window: int = 4
    concurrency: int = 1
    requests: int = 0
    """0: only the duration bounds it."""
    count: int = 1
    deadline_ms: float | None = None
    device: int = 0
    churn: int = 0
    """Reconnect (new connection, new regions) every this many copies; 0: never."""
    api: str = "async"
    """async: `priod.Client` on an event loop; sync: `priod.SyncClient`, one copy at a time."""

    @property
    def slots(self) -> int:
        """Copies outstanding at most; each has its own slice of the regions."""
        return self.window if self.rate > 0 else self.concurrency

    @property
    def name(self) -> str:
        return f"{self.cls}-{self.direction}"

    def describe(self) -> str:
        load = f"rate={self.rate:g}/s" if self.rate > 0 else f"concurrency={self.concurrency}"
        return (
            f"{self.cls} {self.direction} size={self.size} {load}"
            + (f" churn={self.churn}" if self.churn else "")
            + (" (SyncClient)" if self.api == "sync" else "")
        )


def parse_profile(spec: str) -> Profile:
    """``class=urgent,dir=h2d,size=1MiB,rate=100`` -> `Profile`; raises ValueError naming the fix."""
    p = Profile()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"client spec item {item!r} is not key=value")
        key = {"dir": "direction", "class": "cls"}.get(key, key)
        if key in ("cls", "direction", "size"):
            setattr(p, key, value)
        elif key == "api":
            if value not in ("async", "sync"):
                raise ValueError(f"api={value} is invalid; use async or sync")
            p.api = value
        elif key in ("rate", "deadline_ms"):
            setattr(p, key, float(value))
        elif key in ("window", "concurrency", "requests", "count", "device", "churn"):
            setattr(p, key, int(value))
        else:
            raise ValueError(
                f"unknown client spec key {key!r}; known: class, dir, size, rate, window, concurrency, requests, count, deadline_ms, device, churn, api"
            )
    if p.direction not in ("h2d", "d2h", "d2d"):
        raise ValueError(f"dir={p.direction} is invalid; use h2d, d2h or d2d")
    SizeDist(p.size)  # validate now, in the parent
    if p.slots < 1 or p.count < 1:
        raise ValueError(f"client spec {spec!r}: window, concurrency and count must be >= 1")
    if p.api == "sync" and (p.slots != 1 or p.churn):
        raise ValueError(
            f"client spec {spec!r}: api=sync makes one copy at a time, without churn (window=1 with a rate)"
        )
    return p


# -- patterns -------------------------------------------------------------------------------


def request_key(client: int, seq: int) -> int:
    """A 64-bit key per request (splitmix64 of client and sequence): patterns never repeat."""
    z = (client * 0x9E3779B97F4A7C15 + seq * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _tail_bytes(key: int, words: int, tail: int) -> npt.NDArray[np.uint8]:
    return np.array([(key + words) & MASK], dtype=np.uint64).view(np.uint8)[:tail]


def write_pattern(buf: npt.NDArray[np.uint8], key: int) -> None:
    """Fill ``buf`` (8-byte aligned) with 64-bit words ``key + i``; a final partial word is cut short."""
    words = len(buf) // 8
    w = buf[: words * 8].view(np.uint64)
    for start in range(0, words, BLOCK_WORDS):
        blk = w[start : start + BLOCK_WORDS]
        np.add(_BASE[: len(blk)], np.uint64((key + start) & MASK), out=blk)
    if len(buf) % 8:
        buf[words * 8 :] = _tail_bytes(key, words, len(buf) % 8)


def count_bad(buf: npt.NDArray[np.uint8], key: int, scratch: npt.NDArray[np.uint64]) -> int:
    """How many bytes of ``buf`` differ from the pattern `write_pattern` wrote for ``key``."""
    words = len(buf) // 8
    w = buf[: words * 8].view(np.uint64)
    bad = 0
    for start in range(0, words, BLOCK_WORDS):
        blk = w[start : start + BLOCK_WORDS]
        exp = scratch[: len(blk)]
        np.add(_BASE[: len(blk)], np.uint64((key + start) & MASK), out=exp)
        if not np.array_equal(blk, exp):
            bad += int(np.count_nonzero(blk.view(np.uint8) != exp.view(np.uint8)))
    if len(buf) % 8:
        bad += int(np.count_nonzero(buf[words * 8 :] != _tail_bytes(key, words, len(buf) % 8)))
    return bad


OLD_XOR = 0x5A5A_0F0F_A5A5_F0F0
"""With --kill-every a copy's destination range is first filled with the pattern of ``key ^
OLD_XOR`` (its "old bytes"), so that afterwards every word is known to be new, old or neither."""


def classify_words(buf: npt.NDArray[np.uint8], key: int, old: int, scratch: npt.NDArray[np.uint64]) -> tuple[int, int]:
    """(bytes still old, bytes neither old nor new) in ``buf``, by whole 8-byte words (a final
    partial word byte by byte): what a copy's destination holds against its pattern for ``key``
    and the ``old`` pattern written there before it."""
    words = len(buf) // 8
    w = buf[: words * 8].view(np.uint64)
    still_old = neither = 0
    old_exp = np.empty_like(scratch)
    for start in range(0, words, BLOCK_WORDS):
        blk = w[start : start + BLOCK_WORDS]
        exp = scratch[: len(blk)]
        np.add(_BASE[: len(blk)], np.uint64((key + start) & MASK), out=exp)
        if np.array_equal(blk, exp):
            continue
        oexp = old_exp[: len(blk)]
        np.add(_BASE[: len(blk)], np.uint64((old + start) & MASK), out=oexp)
        not_new = blk != exp
        is_old = blk == oexp
        still_old += 8 * int(np.count_nonzero(is_old))
        neither += 8 * int(np.count_nonzero(not_new & ~is_old))
    tail = len(buf) % 8
    if tail:
        got = buf[words * 8 :]
        new_t, old_t = _tail_bytes(key, words, tail), _tail_bytes(old, words, tail)
        still_old += int(np.count_nonzero((got != new_t) & (got == old_t)))
        neither += int(np.count_nonzero((got != new_t) & (got != old_t)))
    return still_old, neither


LOST_REPLY = "and the connection was lost before its reply"
"""In `priod.client.base.copy_lost`'s message: the documented error of a copy a restart interrupted."""


def restart_kind(exc: BaseException) -> str | None:
    """The documented restart error ``exc`` is (docs/reliability.md, "What survives a daemon
    restart"), or None for any other error: ``lost_reply``, the copy was sent and the
    connection was lost before its reply (it may have moved bytes; re-submitting is safe);
    ``shutting_down``, a stopping daemon refused it; ``reconnecting``, the client refused it
    while it reconnects (it was never sent)."""
    if getattr(exc, "code", None) == "shutting_down":
        return "shutting_down"
    if isinstance(exc, ConnectionClosed):
        text = str(exc)
        if LOST_REPLY in text and "The client did not reconnect" not in text:
            return "lost_reply"
        if "the client is reconnecting" in text:
            return "reconnecting"
    return None


def own_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


# -- the client process ---------------------------------------------------------------------


@dataclass
class WorkerStats:
    """What one client saw; raw per-copy figures go to the parent, which aggregates."""

    client: int
    profile: str
    cls: str
    direction: str
    pid: int
    ok: int = 0
    bytes: int = 0
    issued: int = 0
    lat_us: list[float] = field(default_factory=list)
    daemon_us: list[float] = field(default_factory=list)
    t_done: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    express: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_bytes: dict[str, int] = field(default_factory=dict)
    first_error: str = ""
    bytes_verified: int = 0
    bytes_corrupted: int = 0
    copies_corrupted: int = 0
    bytes_lost: int = 0
    bytes_unverified: int = 0
    aux_copies: int = 0
    aux_bytes: int = 0
    late: int = 0
    """Open loop: arrivals that found every slot busy and waited for one."""
    reconnects: int = 0
    elapsed_s: float = 0.0
    setup_s: float = 0.0
    # With --kill-every (the daemon restarted under the load; see `restart_kind`):
    restart_errors: dict[str, int] = field(default_factory=dict)
    """Copies that failed with a documented restart error, by kind: ``lost_reply`` (sent, no
    reply before the connection was lost: may have moved bytes), ``shutting_down`` (refused by
    a stopping daemon), ``reconnecting`` (refused by the client while it reconnects)."""
    first_restart_error: str = ""
    restart_retried: int = 0
    """Copies this client sent again after a restart error (the same copy, same pattern)."""
    restart_retry_ok: int = 0
    """Of those, the copies that succeeded on a re-submission."""
    restart_gave_up: int = 0
    """Copies still failing with a restart error after every re-submission."""
    copies_lost: int = 0
    """Copies with no reply and no error by the end of the drain, or a success for fewer bytes."""
    copies_false_success: int = 0
    """Copies reported done whose destination still held (some of) its old bytes."""
    bytes_false_success: int = 0
    client_reconnects: int = 0
    """Reconnects the client library made by itself (reconnect_s), over every connection."""
    landed_replies: int = 0
    """Copies the client answered from their landed word (the engine's store behind their
    bytes) rather than from the daemon's completion: urgent copies of a spinning client."""
    alive: bool = True
    """Ran to the end and its connection answered a ping after the load (with --kill-every)."""
    alive_why: str = ""
    fds_start: int = 0
    fds_end: int = 0
    """This process's own open fds when the load began and when it ended (connection open)."""

    def error(self, kind: str, nbytes: int, exc: BaseException) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.error_bytes[kind] = self.error_bytes.get(kind, 0) + nbytes
        if not self.first_error:
            self.first_error = f"{kind}: {exc}"


class Endpoint:
    """One end of the measured copies, and how this process reads and writes it."""

    def __init__(self, region: Region, staged: bool) -> None:
        self.region = region
        # Host regions are always mapped; ``staged`` makes device regions go through staging
        # copies even where they are mapped (sim), to exercise the path the cuda engine needs.
        self.mapped = region.array is not None and not (staged and region.kind == "device")

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        assert self.region.array is not None
        return self.region.array


class Checker:
    """Puts a request's pattern into its source and checks its destination, mapped or staged."""

    def __init__(
        self, client: Client, cls: str, stats: WorkerStats, stage_in: Region | None, stage_out: Region | None
    ) -> None:
        self.client, self.cls, self.stats = client, cls, stats
        self.stage_in, self.stage_out = stage_in, stage_out
        self.scratch = np.empty(BLOCK_WORDS, dtype=np.uint64)

    async def fill(self, ep: Endpoint, off: int, n: int, key: int) -> None:
        if ep.mapped:
            write_pattern(ep.array[off : off + n], key)
            return
        assert self.stage_in is not None and self.stage_in.array is not None
        write_pattern(self.stage_in.array[off : off + n], key)
        await self.client.copy(ep.region, self.stage_in, n, dst_offset=off, src_offset=off, priority=self.cls)
        self.stats.aux_copies += 1
        self.stats.aux_bytes += n

    async def poison(self, ep: Endpoint, off: int, n: int, old: int) -> None:
        """Write the "old bytes" (`OLD_XOR`) into a destination range before its copy."""
        if ep.mapped:
            write_pattern(ep.array[off : off + n], old)
            return
        assert self.stage_out is not None and self.stage_out.array is not None
        write_pattern(self.stage_out.array[off : off + n], old)
        await self.client.copy(ep.region, self.stage_out, n, dst_offset=off, src_offset=off, priority=self.cls)
        self.stats.aux_copies += 1
        self.stats.aux_bytes += n

    async def classify(self, ep: Endpoint, off: int, n: int, key: int, old: int) -> tuple[int, int]:
        """`classify_words` of a destination range, mapped or staged."""
        if ep.mapped:
            return classify_words(ep.array[off : off + n], key, old, self.scratch)
        assert self.stage_out is not None and self.stage_out.array is not None
        await self.client.copy(self.stage_out, ep.region, n, dst_offset=off, src_offset=off, priority=self.cls)
        self.stats.aux_copies += 1
        self.stats.aux_bytes += n
        return classify_words(self.stage_out.array[off : off + n], key, old, self.scratch)

    async def check(self, ep: Endpoint, off: int, n: int, key: int) -> int:
        if ep.mapped:
            return count_bad(ep.array[off : off + n], key, self.scratch)
        assert self.stage_out is not None and self.stage_out.array is not None
        await self.client.copy(self.stage_out, ep.region, n, dst_offset=off, src_offset=off, priority=self.cls)
        self.stats.aux_copies += 1
        self.stats.aux_bytes += n
        return count_bad(self.stage_out.array[off : off + n], key, self.scratch)


def progress_message(idx: int, stats: WorkerStats, lat: list[float]) -> dict[str, Any]:
    """A worker's progress line: its counts so far and the latencies since the last line."""
    return {
        "type": "progress",
        "client": idx,
        "ok": stats.ok,
        "bytes": stats.bytes,
        "errors": sum(stats.errors.values()),
        "restart_errors": sum(stats.restart_errors.values()),
        "bad": stats.bytes_corrupted + stats.bytes_false_success,
        "lat_us": lat,
    }


def _emit(msg: dict[str, Any]) -> None:
    # A result carries every latency (hundreds of KB). On the GPU machine one arrived cut short
    # at 72 KiB (that client's result was lost; the cause is not pinned down): write with the fd
    # in blocking mode, so a full pipe cannot end the line early.
    os.set_blocking(sys.stdout.fileno(), True)
    sys.stdout.write(json.dumps(msg, separators=(",", ":")) + "\n")
    sys.stdout.flush()


@dataclass
class Session:
    """One connection of a client and the regions its copies use."""

    client: Client
    src: Endpoint
    dst: Endpoint
    checker: Checker


async def open_session(spec: dict[str, Any], prof: Profile, stats: WorkerStats, total: int) -> Session:
    """Connect, allocate the regions (and staging regions where an end is not mapped)."""
    staged = spec["verify"] == "staged"
    idx = spec["client"]
    client = await Client.connect(
        spec["socket"],
        copy_path="daemon",
        name=f"loadtest/{idx}/{prof.name}",
        wait_s=spec.get("connect_wait_s", 10.0),
        reconnect_s=spec.get("reconnect_s", 30.0),
        retry_copies=spec.get("retry_copies", False),
    )
    try:
        host = await client.alloc_host(total)
        dev = await client.alloc_device(total, prof.device)
        if prof.direction == "h2d":
            src, dst = Endpoint(host, staged), Endpoint(dev, staged)
        elif prof.direction == "d2h":
            src, dst = Endpoint(dev, staged), Endpoint(host, staged)
        else:
            src, dst = Endpoint(dev, staged), Endpoint(await client.alloc_device(total, prof.device), staged)
        stage_in = await client.alloc_host(total) if not src.mapped else None
        stage_out = await client.alloc_host(total) if not dst.mapped else None
        for r in (src.region, dst.region, stage_in, stage_out):
            if r is not None and r.array is not None:
                r.array[::4096] = 0  # allocate every page now: first touches would skew the first second
    except BaseException:
        await client.close()
        raise
    return Session(client, src, dst, Checker(client, prof.cls, stats, stage_in, stage_out))


async def open_session_through_restarts(spec: dict[str, Any], prof: Profile, stats: WorkerStats, total: int) -> Session:
    """`open_session`; with --kill-every, tried again while a restart gets in its way (the
    daemon killed between the connect and the regions' allocation), for up to ``reconnect_s``."""
    if not spec.get("restarts"):
        return await open_session(spec, prof, stats, total)
    deadline = time.monotonic() + spec.get("reconnect_s", 30.0)
    while True:
        try:
            return await open_session(spec, prof, stats, total)
        except PriodError as exc:
            if not (isinstance(exc, ConnectionClosed) or restart_kind(exc)) or time.monotonic() >= deadline:
                raise
            stats.restart_errors["session"] = stats.restart_errors.get("session", 0) + 1
            await asyncio.sleep(0.05)


async def run_worker(spec: dict[str, Any]) -> WorkerStats:
    """One client: connect, allocate, say ready, wait for go, load until the end, report.

    With ``churn`` in its profile the client closes its connection every ``churn`` copies and
    opens a new one with new regions (what a daemon must survive for days without leaking).
    """
    prof = Profile(**spec["profile"])
    idx: int = spec["client"]
    stats = WorkerStats(idx, prof.name, prof.cls, prof.direction, os.getpid())
    rng = random.Random(spec["seed"] * 7919 + idx)
    sizes = SizeDist(prof.size)
    slot_bytes = -(-sizes.max // SLOT_ALIGN) * SLOT_ALIGN
    total = slot_bytes * prof.slots
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    first = await open_session_through_restarts(spec, prof, stats, total)
    session: Session | None = first
    try:
        stats.setup_s = time.perf_counter() - t0
        _emit(
            {
                "type": "ready",
                "client": idx,
                "verify": "staged" if (first.checker.stage_in or first.checker.stage_out) else "mapped",
            }
        )
        go = json.loads(await loop.run_in_executor(None, sys.stdin.readline) or "{}")
        if "start" not in go:
            return stats
        start_wall: float = go["start"]
        end_wall: float = go["end"]
        delay = start_wall - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        start = time.perf_counter()
        end = start + (end_wall - start_wall)
        max_requests = prof.requests or spec.get("requests", 0) or 0
        restarts = bool(spec.get("restarts"))
        stats.fds_start = own_fds()
        broken = False
        outstanding: dict[int, int] = {}  # slot -> bytes of the measured copy awaiting its reply
        seq = 0
        epoch_issued = 0

        def more() -> bool:
            return (
                not broken
                and time.perf_counter() < end
                and (not max_requests or stats.issued < max_requests)
                and (not prof.churn or epoch_issued < prof.churn)
            )

        async def one(ses: Session, slot: int) -> None:
            nonlocal broken, seq, epoch_issued
            n = sizes.sample(rng)
            off = slot * slot_bytes
            seq += 1
            key = request_key(idx, seq)
            stats.issued += 1
            epoch_issued += 1
            if restarts:
                await one_through_restarts(ses, slot, off, n, key)
                return
            try:
                await ses.checker.fill(ses.src, off, n, key)
            except ConnectionClosed as exc:
                broken = True
                stats.error("aux:" + type(exc).__name__, n, exc)
                return
            except PriodError as exc:
                stats.error("aux:" + type(exc).__name__, n, exc)
                await asyncio.sleep(0.001)
                return
            started = time.perf_counter()
            outstanding[slot] = n
            try:
                r = await ses.client.copy(
                    ses.dst.region,
                    ses.src.region,
                    n,
                    dst_offset=off,
                    src_offset=off,
                    priority=prof.cls,
                    deadline_ms=prof.deadline_ms,
                )
            except ConnectionClosed as exc:
                broken = True
                stats.error(type(exc).__name__, n, exc)
                return
            except PriodError as exc:
                stats.error(type(exc).__name__, n, exc)
                await asyncio.sleep(0.001)  # a refused closed loop must not spin
                return
            finally:
                outstanding.pop(slot, None)
            now = time.perf_counter()
            if r.nbytes != n:
                stats.bytes_lost += abs(n - r.nbytes)
            try:
                bad = await ses.checker.check(ses.dst, off, n, key)
            except PriodError as exc:
                stats.bytes_unverified += n
                stats.error("aux:" + type(exc).__name__, n, exc)
                if isinstance(exc, ConnectionClosed):
                    broken = True
                bad = 0
            else:
                stats.bytes_verified += n
            if bad:
                stats.bytes_corrupted += bad
                stats.copies_corrupted += 1
            stats.ok += 1
            stats.bytes += n
            stats.lat_us.append(round((now - started) * 1e6, 1))
            stats.daemon_us.append(r.total_us)
            stats.t_done.append(round(now - start, 4))
            stats.sizes.append(n)
            if r.path == "express":
                stats.express += 1

        def restart_error(kind: str, exc: BaseException) -> None:
            stats.restart_errors[kind] = stats.restart_errors.get(kind, 0) + 1
            if not stats.first_restart_error:
                stats.first_restart_error = f"{kind}: {exc}"

        async def next_daemon(ses: Session, generation: int, kind: str) -> None:
            """After ``shutting_down``: wait until the client is on the next daemon (sent again
            at once, the copy would be refused again by the one that is stopping)."""
            if kind == "shutting_down":
                until = time.monotonic() + spec.get("reconnect_s", 30.0)
                while ses.client.generation == generation and time.monotonic() < until:
                    await asyncio.sleep(0.01)

        async def aux(ses: Session, op: Callable[[], Awaitable[T]]) -> T:
            """A staging copy (or none, where both ends are mapped), tried again through restarts."""
            for attempt in range(1 + spec.get("restart_resubmits", 3)):
                generation = ses.client.generation
                try:
                    return await op()
                except PriodError as exc:
                    kind = restart_kind(exc)
                    if kind is None or attempt == spec.get("restart_resubmits", 3):
                        raise
                    restart_error("aux:" + kind, exc)
                    await next_daemon(ses, generation, kind)
            raise AssertionError("unreachable")

        async def one_through_restarts(ses: Session, slot: int, off: int, n: int, key: int) -> None:
            """One copy while the daemon is restarted under it (--kill-every). Its destination
            range first gets "old bytes"; a success must leave exactly the new ones (old ones
            left: a false success; anything else: corrupted) and its source unchanged; a
            documented restart error must leave old or new words only, and the copy is sent
            again (up to ``restart_resubmits`` times). Any other error counts as before."""
            nonlocal broken
            old = key ^ OLD_XOR
            for attempt in range(1 + spec.get("restart_resubmits", 3)):
                if attempt == 1:
                    stats.restart_retried += 1
                try:
                    await aux(ses, lambda: ses.checker.fill(ses.src, off, n, key))
                    await aux(ses, lambda: ses.checker.poison(ses.dst, off, n, old))
                except PriodError as exc:
                    broken = broken or isinstance(exc, ConnectionClosed)
                    stats.error("aux:" + type(exc).__name__, n, exc)
                    await asyncio.sleep(0.001)
                    return
                started = time.perf_counter()
                outstanding[slot] = n
                generation = ses.client.generation
                try:
                    r = await ses.client.copy(
                        ses.dst.region,
                        ses.src.region,
                        n,
                        dst_offset=off,
                        src_offset=off,
                        priority=prof.cls,
                        deadline_ms=prof.deadline_ms,
                    )
                except PriodError as exc:
                    kind = restart_kind(exc)
                    if kind is None:
                        broken = broken or isinstance(exc, ConnectionClosed)  # it gave up reconnecting
                        stats.error(type(exc).__name__, n, exc)
                        await asyncio.sleep(0.001)
                        return
                    restart_error(kind, exc)
                    await next_daemon(ses, generation, kind)
                    try:  # an interrupted copy leaves old or new words in its range, nothing else
                        _, neither = await aux(ses, lambda: ses.checker.classify(ses.dst, off, n, key, old))
                    except PriodError:
                        stats.bytes_unverified += n
                        neither = 0
                    if neither:
                        stats.bytes_corrupted += neither
                        stats.copies_corrupted += 1
                    continue
                finally:
                    outstanding.pop(slot, None)
                now = time.perf_counter()
                if r.nbytes != n:
                    stats.bytes_lost += abs(n - r.nbytes)
                    stats.copies_lost += 1
                try:
                    still_old, neither = await aux(ses, lambda: ses.checker.classify(ses.dst, off, n, key, old))
                    if ses.src.mapped:  # a copy must not write its source
                        neither += count_bad(ses.src.array[off : off + n], key, ses.checker.scratch)
                except PriodError as exc:
                    stats.bytes_unverified += n
                    stats.error("aux:" + type(exc).__name__, n, exc)
                    still_old = neither = 0
                else:
                    stats.bytes_verified += n
                if still_old:
                    stats.copies_false_success += 1
                    stats.bytes_false_success += still_old
                if neither:
                    stats.bytes_corrupted += neither
                    stats.copies_corrupted += 1
                if attempt:
                    stats.restart_retry_ok += 1
                stats.ok += 1
                stats.bytes += n
                stats.lat_us.append(round((now - started) * 1e6, 1))
                stats.daemon_us.append(r.total_us)
                stats.t_done.append(round(now - start, 4))
                stats.sizes.append(n)
                if r.path == "express":
                    stats.express += 1
                return
            stats.restart_gave_up += 1

        async def closed_loop(ses: Session, slot: int) -> None:
            while more():
                await one(ses, slot)

        due = time.perf_counter()

        async def open_loop(ses: Session) -> None:
            nonlocal due
            free: asyncio.Queue[int] = asyncio.Queue()
            for s in range(prof.slots):
                free.put_nowait(s)
            running: set[asyncio.Task[None]] = set()
            while True:
                due += rng.expovariate(prof.rate)
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not more():
                    break
                if free.empty():
                    stats.late += 1
                slot = await free.get()
                if not more():
                    break

                async def run_slot(s: int) -> None:
                    try:
                        await one(ses, s)
                    finally:
                        free.put_nowait(s)

                t = asyncio.ensure_future(run_slot(slot))
                running.add(t)
                t.add_done_callback(running.discard)
            if running:
                await asyncio.wait(set(running))

        async def progress() -> None:
            sent = 0
            while True:
                await asyncio.sleep(spec.get("progress_s", 1.0))
                lat = stats.lat_us[sent:]
                sent += len(lat)
                _emit(progress_message(idx, stats, lat))

        reporter = asyncio.ensure_future(progress())
        try:
            while True:
                if session is None:
                    try:
                        session = await open_session_through_restarts(spec, prof, stats, total)
                    except PriodError as exc:
                        stats.error("reconnect:" + type(exc).__name__, 0, exc)
                        break
                    stats.reconnects += 1
                epoch_issued = 0
                main: asyncio.Future[Any] = asyncio.ensure_future(
                    open_loop(session)
                    if prof.rate > 0
                    else asyncio.gather(*(closed_loop(session, s) for s in range(prof.slots)))
                )
                remaining = end - time.perf_counter()
                done, _ = await asyncio.wait({main}, timeout=max(0.0, remaining) + spec.get("drain_s", 30.0))
                if not done:
                    # Copies still without a reply after the drain time: lost, as far as this client knows.
                    for n in outstanding.values():
                        stats.bytes_lost += n
                        stats.copies_lost += 1
                        stats.errors["NoReply"] = stats.errors.get("NoReply", 0) + 1
                    main.cancel()
                    await asyncio.gather(main, return_exceptions=True)
                    break
                main.result()
                if (
                    not prof.churn
                    or broken
                    or time.perf_counter() >= end
                    or (max_requests and stats.issued >= max_requests)
                ):
                    break
                stats.client_reconnects += session.client.reconnects
                stats.landed_replies += session.client.landed_replies
                await session.client.close()
                session = None
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        stats.elapsed_s = time.perf_counter() - start
        if broken or session is None:
            stats.alive, stats.alive_why = False, stats.first_error or "its session could not be opened again"
        elif restarts:
            # Alive at the end: the connection (reconnected by itself as often as it took) answers.
            try:
                await asyncio.wait_for(session.client.ping(), spec.get("reconnect_s", 30.0) + 5)
            except (PriodError, TimeoutError) as exc:
                stats.alive, stats.alive_why = False, f"no ping after the load: {type(exc).__name__}: {exc}"
        stats.fds_end = own_fds()
        if session is not None:
            stats.client_reconnects += session.client.reconnects
            stats.landed_replies += session.client.landed_replies
        return stats
    finally:
        if session is not None:
            await session.client.close()


def run_sync_worker(spec: dict[str, Any]) -> WorkerStats:
    """A `SyncClient` client (``api=sync``): one copy at a time, open loop at ``rate`` (or back to
    back), its regions mapped in this process (the sim engine). With --kill-every it checks each
    copy as `run_worker`'s ``one_through_restarts`` does; the blocking client finds a lost
    connection at its next request and reconnects there."""
    prof = Profile(**spec["profile"])
    idx: int = spec["client"]
    stats = WorkerStats(idx, prof.name, prof.cls, prof.direction, os.getpid())
    rng = random.Random(spec["seed"] * 7919 + idx)
    sizes = SizeDist(prof.size)
    restarts = bool(spec.get("restarts"))
    reconnect_s = spec.get("reconnect_s", 30.0)
    resubmits = spec.get("restart_resubmits", 3)
    t0 = time.perf_counter()
    wait_until = time.monotonic() + spec.get("connect_wait_s", 10.0)
    while True:
        try:
            client = SyncClient(
                spec["socket"],
                name=f"loadtest/{idx}/{prof.name}/sync",
                copy_path="daemon",
                reconnect_s=reconnect_s,
                retry_copies=spec.get("retry_copies", False),
            )
            break
        except ConnectionClosed:
            if time.monotonic() >= wait_until:
                raise
            time.sleep(0.05)
    try:
        total = -(-sizes.max // SLOT_ALIGN) * SLOT_ALIGN
        host, dev = client.alloc_host(total), client.alloc_device(total, prof.device)
        src, dst = {"h2d": (host, dev), "d2h": (dev, host), "d2d": (dev, None)}[prof.direction]
        if dst is None:
            dst = client.alloc_device(total, prof.device)
        if src.array is None or dst.array is None or spec["verify"] == "staged":
            raise PriodError("api=sync needs regions mapped in the client (the sim engine) and --verify auto")
        src_a, dst_a = src.array, dst.array
        src_a[::4096] = 0
        dst_a[::4096] = 0
        stats.setup_s = time.perf_counter() - t0
        _emit({"type": "ready", "client": idx, "verify": "mapped"})
        go = json.loads(sys.stdin.readline() or "{}")
        if "start" not in go:
            return stats
        time.sleep(max(0.0, go["start"] - time.time()))
        start = time.perf_counter()
        end = start + (go["end"] - go["start"])
        max_requests = prof.requests or spec.get("requests", 0) or 0
        scratch = np.empty(BLOCK_WORDS, dtype=np.uint64)
        stats.fds_start = own_fds()
        due, sent, next_progress = start, 0, start + spec.get("progress_s", 1.0)
        broken = False

        def progress() -> None:
            nonlocal sent
            lat = stats.lat_us[sent:]
            sent += len(lat)
            _emit(progress_message(idx, stats, lat))

        def next_daemon(generation: int) -> None:
            # A stopping daemon refuses copies until it closes the connection; the blocking client
            # finds that at a request and reconnects there.
            until = time.monotonic() + reconnect_s
            while client.generation == generation and time.monotonic() < until:
                time.sleep(0.02)
                try:
                    client.ping()
                except PriodError as exc:
                    if restart_kind(exc) is None and not isinstance(exc, ConnectionClosed):
                        raise

        while not broken and time.perf_counter() < end and not (max_requests and stats.issued >= max_requests):
            if prof.rate > 0:
                due += rng.expovariate(prof.rate)
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                elif delay < 0:
                    stats.late += 1
            if time.perf_counter() >= next_progress:
                progress()
                next_progress += spec.get("progress_s", 1.0)
            n = sizes.sample(rng)
            key = request_key(idx, stats.issued + 1)
            old = key ^ OLD_XOR
            stats.issued += 1
            write_pattern(src_a[:n], key)
            for attempt in range(1 + (resubmits if restarts else 0)):
                if restarts:
                    write_pattern(dst_a[:n], old)
                if attempt == 1:
                    stats.restart_retried += 1
                generation = client.generation
                started = time.perf_counter()
                try:
                    r = client.copy(dst, src, n, priority=prof.cls, deadline_ms=prof.deadline_ms)
                except PriodError as exc:
                    kind = restart_kind(exc) if restarts else None
                    if kind is None:
                        broken = isinstance(exc, ConnectionClosed)
                        stats.error(type(exc).__name__, n, exc)
                        break
                    stats.restart_errors[kind] = stats.restart_errors.get(kind, 0) + 1
                    stats.first_restart_error = stats.first_restart_error or f"{kind}: {exc}"
                    neither = classify_words(dst_a[:n], key, old, scratch)[1]
                    if neither:
                        stats.bytes_corrupted += neither
                        stats.copies_corrupted += 1
                    if kind == "shutting_down":
                        next_daemon(generation)
                    continue
                now = time.perf_counter()
                if r.nbytes != n:
                    stats.bytes_lost += abs(n - r.nbytes)
                    stats.copies_lost += 1
                if restarts:
                    still_old, neither = classify_words(dst_a[:n], key, old, scratch)
                    neither += count_bad(src_a[:n], key, scratch)
                else:
                    still_old, neither = 0, count_bad(dst_a[:n], key, scratch)
                if still_old:
                    stats.copies_false_success += 1
                    stats.bytes_false_success += still_old
                if neither:
                    stats.bytes_corrupted += neither
                    stats.copies_corrupted += 1
                stats.restart_retry_ok += attempt > 0
                stats.bytes_verified += n
                stats.ok += 1
                stats.bytes += n
                stats.lat_us.append(round((now - started) * 1e6, 1))
                stats.daemon_us.append(r.total_us)
                stats.t_done.append(round(now - start, 4))
                stats.sizes.append(n)
                break
            else:
                stats.restart_gave_up += 1
        stats.elapsed_s = time.perf_counter() - start
        if broken:
            stats.alive, stats.alive_why = False, stats.first_error
        elif restarts:
            try:
                client.ping()
            except PriodError as exc:
                stats.alive, stats.alive_why = False, f"no ping after the load: {type(exc).__name__}: {exc}"
        stats.fds_end = own_fds()
        stats.client_reconnects = client.reconnects
        stats.landed_replies = client.landed_replies
        return stats
    finally:
        client.close()


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        import uvloop

        runner = uvloop.run if spec.get("loop", "uvloop") == "uvloop" else asyncio.run
    except ImportError:
        runner = asyncio.run
    try:
        stats = run_sync_worker(spec) if spec["profile"].get("api") == "sync" else runner(run_worker(spec))
    except PriodError as exc:
        _emit({"type": "fatal", "client": spec["client"], "error": f"{type(exc).__name__}: {exc}"})
        return 1
    # The result carries every latency (hundreds of KB). Through the stdout pipe such a line came
    # cut short twice (on the GPU machine, then in CI; the cause is not pinned down), so it goes
    # to a file, written whole and renamed into place, and the pipe carries only its name.
    path = spec.get("result_path")
    if path:
        with open(path + ".tmp", "w") as fp:
            json.dump({"type": "result", **asdict(stats)}, fp, separators=(",", ":"))
        os.replace(path + ".tmp", path)
        _emit({"type": "result", "file": path})
    else:
        _emit({"type": "result", **asdict(stats)})
    return 0


# -- the daemon, watched from outside -------------------------------------------------------


class Monitor:
    """Samples the daemon: /proc figures, a ping's round trip, and status() totals."""

    def __init__(self, path: str, pid: int) -> None:
        self.path, self.pid = path, pid
        self.client: SyncClient | None = None
        self.samples: list[dict[str, float]] = []
        self.daemon = 0
        """Which daemon the samples are of: 0, then 1, 2, ... after each restart (--kill-every)."""
        self._connect()

    def _connect(self) -> None:
        try:
            # No reconnecting by itself: a sample must not wait for a daemon that is being restarted.
            self.client = SyncClient(self.path, copy_path="daemon", name="loadtest/monitor", timeout=10, reconnect_s=0)
        except PriodError:
            self.client = None

    def attach(self, pid: int) -> None:
        """Watch the daemon that replaced the last one (--kill-every)."""
        if self.client is not None:
            self.client.close()
        self.pid = pid
        self.daemon += 1
        self._connect()

    def sample(self, t: float) -> dict[str, float]:
        s: dict[str, float] = {"t": round(t, 3), "daemon": self.daemon, **memory_and_fds(self.pid)}
        if self.client is not None:
            try:
                t0 = time.perf_counter()
                self.client.ping()
                s["ping_us"] = round((time.perf_counter() - t0) * 1e6, 1)
                st = self.client.status()
                s["clients"] = len(st["clients"])
                s["pinned_mib"] = sum(c["pinned_bytes"] for c in st["clients"]) / (1 << 20)
                s["device_mib"] = sum(c["device_bytes"] for c in st["clients"]) / (1 << 20)
                s["refused"] = st["totals"]["refused"]
                s["protocol_errors"] = st["totals"]["protocol_errors"]
            except (PriodError, OSError):
                self.client = None
        self.samples.append(s)
        return s

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def daemon_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"PRIOD_LOG__LEVEL": json.dumps(args.daemon_log_level)}
    for item in args.daemon_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


@contextmanager
def daemon_for(args: argparse.Namespace) -> Iterator[tuple[str, int, Restarts | None]]:
    """The socket and pid of the daemon under test: our own (--spawn-daemon) or a running one;
    with --kill-every, the `Restarts` that kill it and start it again."""
    if args.kill_every:
        with Restarts(args) as restarts:
            yield restarts.path, restarts.pid, restarts
    elif args.spawn_daemon:
        with daemon_process(daemon_env(args), backend=args.backend) as d:
            yield d.socket_path, d.proc.pid, None
        if d.proc.returncode not in (0, None):
            print(f"loadtest: the daemon exited with {d.proc.returncode}; its log:\n{d.log()[-4000:]}", file=sys.stderr)
    else:
        path = args.socket or os.environ.get("PRIOD_SOCKET") or ""
        if not path:
            raise SystemExit("loadtest: pass --socket PATH or --spawn-daemon")
        yield path, daemon_pid(path), None


def parse_kill_every(text: str) -> tuple[float, float]:
    """``10-20`` (seconds, uniform) or ``15`` -> (low, high)."""
    lo, sep, hi = text.partition("-")
    try:
        low, high = float(lo), float(hi) if sep else float(lo)
    except ValueError:
        raise ValueError(f"--kill-every {text!r}: give seconds, e.g. 10-20 (uniform between) or 15") from None
    if not 0 < low <= high:
        raise ValueError(f"--kill-every {text!r}: give 0 < low <= high seconds, e.g. 10-20")
    return low, high


class Restarts:
    """--kill-every: our own daemon, killed every low-high seconds (uniform) with SIGKILL or
    SIGTERM (``--kill-signal``; mixed: the two alternately) while the load runs, and a new one
    started at once on the same socket path, as systemd's ``Restart=`` or a DaemonSet would."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.low, self.high = parse_kill_every(args.kill_every)
        self.signal = args.kill_signal
        self.env, self.backend = daemon_env(args), args.backend
        self.rng = random.Random(args.seed * 104729)
        self.dir = tempfile.mkdtemp(prefix="priod-restarts-")
        self.path = os.path.join(self.dir, "priod.sock")
        self.events: list[dict[str, Any]] = []
        self.bad_exits: list[str] = []
        self.daemon: DaemonProcess | None = None
        self._cm: Any = None
        self.index = 0
        self.next_kill = math.inf
        self.stop_at = math.inf

    @property
    def pid(self) -> int:
        assert self.daemon is not None
        return self.daemon.proc.pid

    def __enter__(self) -> Restarts:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start(self) -> None:
        self._cm = daemon_process(self.env, backend=self.backend, socket_path=self.path)
        self.daemon = self._cm.__enter__()

    def _end(self, sig: int) -> int:
        """Stop the daemon with ``sig``; its private directory goes too unless it exited
        otherwise than that signal asks (SIGKILL: killed; SIGTERM: a clean 0), whose log is kept."""
        d, cm = self.daemon, self._cm
        if d is None:
            return 0
        self.daemon = self._cm = None
        rc = d.stop(sig)
        log_dir = os.path.dirname(d.log_path)
        cm.__exit__(None, None, None)  # removes the directory of a clean stop
        expected = -signal.SIGKILL if sig == signal.SIGKILL else 0
        if rc != expected:
            self.bad_exits.append(f"daemon {self.index} (pid {d.proc.pid}) exited with {rc}; log in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
        return rc

    def schedule(self, now: float, stop_at: float) -> None:
        """Kills from ``now`` (time.monotonic) until ``stop_at``, when the load ends."""
        self.stop_at = stop_at
        self.next_kill = now + self.rng.uniform(self.low, self.high)

    def due(self, now: float) -> bool:
        return now >= self.next_kill and now < self.stop_at

    def restart(self, t: float) -> dict[str, Any]:
        """Kill (or stop) the daemon and start a new one on the same path; the event's record."""
        if self.signal != "mixed":
            name = self.signal
        elif not self.events:
            name = self.rng.choice(("KILL", "TERM"))
        else:  # alternately, so that a short run has both
            name = "TERM" if self.events[-1]["signal"] == "KILL" else "KILL"
        sig = signal.SIGKILL if name == "KILL" else signal.SIGTERM
        old_pid = self.pid
        t0 = time.monotonic()
        rc = self._end(sig)
        t1 = time.monotonic()
        self.index += 1
        self._start()
        t2 = time.monotonic()
        event = {
            "t": round(t, 2),
            "signal": name,
            "old_pid": old_pid,
            "exit": rc,
            "new_pid": self.pid,
            "stop_ms": round((t1 - t0) * 1e3, 1),
            "down_ms": round((t2 - t0) * 1e3, 1),
        }
        self.events.append(event)
        self.next_kill = t2 + self.rng.uniform(self.low, self.high)
        return event

    def report(self) -> dict[str, Any]:
        down = [e["down_ms"] for e in self.events]
        return {
            "every_s": [self.low, self.high],
            "signal": self.signal,
            "count": len(self.events),
            "by_signal": {k: sum(e["signal"] == k for e in self.events) for k in ("KILL", "TERM")},
            "down_ms": summarize(down, ("p50", "max"), ndigits=1, empty=None),
            "unexpected_exits": self.bad_exits,
            "events": self.events,
        }


# -- aggregation ----------------------------------------------------------------------------


LATENCY_KEYS = ("p50", "p99", "p99.9", "max", "mean")
"""The figures of a latency summary in the report, microseconds to 0.1, None where there are none."""


def lat_summary(values: list[float]) -> dict[str, float | None]:
    return summarize(values, LATENCY_KEYS, ndigits=1, empty=None)


def aggregate(results: list[dict[str, Any]], elapsed: float) -> dict[str, dict[str, Any]]:
    """Per-class figures from the clients' raw results."""
    classes: dict[str, dict[str, Any]] = {}
    for r in results:
        c = classes.setdefault(
            r["cls"],
            {
                "clients": 0,
                "lat": [],
                "daemon": [],
                "requests": 0,
                "bytes": 0,
                "express": 0,
                "errors": {},
                "bytes_corrupted": 0,
                "copies_corrupted": 0,
                "bytes_lost": 0,
                "bytes_unverified": 0,
                "bytes_verified": 0,
                "aux_bytes": 0,
                "late": 0,
                "directions": set(),
                "restart_errors": {},
                "restart_retried": 0,
                "restart_retry_ok": 0,
                "restart_gave_up": 0,
                "copies_lost": 0,
                "copies_false_success": 0,
                "bytes_false_success": 0,
                "alive": 0,
            },
        )
        c["clients"] += 1
        c["alive"] += bool(r.get("alive", True))
        for k, v in r.get("restart_errors", {}).items():
            c["restart_errors"][k] = c["restart_errors"].get(k, 0) + v
        for k in (
            "restart_retried",
            "restart_retry_ok",
            "restart_gave_up",
            "copies_lost",
            "copies_false_success",
            "bytes_false_success",
        ):
            c[k] += r.get(k, 0)
        c["directions"].add(r["direction"])
        c["lat"] += r["lat_us"]
        c["daemon"] += r["daemon_us"]
        c["requests"] += r["ok"]
        c["bytes"] += r["bytes"]
        c["express"] += r["express"]
        for k, v in r["errors"].items():
            c["errors"][k] = c["errors"].get(k, 0) + v
        for k in (
            "bytes_corrupted",
            "copies_corrupted",
            "bytes_lost",
            "bytes_unverified",
            "bytes_verified",
            "aux_bytes",
            "late",
        ):
            c[k] += r[k]
    out: dict[str, dict[str, Any]] = {}
    for name, c in classes.items():
        out[name] = {
            "clients": c["clients"],
            "directions": sorted(c["directions"]),
            "requests": c["requests"],
            "bytes": c["bytes"],
            "requests_per_s": round(c["requests"] / elapsed, 2) if elapsed else 0.0,
            "throughput_gbps": round(c["bytes"] / elapsed / 1e9, 4) if elapsed else 0.0,
            "latency_us": lat_summary(c["lat"]),
            "daemon_total_us": lat_summary(c["daemon"]),
            "express_fraction": round(c["express"] / c["requests"], 3) if c["requests"] else 0.0,
            "errors": c["errors"],
            "bytes_verified": c["bytes_verified"],
            "bytes_corrupted": c["bytes_corrupted"],
            "copies_corrupted": c["copies_corrupted"],
            "bytes_lost": c["bytes_lost"],
            "bytes_unverified": c["bytes_unverified"],
            "aux_bytes": c["aux_bytes"],
            "late_arrivals": c["late"],
            "restart": {
                "verified": c["requests"],
                "restart_errors": c["restart_errors"],
                "resubmitted": c["restart_retried"],
                "resubmitted_ok": c["restart_retry_ok"],
                "gave_up": c["restart_gave_up"],
                "lost": c["copies_lost"],
                "corrupted": c["copies_corrupted"],
                "false_successes": c["copies_false_success"],
                "bytes_false_success": c["bytes_false_success"],
                "clients": c["clients"],
                "alive": c["alive"],
            },
        }
    return out


def throughput_series(results: list[dict[str, Any]], elapsed: float, bin_s: float) -> dict[str, Any]:
    nbins = max(1, math.ceil(elapsed / bin_s))
    series: dict[str, list[float]] = {}
    for r in results:
        s = series.setdefault(r["cls"], [0.0] * nbins)
        for t, n in zip(r["t_done"], r["sizes"], strict=False):
            s[min(nbins - 1, int(t / bin_s))] += n
    return {"bin_s": bin_s, "gbps": {k: [round(b / bin_s / 1e9, 4) for b in v] for k, v in series.items()}}


def window_latency(
    results: list[dict[str, Any]], elapsed: float, windows: int
) -> dict[str, list[dict[str, float | None]]]:
    """Per class: p50/p99 of client latency in each of ``windows`` equal slices of the run."""
    width = elapsed / windows if windows else elapsed
    out: dict[str, list[dict[str, float | None]]] = {}
    per: dict[str, list[list[float]]] = {}
    for r in results:
        w = per.setdefault(r["cls"], [[] for _ in range(windows)])
        for t, lat in zip(r["t_done"], r["lat_us"], strict=False):
            w[min(windows - 1, int(t / width))].append(lat)
    for cls, ws in per.items():
        out[cls] = [
            {"t": round((i + 0.5) * width, 2), **summarize(v, ("n", "p50", "p99"), ndigits=1, empty=None)}
            for i, v in enumerate(ws)
        ]
    return out


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    """Theil-Sen slope (the median of pairwise slopes), per minute: a sample caught while a
    client reconnects does not tilt it, as it would a least-squares fit."""
    t, y = np.asarray(ts, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    i, j = np.triu_indices(len(t), 1)
    dt = t[j] - t[i]
    ok = dt > 0
    if not ok.any():
        return 0.0
    return round(float(np.median((y[j] - y[i])[ok] / dt[ok])) * 60, 3)


def soak_verdict(
    samples: list[dict[str, float]], windows: dict[str, list[dict[str, float | None]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Do RSS, open fds and latency stay flat? First vs last window, after a warm-up, and slopes."""
    steady = [s for s in samples if s["t"] >= args.soak_warmup_s and "VmRSS" in s]
    problems: list[str] = []
    out: dict[str, Any] = {"warmup_s": args.soak_warmup_s, "samples": len(steady)}
    if len(steady) < 4:
        return {**out, "flat": False, "problems": ["too few samples after warm-up; run longer"]}
    k = max(1, len(steady) // 5)
    first, last = steady[:k], steady[-k:]

    def mean(rows: list[dict[str, float]], key: str) -> float:
        # The median: a sample taken while a client reconnects must not move the window.
        vals = [r[key] for r in rows if key in r]
        return round(float(np.median(vals)), 2) if vals else float("nan")

    ts = [s["t"] for s in steady]
    for key, unit in (("VmRSS", "MiB"), ("RssAnon", "MiB"), ("fds", "fds")):
        if not all(key in s for s in steady):
            continue
        f, l_ = mean(first, key), mean(last, key)
        out[key] = {
            "first": f,
            "last": l_,
            "growth": round(l_ - f, 2),
            "slope_per_min": slope_per_min(ts, [s[key] for s in steady]),
            "max": max(s[key] for s in steady),
            "unit": unit,
        }
    if "RssAnon" in out:
        allowed = max(args.soak_rss_mib, 0.05 * out["RssAnon"]["first"])
        if out["RssAnon"]["growth"] > allowed:
            problems.append(
                f"anonymous RSS grew {out['RssAnon']['growth']} MiB first-to-last window (allowed {allowed:.1f})"
            )
    if "fds" in out and out["fds"]["growth"] > args.soak_fds:
        problems.append(f"open fds grew by {out['fds']['growth']} first-to-last window (allowed {args.soak_fds})")
    out["latency_us"] = latency_flat(windows, args, problems)
    out["problems"] = problems
    out["flat"] = not problems
    return out


def latency_flat(
    windows: dict[str, list[dict[str, float | None]]], args: argparse.Namespace, problems: list[str]
) -> dict[str, Any]:
    """Each class's p50 and p99 in the first and last latency window after the warm-up; a
    problem where the last p50 exceeds ``--soak-latency-factor`` times the first + 0.5 ms."""
    lat: dict[str, Any] = {}
    for cls, ws in windows.items():
        ws = [w for w in ws if w["t"] is not None and w["t"] >= args.soak_warmup_s and w["n"]]
        if len(ws) < 2:
            continue
        f50, l50 = ws[0]["p50"], ws[-1]["p50"]
        lat[cls] = {"first_p50": f50, "last_p50": l50, "first_p99": ws[0]["p99"], "last_p99": ws[-1]["p99"]}
        if f50 is not None and l50 is not None and l50 > args.soak_latency_factor * f50 + 500:
            problems.append(f"{cls} p50 latency went from {f50} us to {l50} us first-to-last window")
    return lat


RESTART_SOAK_NOTE = (
    "the daemon was restarted every {low:g}-{high:g} s, so no daemon lives long enough for the soak's "
    "first-to-last window over the run: RSS and fds are checked per daemon (over its life once its "
    "clients are back, {settle:g} s after it listens: catches only fast leaks; a slow leak needs the "
    "soak without --kill-every) and across daemons (each daemon's settled median against the first's: "
    "every client registers the same regions again, so more means a region registered twice); the "
    "clients' own fds are checked from the start of the load to its end, across every reconnect; "
    "latency first-to-last window as without restarts"
)


def soak_verdict_restarts(
    samples: list[dict[str, float]],
    windows: dict[str, list[dict[str, float | None]]],
    results: list[dict[str, Any]],
    events: list[dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The soak's flatness checks where the daemon is restarted under the load (see
    `RESTART_SOAK_NOTE`): per daemon, across daemons, the clients' own fds, and latency."""
    low, high = parse_kill_every(args.kill_every)
    settle = args.soak_daemon_settle_s
    problems: list[str] = []
    starts = [0.0] + [e["t"] + e["down_ms"] / 1e3 for e in events]
    ends = [e["t"] for e in events] + [args.duration]
    per: list[dict[str, Any]] = []
    for k, (t0, t1) in enumerate(zip(starts, ends, strict=True)):
        rows = [s for s in samples if s.get("daemon") == k and t0 + settle <= s["t"] <= t1 and "fds" in s]
        d: dict[str, Any] = {"daemon": k, "from_s": round(t0, 2), "to_s": round(t1, 2), "samples": len(rows)}
        for key in ("RssAnon", "fds"):
            vals = [r[key] for r in rows if key in r]
            if not vals:
                continue
            d[key] = {"median": round(float(np.median(vals)), 2)}
            third = len(vals) // 3
            if third >= 2:
                first, last = float(np.median(vals[:third])), float(np.median(vals[-third:]))
                d[key].update(first=round(first, 2), last=round(last, 2), growth=round(last - first, 2))
        per.append(d)
        if "RssAnon" in d and "growth" in d["RssAnon"]:
            allowed = max(args.soak_rss_mib, 0.05 * d["RssAnon"]["first"])
            if d["RssAnon"]["growth"] > allowed:
                problems.append(
                    f"daemon {k}: anonymous RSS grew {d['RssAnon']['growth']} MiB over its life (allowed {allowed:.1f})"
                )
        if "fds" in d and "growth" in d["fds"] and d["fds"]["growth"] > args.soak_fds:
            problems.append(
                f"daemon {k}: open fds grew by {d['fds']['growth']} over its life (allowed {args.soak_fds})"
            )
    settled = [d for d in per if "fds" in d]
    across: dict[str, Any] = {}
    if len(settled) >= 2:
        ref = settled[0]
        for key, allowed in (("fds", args.soak_fds), ("RssAnon", None)):
            meds = [d[key]["median"] for d in settled if key in d]
            if not meds or key not in ref:
                continue
            across[key] = {"first": meds[0], "min": min(meds), "max": max(meds), "last": meds[-1]}
            bound = allowed if allowed is not None else max(args.soak_rss_mib, 0.05 * ref[key]["median"])
            for d in settled[1:]:
                if key in d and d[key]["median"] - ref[key]["median"] > bound:
                    problems.append(
                        f"daemon {d['daemon']} settled at {d[key]['median']} {key} against the first daemon's "
                        f"{ref[key]['median']} (allowed +{bound:g})"
                    )
    client_fds = {r["client"]: r.get("fds_end", 0) - r.get("fds_start", 0) for r in results}
    for client, growth in client_fds.items():
        if growth > args.soak_client_fds:
            problems.append(
                f"client {client} holds {growth} more fds at the end of the load than at its start "
                f"(allowed {args.soak_client_fds})"
            )
    out: dict[str, Any] = {
        "mode": "restarts",
        "note": RESTART_SOAK_NOTE.format(low=low, high=high, settle=settle),
        "warmup_s": args.soak_warmup_s,
        "samples": sum(d["samples"] for d in per),
        "per_daemon": per,
        "across_daemons": across,
        "client_fds_growth": client_fds,
    }
    out["latency_us"] = latency_flat(windows, args, problems)
    out["problems"] = problems
    out["flat"] = not problems
    return out


# -- plots ----------------------------------------------------------------------------------


def plot(report: dict[str, Any], results: list[dict[str, Any]], out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("loadtest: matplotlib is not installed; no plots", file=sys.stderr)
        return []
    files = []
    by_cls: dict[str, list[float]] = {}
    for r in results:
        by_cls.setdefault(r["cls"], []).extend(r["lat_us"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cls, lat in sorted(by_cls.items()):
        if not lat:
            continue
        xs = np.sort(np.asarray(lat)) / 1e3
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=f"{cls} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("client latency (ms, log)")
    ax.set_ylabel("fraction of copies")
    ax.set_title(f"latency CDF per class — {report['backend']}, {report['n_clients']} clients")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)

    tp = report["throughput_over_time"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cls, ys in sorted(tp["gbps"].items()):
        xs = np.arange(len(ys)) * tp["bin_s"]
        ax.step(xs, ys, where="post", label=cls)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GB/s (completed copies)")
    ax.set_title("throughput over time per class")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)

    samples = report["daemon"]["samples"]
    if samples:
        fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
        ts = [s["t"] for s in samples]
        for key, label in (("VmRSS", "RSS"), ("RssAnon", "anonymous RSS")):
            axes[0].plot(ts, [s.get(key, float("nan")) for s in samples], label=label)
        axes[0].set_ylabel("MiB")
        axes[0].legend()
        axes[1].plot(ts, [s.get("fds", float("nan")) for s in samples])
        axes[1].set_ylabel("open fds")
        for cls, ws in sorted(report["latency_windows"].items()):
            axes[2].plot(
                [w["t"] for w in ws],
                [w["p50"] if w["p50"] is not None else float("nan") for w in ws],
                marker="o",
                label=f"{cls} p50",
            )
        axes[2].set_yscale("log")
        axes[2].set_ylabel("latency (us)")
        axes[2].set_xlabel("time (s)")
        axes[2].legend(fontsize="small")
        for a in axes:
            a.grid(True, alpha=0.3)
        axes[0].set_title("daemon over time" + (" (soak)" if report.get("soak") else ""))
        fig.tight_layout()
        path = os.path.join(out_dir, "soak.png" if report.get("soak") else "daemon.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


# -- the parent -----------------------------------------------------------------------------


def build_profiles(args: argparse.Namespace) -> list[Profile]:
    specs = args.client or list(SOAK_MIX if args.soak else DEFAULT_MIX) + list(RESTART_EXTRA if args.kill_every else ())
    profiles = [parse_profile(s) for s in specs]
    clients: list[Profile] = []
    for p in profiles:
        clients += [p] * p.count
    if not args.client and args.clients:
        clients = [profiles[i % len(profiles)] for i in range(args.clients)]
    return clients


def _result(msg: dict[str, Any]) -> dict[str, Any]:
    """A client's result: the message itself, or the file it names (removed once read)."""
    if "file" not in msg:
        return msg
    with open(msg["file"]) as fp:
        result: dict[str, Any] = json.load(fp)
    os.unlink(msg["file"])
    return result


def _reader(idx: int, stream: Any, q: queue.Queue[tuple[int, dict[str, Any] | None]]) -> None:
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            q.put((idx, json.loads(line)))
        except json.JSONDecodeError:
            print(f"[client {idx}] {line}", file=sys.stderr)
    q.put((idx, None))


def progress_line(t: float, duration: float, per_cls: dict[str, dict[str, Any]], sample: dict[str, float]) -> str:
    parts = []
    for cls, c in sorted(per_cls.items()):
        recent = c["recent"]
        p99 = f"{percentile(recent, 99) / 1e3:.2f}ms" if recent else "-"
        gbps = (c["bytes"] - c["bytes_prev"]) / max(c["dt"], 1e-9) / 1e9
        parts.append(f"{cls} {c['ok']} ok {gbps:.2f}GB/s p99 {p99}")
    errs = sum(c["errors"] for c in per_cls.values())
    bad = sum(c["bad"] for c in per_cls.values())
    daemon = f"rss {sample.get('VmRSS', 0):.0f}MiB fds {sample.get('fds', 0):.0f}" if sample else ""
    return f"[{t:6.1f}/{duration:.0f}s] " + " | ".join(parts) + f" | errors {errs} corrupt {bad} | daemon {daemon}"


def run(args: argparse.Namespace) -> int:
    clients = build_profiles(args)
    os.makedirs(args.out, exist_ok=True)
    command = " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0]) if sys.argv[0] else "scripts/loadtest.py", *sys.argv[1:]]
    )
    print(
        f"loadtest: {len(clients)} clients, {args.duration:g} s"
        + (f", at most {args.requests} copies each" if args.requests else "")
        + (" (soak)" if args.soak else ""),
        file=sys.stderr,
    )
    for i, p in enumerate(clients):
        print(f"  client {i}: {p.describe()}", file=sys.stderr)
    with daemon_for(args) as (path, pid, restarts):
        monitor = Monitor(path, pid)
        backend = monitor.client.server.backend if monitor.client else args.backend
        # The baseline once the daemon is quiet: the harness's readiness probe (our own daemon) or
        # another short-lived connection may still be closing, and would count as a leak later.
        before = monitor.sample(0.0)
        settle = time.monotonic() + 5
        while time.monotonic() < settle:
            time.sleep(0.1)
            again = monitor.sample(0.0)
            quiet = again.get("fds") == before.get("fds") and (not args.spawn_daemon or again.get("clients", 1) <= 1)
            before = again
            if quiet:
                break
        monitor.samples.clear()
        monitor.samples.append(before)
        q: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        procs: list[subprocess.Popen[str]] = []
        for i, p in enumerate(clients):
            spec = {
                "client": i,
                "profile": asdict(p),
                "socket": path,
                "seed": args.seed,
                "verify": args.verify,
                "requests": args.requests,
                "progress_s": args.progress_s,
                "drain_s": args.drain_s,
                "loop": args.loop,
                "result_path": os.path.join(args.out, f"client{i}.result.json"),
            }
            if restarts is not None:
                spec.update(
                    restarts=True,
                    reconnect_s=args.reconnect_s,
                    retry_copies=args.retry_copies,
                    connect_wait_s=args.reconnect_s,
                    restart_resubmits=args.restart_resubmits,
                )
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            procs.append(proc)
            threading.Thread(target=_reader, args=(i, proc.stdout, q), daemon=True).start()
        ready: dict[int, str] = {}
        results: dict[int, dict[str, Any]] = {}
        fatal: dict[int, str] = {}
        ended: set[int] = set()
        setup_deadline = time.monotonic() + args.setup_timeout_s
        while len(ready) + len(ended) < len(procs) and time.monotonic() < setup_deadline:
            try:
                i, msg = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg is None:
                ended.add(i)
            elif msg["type"] == "ready":
                ready[i] = msg["verify"]
            elif msg["type"] == "fatal":
                fatal[i] = msg["error"]
        if len(ready) < len(procs):
            print(
                f"loadtest: only {len(ready)} of {len(procs)} clients got ready: {fatal or 'setup timed out'}",
                file=sys.stderr,
            )
        start = time.time() + 0.3
        go = json.dumps({"start": start, "end": start + args.duration}) + "\n"
        if restarts is not None:
            mono = time.monotonic() - time.time()
            restarts.schedule(start + mono, start + args.duration + mono)
        for i, proc in enumerate(procs):
            assert proc.stdin is not None
            try:
                proc.stdin.write(go if i in ready else "{}\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass
        verify_modes = sorted(set(ready.values()))
        per_cls: dict[str, dict[str, Any]] = {}
        for p in clients:
            per_cls.setdefault(
                p.cls,
                {"ok": 0, "bytes": 0, "bytes_prev": 0, "errors": 0, "bad": 0, "recent": [], "dt": 1.0, "by_client": {}},
            )
        hard_deadline = time.monotonic() + args.duration + args.drain_s + 60
        next_sample = time.time() + args.sample_s
        next_progress = time.time() + args.progress_s
        last_progress = time.time()
        sample: dict[str, float] = before
        while len(ended) < len(procs) and time.monotonic() < hard_deadline:
            try:
                i, msg = q.get(timeout=0.1)
            except queue.Empty:
                msg = None
                i = -1
            if i >= 0:
                if msg is None:
                    ended.add(i)
                elif msg["type"] == "result":
                    results[i] = _result(msg)
                elif msg["type"] == "fatal":
                    fatal[i] = msg["error"]
                elif msg["type"] == "progress":
                    c = per_cls[clients[i].cls]
                    c["by_client"][i] = msg
                    c["recent"].extend(msg["lat_us"])
            if restarts is not None and restarts.due(time.monotonic()):
                event = restarts.restart(time.time() - start)
                pid = restarts.pid
                monitor.attach(pid)
                print(
                    f"[{event['t']:6.1f}/{args.duration:.0f}s] daemon SIG{event['signal']} (exit {event['exit']}), "
                    f"a new one listens after {event['down_ms']:.0f} ms (pid {pid})",
                    file=sys.stderr,
                    flush=True,
                )
            now = time.time()
            if now >= next_sample:
                sample = monitor.sample(now - start)
                next_sample += args.sample_s
            if now >= next_progress:
                for c in per_cls.values():
                    c["bytes_prev"] = c["bytes"]
                    c["ok"] = sum(m["ok"] for m in c["by_client"].values())
                    c["bytes"] = sum(m["bytes"] for m in c["by_client"].values())
                    c["errors"] = sum(m["errors"] for m in c["by_client"].values())
                    c["bad"] = sum(m["bad"] for m in c["by_client"].values())
                    c["dt"] = now - last_progress
                print(progress_line(now - start, args.duration, per_cls, sample), file=sys.stderr, flush=True)
                for c in per_cls.values():
                    c["recent"] = []
                last_progress = now
                next_progress += args.progress_s
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    fatal.setdefault(i, "killed: did not finish before the hard deadline")
            if proc.returncode != 0 and i not in fatal:
                fatal[i] = f"exited with {proc.returncode}"
            if i not in results and i not in fatal:
                fatal[i] = "no result"
        # Every client is gone: the daemon should be back where it started.
        after = monitor.sample(time.time() - start)
        settle = time.monotonic() + 10
        while time.monotonic() < settle and (
            after.get("fds", 0) > before.get("fds", 0) or after.get("clients", 0) > before.get("clients", 0)
        ):
            time.sleep(0.2)
            after = monitor.sample(time.time() - start)
        monitor.close()
        daemon_alive = memory_and_fds(pid) != {}

    res = [results[i] for i in sorted(results)]
    elapsed = max([r["elapsed_s"] for r in res] + [1e-9])
    bin_s = args.bin_s or max(0.25, round(elapsed / 60, 2))
    classes = aggregate(res, elapsed)
    windows = window_latency(res, elapsed, args.windows)
    totals = {
        "requests": sum(c["requests"] for c in classes.values()),
        "bytes": sum(c["bytes"] for c in classes.values()),
        "bytes_verified": sum(c["bytes_verified"] for c in classes.values()),
        "bytes_corrupted": sum(c["bytes_corrupted"] for c in classes.values()),
        "bytes_lost": sum(c["bytes_lost"] for c in classes.values()),
        "bytes_unverified": sum(c["bytes_unverified"] for c in classes.values()),
        "aux_bytes": sum(c["aux_bytes"] for c in classes.values()),
        "errors": sum(sum(c["errors"].values()) for c in classes.values()),
        "landed_replies": sum(r.get("landed_replies", 0) for r in res),
    }
    totals["gbps"] = round(totals["bytes"] / elapsed / 1e9, 4)
    problems: list[str] = []
    if totals["bytes_corrupted"]:
        problems.append(f"{totals['bytes_corrupted']} bytes corrupted")
    if totals["bytes_lost"]:
        problems.append(f"{totals['bytes_lost']} bytes lost")
    if totals["bytes_unverified"]:
        problems.append(f"{totals['bytes_unverified']} bytes could not be verified")
    if totals["errors"] > args.max_errors:
        problems.append(f"{totals['errors']} copies failed (allowed {args.max_errors})")
    if fatal:
        problems.append(f"clients failed: {fatal}")
    if not daemon_alive:
        problems.append("the daemon is gone")
    leak = {
        "fds_before": before.get("fds"),
        "fds_after": after.get("fds"),
        "pinned_mib_after": after.get("pinned_mib"),
        "clients_before": before.get("clients"),
        "clients_after": after.get("clients"),
    }
    if before.get("fds") is not None and after.get("fds") is not None and after["fds"] > before["fds"]:
        problems.append(f"daemon holds {after['fds'] - before['fds']:.0f} more fds after the run than before")
    report: dict[str, Any] = {
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),
        "backend": backend,
        "socket": path,
        "spawned_daemon": bool(args.spawn_daemon),
        "daemon_env": args.daemon_env,
        "verify": verify_modes,
        "n_clients": len(clients),
        "profiles": [{"client": i, **asdict(p)} for i, p in enumerate(clients)],
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 3),
        "classes": classes,
        "totals": totals,
        "throughput_over_time": throughput_series(res, elapsed, bin_s),
        "latency_windows": windows,
        "daemon": {"pid": pid, "before": before, "after": after, "resources": leak, "samples": monitor.samples},
        "clients": [
            {k: v for k, v in r.items() if k not in ("lat_us", "daemon_us", "t_done", "sizes", "type")} for r in res
        ],
        "failed_clients": fatal,
    }
    if restarts is not None:
        rep = restarts.report()
        report["restarts"] = rep
        dead = {r["client"]: r.get("alive_why") or "not alive" for r in res if not r.get("alive", True)}
        dead.update(fatal)
        totals.update(
            restarts=rep["count"],
            copies_lost=sum(c["restart"]["lost"] for c in classes.values()),
            copies_corrupted=sum(c["restart"]["corrupted"] for c in classes.values()),
            false_successes=sum(c["restart"]["false_successes"] for c in classes.values()),
            restart_errors=sum(sum(c["restart"]["restart_errors"].values()) for c in classes.values()),
            resubmitted_ok=sum(c["restart"]["resubmitted_ok"] for c in classes.values()),
            clients_alive=len(clients) - len(dead),
        )
        if not rep["count"]:
            problems.append(f"the daemon was never restarted: run longer than --kill-every {args.kill_every}")
        if totals["copies_lost"]:
            problems.append(f"{totals['copies_lost']} copies lost (no reply and no error)")
        if totals["false_successes"]:
            problems.append(f"{totals['false_successes']} copies reported done that were not")
        if totals["copies_corrupted"]:
            problems.append(f"{totals['copies_corrupted']} copies corrupted")
        gave_up = sum(c["restart"]["gave_up"] for c in classes.values())
        if gave_up:
            problems.append(f"{gave_up} copies still failed after {args.restart_resubmits} re-submissions")
        if dead:
            problems.append(f"{len(dead)} of {len(clients)} clients not alive at the end: {dead}")
        problems += rep["unexpected_exits"]
    code = 1 if problems else 0
    if args.soak and restarts is not None:
        verdict = soak_verdict_restarts(monitor.samples, windows, res, restarts.events, args)
        report["soak"] = verdict
        if not verdict["flat"]:
            problems += verdict["problems"]
            code = code or 2
    elif args.soak:
        verdict = soak_verdict(monitor.samples, windows, args)
        report["soak"] = verdict
        if not verdict["flat"]:
            problems += verdict["problems"]
            code = code or 2
    report["problems"] = problems
    report["ok"] = not problems
    json_path = os.path.join(args.out, "loadtest.json")
    with open(json_path, "w") as fp:
        json.dump(report, fp, indent=1)
    files = [json_path, *plot(report, res, args.out)]
    print_summary(report)
    print(f"wrote {', '.join(files)}", file=sys.stderr)
    if problems:
        print("loadtest: PROBLEMS: " + "; ".join(problems), file=sys.stderr)
    return code


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n{report['backend']} backend, {report['n_clients']} clients, {report['elapsed_s']:.1f} s, verify {'/'.join(report['verify'])}"
    )
    print(
        f"{'class':<8}{'dirs':<12}{'copies':>8}{'copies/s':>10}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'max ms':>9}{'express':>9}  errors / corrupt / lost"
    )
    for cls, c in sorted(report["classes"].items()):
        lat = c["latency_us"]

        def ms(v: float | None) -> str:
            return f"{v / 1e3:.2f}" if v is not None else "-"

        print(
            f"{cls:<8}{','.join(c['directions']):<12}{c['requests']:>8}{c['requests_per_s']:>10.1f}{c['throughput_gbps']:>8.2f}"
            f"{ms(lat['p50']):>9}{ms(lat['p99']):>9}{ms(lat['p99.9']):>10}{ms(lat['max']):>9}{c['express_fraction']:>9.2f}"
            f"  {c['errors'] or 0} / {c['bytes_corrupted']} / {c['bytes_lost']}"
        )
    t = report["totals"]
    print(
        f"total: {t['requests']} copies, {t['bytes'] / 1e9:.2f} GB at {t['gbps']:.2f} GB/s; "
        f"verified {t['bytes_verified'] / 1e9:.2f} GB, corrupted {t['bytes_corrupted']}, lost {t['bytes_lost']}; "
        f"{t['landed_replies']} answered from their landed word"
    )
    res = report["daemon"]["resources"]
    print(
        f"daemon: fds {res['fds_before']} -> {res['fds_after']}, clients {res['clients_before']} -> {res['clients_after']}"
    )
    if "restarts" in report:
        rs = report["restarts"]
        print(
            f"\nrestarts: {rs['count']} ({rs['by_signal']['KILL']} SIGKILL, {rs['by_signal']['TERM']} SIGTERM), "
            f"every {rs['every_s'][0]:g}-{rs['every_s'][1]:g} s; a new daemon listened after "
            f"p50 {rs['down_ms']['p50']} / max {rs['down_ms']['max']} ms"
        )
        print(
            f"{'class':<8}{'verified':>9}{'restart errors (kind)':>34}{'resubmitted/ok':>16}"
            f"{'lost':>6}{'corrupt':>8}{'false ok':>9}{'alive':>8}"
        )
        for cls, c in sorted(report["classes"].items()):
            r = c["restart"]
            kinds = ",".join(f"{k}={v}" for k, v in sorted(r["restart_errors"].items())) or "0"
            print(
                f"{cls:<8}{r['verified']:>9}{kinds:>34}{str(r['resubmitted']) + '/' + str(r['resubmitted_ok']):>16}"
                f"{r['lost']:>6}{r['corrupted']:>8}{r['false_successes']:>9}{str(r['alive']) + '/' + str(r['clients']):>8}"
            )
    if "soak" in report and report["soak"].get("mode") == "restarts":
        s = report["soak"]
        print("soak with restarts: " + s["note"])
        for key, v in s["across_daemons"].items():
            print(f"soak {key} across daemons (settled medians): first {v['first']}, min {v['min']}, max {v['max']}")
        print(f"soak clients' own fds, end minus start: {sorted(set(s['client_fds_growth'].values()))}")
        for cls, v in s.get("latency_us", {}).items():
            print(f"soak {cls} p50: {v['first_p50']} -> {v['last_p50']} us, p99 {v['first_p99']} -> {v['last_p99']} us")
        print("soak: " + ("flat" if s["flat"] else "NOT flat: " + "; ".join(s["problems"])))
    elif "soak" in report:
        s = report["soak"]
        for key in ("VmRSS", "RssAnon", "fds"):
            if key in s:
                v = s[key]
                print(f"soak {key}: {v['first']} -> {v['last']} {v['unit']} (slope {v['slope_per_min']}/min)")
        for cls, v in s.get("latency_us", {}).items():
            print(f"soak {cls} p50: {v['first_p50']} -> {v['last_p50']} us, p99 {v['first_p99']} -> {v['last_p99']} us")
        print("soak: " + ("flat" if s["flat"] else "NOT flat: " + "; ".join(s["problems"])))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's socket (default $PRIOD_SOCKET)")
    where.add_argument(
        "--spawn-daemon",
        action="store_true",
        help="start a daemon of our own for the run (priod.testing.daemon_process)",
    )
    ap.add_argument(
        "--backend", choices=("sim", "cuda", "auto"), default="sim", help="engine of the spawned daemon (default sim)"
    )
    ap.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="PRIOD_X__Y=V",
        help="setting for the spawned daemon (repeatable)",
    )
    ap.add_argument(
        "--daemon-log-level", default="warning", help="log level of the spawned daemon (info logs every copy)"
    )
    ap.add_argument("--client", action="append", metavar="SPEC", help="a client profile (repeatable); see below")
    ap.add_argument(
        "--clients", type=int, default=0, help="with the default mix: this many client processes (default 5)"
    )
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20; soak: 120)")
    ap.add_argument(
        "--requests", type=int, default=0, help="each client stops after this many copies (default: no bound)"
    )
    ap.add_argument(
        "--verify",
        choices=("auto", "staged"),
        default="auto",
        help="auto: read mapped regions directly; staged: go through host staging copies (the cuda path)",
    )
    ap.add_argument("--out", default="loadtest-out", help="directory for loadtest.json and the plots")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop of the client processes"
    )
    ap.add_argument("--progress-s", type=float, default=1.0, help="seconds between progress lines")
    ap.add_argument("--sample-s", type=float, default=1.0, help="seconds between daemon samples (RSS, fds, ping)")
    ap.add_argument(
        "--bin-s", type=float, default=0.0, help="throughput plot bin (default: duration/60, at least 0.25 s)"
    )
    ap.add_argument("--windows", type=int, default=10, help="latency windows over the run (soak: first vs last)")
    ap.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="after the end, wait this long for outstanding replies; later ones count as lost",
    )
    ap.add_argument("--setup-timeout-s", type=float, default=120.0)
    ap.add_argument("--max-errors", type=int, default=0, help="failed copies allowed before the run counts as failed")
    soak = ap.add_argument_group("soak")
    soak.add_argument("--soak", action="store_true", help="check that the daemon's RSS, fds and latency stay flat")
    soak.add_argument(
        "--soak-warmup-s", type=float, default=0.0, help="ignore samples before this (default: 20%% of the duration)"
    )
    soak.add_argument(
        "--soak-rss-mib", type=float, default=16.0, help="anonymous RSS growth allowed, first to last window (or 5%%)"
    )
    soak.add_argument("--soak-fds", type=float, default=1.0, help="open fd growth allowed, first to last window")
    soak.add_argument(
        "--soak-latency-factor",
        type=float,
        default=3.0,
        help="last-window p50 may be this many times the first (+0.5 ms)",
    )
    soak.add_argument(
        "--soak-daemon-settle-s",
        type=float,
        default=3.0,
        help="with --kill-every: a daemon's samples count from this long after it listens (default 3)",
    )
    soak.add_argument(
        "--soak-client-fds",
        type=int,
        default=2,
        help="with --kill-every: a client's own open fds may grow this much from start to end (default 2)",
    )
    kill = ap.add_argument_group("restarts (with --spawn-daemon)")
    kill.add_argument(
        "--kill-every",
        metavar="LOW-HIGH",
        help="kill the daemon every LOW-HIGH seconds (uniform) during the load and start a new one on the same socket",
    )
    kill.add_argument(
        "--kill-signal",
        choices=("KILL", "TERM", "mixed"),
        default="KILL",
        help="SIGKILL, SIGTERM (a clean stop), or mixed: the two alternately, the first at random (default KILL)",
    )
    kill.add_argument(
        "--reconnect-s",
        type=float,
        default=30.0,
        help="the clients' reconnect_s: how long they reconnect by themselves (default 30)",
    )
    kill.add_argument(
        "--retry-copies",
        action="store_true",
        help="the clients' retry_copies: the client library sends interrupted copies again itself",
    )
    kill.add_argument(
        "--restart-resubmits",
        type=int,
        default=3,
        help="a copy failed with a documented restart error is sent again up to this many times (default 3)",
    )
    args = ap.parse_args(argv)
    if args.kill_every and not args.spawn_daemon:
        ap.error("--kill-every needs --spawn-daemon (the load test restarts only a daemon of its own)")
    if args.kill_every:
        try:
            parse_kill_every(args.kill_every)
        except ValueError as exc:
            ap.error(str(exc))
    if args.soak and "--duration" not in (argv if argv is not None else sys.argv):
        args.duration = 120.0
    if args.soak and not args.soak_warmup_s:
        args.soak_warmup_s = round(0.2 * args.duration, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    if args.worker:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when clients stop
        return worker_main(args.worker)
    try:
        return run(args)
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 64


if __name__ == "__main__":
    sys.exit(main())
