#!/usr/bin/env python3
"""priod against hostile clients (multi-tenant safety): what an honest client gets
without and with each attacker, side by side in one run.

    .venv/bin/python scripts/attack.py --out /tmp/attack     # sim engine, about 2.5 minutes on 2 cores
    .venv/bin/python scripts/attack.py --quick               # about 1-1.5 minutes
    .venv/bin/python scripts/attack.py --only bombs,idle     # some attacks only
    .venv/bin/python scripts/attack.py --only holds-uids,status-flood,batch-flood,pin-shared --out /tmp/attack40
                                                             # tenant attacks by 1, 3, 8 uids: about 3 minutes

Every attack gets a fresh daemon (``python -m priod serve``, `priod.testing.daemon_process`,
default configuration unless said below; ``--set`` adds settings), measures the honest client's
figure with no attacker, then starts the attacker in a process of its own and measures it again:

1. ``urgent64``: one connection keeps four 64 MiB ``urgent`` copies outstanding. Honest: 1 MiB
   urgent copies one at a time, client-observed p50/p99. Target: p50 <= 2x unloaded + 5 ms.
2. ``urgent-dma``: the same flood with ``[scheduler] express = false``, so urgent copies are
   strict DMA chunks that hold every other class back. Honest: another process's ``high``
   throughput (16 MiB copies, two outstanding). Target: >= 0.25 of unloaded.
3. ``tiny``: 1-byte urgent copies as fast as one connection can, 256 outstanding. Honest: as 1;
   beside it the attacker's copies/s and how fast the daemon's log grows (default level, info).
4. ``deadline``: copies with ``deadline_ms`` -1e12, NaN and inf, one after another (each must be
   refused: counted), beside four 64 MiB bulk copies with the tightest legal deadline (0 ms)
   always outstanding. Honest: another process's bulk throughput. Target: >= 0.25 of unloaded.
5. ``bombs``: 4 connections send ~1 MiB msgpack frames of up to a million tiny objects, over
   and over. Honest: ping p50/p99 (target as 1); beside it the daemon's RSS growth (reported,
   with no target of its own; tests/test_hostile_wire.py bounds 8 bombs at 100 MiB); every bomb
   must be refused with ``bad_frame``.
6. ``idle``: 256 connections of one uid that never say hello. Honest: a root client connects
   (target: yes); the connections admitted are closed once ``[server] hello_timeout_s`` (5 s)
   has passed (target: all, within 2 s after it).
7. ``sigterm``: 60 connections fill their output with status replies and never read; the daemon
   gets SIGTERM. Target: exit status 0 within 10 s, every connection with replies waiting.
8. ``mute``: 100 connections send requests until the daemon stops reading them, and never read
   a reply, with ``[server] max_output_bytes`` = 1 MiB and the per-uid request limits lifted
   (they alone keep the connections from filling their output); measured once each has half
   of that waiting, or after `MUTE_FILL_S`. Figure: the daemon's anonymous RSS per
   connection. Target: <= max_output_bytes + 1 MiB (tests/test_hostile_limits.py's bound). Then
   they close: the honest ping p50 in the next 2 s (target as 1), and how long until the daemon
   is done with their connections (waited for up to 60 s, 10 s with ``--quick``).
9. ``holds``: a hold page (direct urgent copies) whose copies never end, a new one announced on
   every lane every 2 ms. Honest: a bulk client's throughput. Target: >= 0.7x unloaded (it may
   lose the hold budget's share, ``urgent_budget_share`` = 0.25, and no more, less slack).

10-13. Several uids at once (tenant attacks): each of these attacks is run by 1, 3 and 8 attacker
   uids at once (``--uids``), every uid within every per-uid limit, all from one attacker
   process (a connection of each uid, its effective uid switched per connect). One daemon per
   attack; root's bulk stream (16 MiB h2d, two outstanding, every copy verified, a process of its
   own) runs throughout, and in each window (3 s; 2 s with ``--quick``) root also sends 1 MiB
   urgent copies one at a time (bytes checked), pings on a connection of its own every 5 ms, and
   frees three device regions of its own, each shared with every attacker uid. Windows: alone,
   one per variant and uid count, alone again; root's alone figure is the mean of the two alone
   windows. Targets per window: bulk >= 0.5x alone, urgent p50 <= 2x alone + 5 ms, ping p99
   < 20 ms, every free <= 100 ms (a ping or free unanswered in 10 s counts as 10 s).
10. ``holds-uids``: the uids take turns holding every lane through hold pages, each a turn of
    15 ms of every 60 ms (7.5 ms with more than four uids, so that the lanes are wanted
    throughout), announcing 1 ms copies back to back through its turn.
11. ``status-flood``: each uid pipelines ``status`` on 1, 4 and 32 connections (``--conns``),
    64 outstanding on each.
12. ``batch-flood``: copy_batch requests of 32,768 segments, two outstanding per connection:
    16-byte segments whose last overlaps the first (refused only after the whole table is
    checked) from 4 and 32 connections per uid; urgent batches of 1- and 2-byte segments (run)
    from 4 connections per uid.
13. ``pin-shared``: each uid queues four copies into each of root's three shared regions, every
    one held on a wait_event that never fires, and stays connected; root frees its regions (the
    attacker counts the ``not_found`` replies its copies get).

After each attack a new client must get an urgent and a bulk copy done and checked (a daemon
whose copy pump died still accepts connections), and the daemon gets SIGTERM (SIGKILL after 15 s).

Honest bytes: every urgent copy is checked at its destination (`urgent_copies`); so is every
throughput copy (`BulkProcess` with ``verify``: random source, stamped per copy, compared after
each reply). A copy that fails, gets no reply within 10 s or lands wrong is counted and the
measurement goes on. The last row adds up, over all attacks, daemons that crashed or got stuck
(not running when the attack ends, not serving the check copies, a Traceback, an exit status
other than 0 at SIGTERM), error-level events in the daemons' logs (an ``internal`` reply is
one), and honest copies that failed or landed wrong.

Uids: run as root, the attackers connect as uids 65534 and 65533 (65534 down to 65527 in the
tenant attacks) and the honest client as root.
The daemon tells tenants apart by the uid the kernel recorded at connect() (SO_PEERCRED), so an
attacker process sets its effective uid and gid to the attacker's for each connect() (and back,
to read the checkout and the interpreter). Run as anyone else, every client shares one uid: the
output says so, and per-uid fairness cannot tell attacker and honest client apart then.

Full numbers go to ``<out>/attack.json``; a table of figures, targets and verdicts is printed last,
and for the tenant attacks a compact one: per attack, variant and uid count, root's bulk against
alone, urgent p50, ping p99 and slowest free, and the targets missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import functools
import json
import math
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
import uvloop

# Runnable from a checkout without `pip install -e .`: the daemons (python -m priod), the honest
# client processes and the attackers find the same priod as this script.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

from priod.client import Client, Region, SyncClient
from priod.errors import ConnectionClosed, LimitExceeded, PriodError, error_for_code
from priod.testing import (
    BulkProcess,
    CpuMeter,
    DaemonProcess,
    LoadProcess,
    bulk_load,
    daemon_process,
    machine,
    memory_and_fds,
    settings_env,
    summarize,
    throughput_between,
    urgent_copies,
)
from priod.wire.frames import HEADER, PROTOCOL_VERSION, REPLY_LIMITS, FrameDecoder, encode
from priod.wire.transport import BlockingFramedSocket

KiB, MiB = 1 << 10, 1 << 20
T = TypeVar("T")
ATTACKER_UIDS = tuple(65534 - i for i in range(8))
"""The uids attackers connect as when this runs as root (nobody, and seven more below it)."""
HONEST_COPY = MiB
HELLO_TIMEOUT_S = 5.0
"""[server] hello_timeout_s, set explicitly (it is the default) so the verdict can use it."""
MUTE_MAX_OUTPUT = MiB
"""[server] max_output_bytes in the mute attack, as in tests/test_hostile_limits.py."""
MUTE_FILL_S = 20.0
"""How long the mute attack waits for its connections' replies to fill half of that each."""
RSS_GROWTH_MAX_MIB = 100.0
"""tests/test_hostile_wire.py's bound on RSS growth after 8 bombs (a report: the attack sets no target of its own)."""
SIGTERM_MAX_S = 10.0
REPLY_TIMEOUT_S = 10.0
"""How long the honest client waits for a batch of replies before calling the daemon stalled."""
TENANT_ATTACKS = ("holds-uids", "status-flood", "batch-flood", "pin-shared")
"""The tenant attacks, each by 1, 3 and 8 uids at once (``--uids``)."""
ATTACKS = ("urgent64", "urgent-dma", "tiny", "deadline", "bombs", "idle", "sigterm", "mute", "holds", *TENANT_ATTACKS)
BATCH_SEGMENTS = 32_768
"""Segments of each batch-flood request: the most one copy_batch may carry."""
BULK_MIN_RATIO = 0.5
PING_P99_MAX_US = 20_000.0
FREE_MAX_US = 100_000.0
"""The tenant attacks' targets: root's bulk >= 0.5x alone, ping p99 < 20 ms, a free within 100 ms (and
urgent p50 within 2x + 5 ms of alone)."""


# -- settings ---------------------------------------------------------------------------------
@dataclass
class Plan:
    """How long each part runs. ``quick`` trades sample counts for time."""

    probes: int = 150
    """Honest urgent copies per measurement."""
    probe_interval_s: float = 0.005
    window_s: float = 5.0
    """Honest throughput window, each side."""
    settle_s: float = 1.0
    """After an attacker says ready, before measuring."""
    ping_s: float = 3.0
    throughput_bytes: int = 16 * MiB
    throughput_pipeline: int = 2
    flood_bytes: int = 64 * MiB
    flood_pipeline: int = 4
    tiny_window: int = 256
    bomb_connections: int = 4
    idle_connections: int = 256
    sigterm_clients: int = 60
    mute_clients: int = 100
    drain_wait_s: float = 60.0
    """How long to wait for the daemon to drop the mute clients' connections once they close."""
    tenant_window_s: float = 3.0
    """Each window of a tenant attack: alone, then each variant and uid count."""
    frees: int = 3
    """Root's shared regions freed in each tenant window."""
    pin_copies: int = 4
    """Copies each attacker uid holds into each of root's regions (pin-shared)."""

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            probes=60, window_s=2.0, settle_s=0.5, ping_s=1.5, drain_wait_s=10.0, tenant_window_s=2.0
        )  # about 1-1.5 minutes


def _log(msg: str) -> None:
    print(f"[attack {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")


def _ms(us: float) -> str:
    return f"{us / 1000:,.2f} ms" if math.isfinite(us) else "none"


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "NOT met")


# -- connecting as another uid ------------------------------------------------------------------
@contextlib.contextmanager
def effective_uid(uid: int | None) -> Iterator[None]:
    """Inside the block this process's effective uid and gid are ``uid`` (a no-op for None or
    our own uid): what the kernel records for a connect() made there, and what the daemon reads
    back (SO_PEERCRED). Needs root; the real uid stays 0, so the block can switch back."""
    if uid is None or uid == os.geteuid():
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def attacker_uids(n: int = 1) -> list[int | None]:
    """The uids for ``n`` attacker connections' owners: other uids as root, else our own (None)."""
    if os.geteuid() != 0:
        return [None] * n
    return [ATTACKER_UIDS[i % len(ATTACKER_UIDS)] for i in range(n)]


def socket_path() -> str:
    """A socket path in a fresh directory that other uids may search (they must reach the socket)."""
    d = tempfile.mkdtemp(prefix="priod-attack-")
    os.chmod(d, 0o755)
    return os.path.join(d, "priod.sock")


# -- the attackers (each runs as ``attack.py _attacker KIND PARAMS`` in its own process) ----------
def _stop_flag() -> threading.Event:
    """Set on SIGUSR1 or SIGTERM (what `LoadProcess.stop` sends)."""
    flag = threading.Event()
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda *_: flag.set())
    return flag


def _raw_connect(path: str, uid: int | None, timeout: float = 10.0) -> socket.socket:
    with effective_uid(uid):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(path)
    return s


def _errors_summary(errors: list[str]) -> dict[str, Any]:
    return {
        "count": len(errors),
        "kinds": dict(Counter(e.split(":", 1)[0] for e in errors)),
        "first": sorted(set(errors))[:3],
    }


def attack_copies(p: dict[str, Any]) -> dict[str, Any]:
    """Keep ``pipeline`` copies of ``nbytes`` in ``priority`` outstanding (`bulk_load`), with
    ``deadline_ms``; with ``bad_deadlines`` also send copies with each of those deadlines, one
    at a time, and count how the daemon answers them."""

    async def main() -> dict[str, Any]:
        flag = _stop_flag()
        stop = asyncio.Event()
        with effective_uid(p["uid"]):
            client = await Client.connect(p["path"], copy_path="daemon", name="attacker")
        host = await client.alloc_host(p["nbytes"])
        dev = await client.alloc_device(p["nbytes"])
        answers: dict[str, Counter[str]] = {str(v): Counter() for v in p.get("bad_deadlines", ())}

        async def bad_deadlines() -> None:
            small_host, small_dev = await client.alloc_host(4096), await client.alloc_device(4096)
            i = 0
            while not stop.is_set():
                value = p["bad_deadlines"][i % len(p["bad_deadlines"])]
                i += 1
                try:
                    await client.copy(small_dev, small_host, 4096, priority="bulk", deadline_ms=float(value))
                    answers[str(value)]["accepted"] += 1
                except PriodError as exc:
                    answers[str(value)][exc.code] += 1
                await asyncio.sleep(0.001)

        async def watch() -> None:
            while not flag.is_set():
                await asyncio.sleep(0.02)
            stop.set()

        print("ready", flush=True)
        watcher = asyncio.ensure_future(watch())
        extra = asyncio.ensure_future(bad_deadlines()) if answers else None
        load = await bulk_load(
            client,
            p["nbytes"],
            stop,
            priority=p["priority"],
            pipeline=p["pipeline"],
            regions=(host, dev),
            deadline_ms=p.get("deadline_ms"),
        )
        if extra is not None:
            await extra
        await watcher
        await client.close()
        return {
            "copies": load.copies,
            "bytes": load.bytes_moved,
            "seconds": load.seconds,
            "copies_per_s": load.copies / load.seconds if load.seconds else 0.0,
            "gbps": load.gbps,
            "errors": _errors_summary(load.errors),
            "bad_deadline_answers": {k: dict(v) for k, v in answers.items()},
        }

    return uvloop.run(main())


def _request_with(extra: bytes) -> bytes:
    """A ping frame whose map has one more key, ``x``, holding ``extra`` (raw msgpack)."""
    ping: bytes = msgpack.packb({"id": 7, "op": "ping"})
    key: bytes = msgpack.packb("x")
    body = bytes([0x80 | (ping[0] & 0x0F) + 1]) + ping[1:] + key + extra
    return HEADER.pack(len(body)) + body


def bomb_frames() -> dict[str, bytes]:
    """~1 MiB request frames that decode into hundreds of thousands of objects."""

    def maps(depth: int) -> bytes:  # 16 keys a level: 69,905 maps at depth 4
        if depth == 0:
            return b"\x80"
        child = maps(depth - 1)
        return b"\xde\x00\x10" + b"".join(msgpack.packb(f"k{i}") + child for i in range(16))

    return {
        "million_empty_maps": _request_with(b"\xdd" + struct.pack(">I", 1_000_000) + b"\x80" * 1_000_000),
        "maps_16_wide_4_deep": _request_with(maps(4)),
    }


def attack_bombs(p: dict[str, Any]) -> dict[str, Any]:
    """``connections`` threads, each: connect, hello, send a bomb, read every reply until the
    daemon closes; again until stopped."""
    flag = _stop_flag()
    frames = list(bomb_frames().items())
    lock = threading.Lock()
    replies: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    failures: list[str] = []
    hellos_refused: list[str] = []

    def worker(k: int) -> None:
        n = k
        while not flag.is_set():
            name, frame = frames[n % len(frames)]
            n += 1
            try:
                with lock:  # the effective uid is the whole process's
                    sock = _raw_connect(p["path"], p["uid"])
                fs = BlockingFramedSocket(sock)
                fs.send({"id": 1, "op": "hello", "v": PROTOCOL_VERSION, "client": "bomber"})
                hello, _ = fs.receive()
                if not hello.get("ok"):  # the bomb would meet a connection that is not greeted
                    fs.close()
                    with lock:
                        hellos_refused.append(str(_refusal(hello)))
                    time.sleep(0.05)
                    continue
                try:
                    sock.sendall(frame)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed on the limit before the whole frame went: the reply waits
                got = []
                while True:
                    try:
                        msg, fds = fs.receive()
                    except (ConnectionClosed, ConnectionResetError, BrokenPipeError, TimeoutError):
                        break
                    for fd in fds:
                        os.close(fd)
                    got.append("ok" if msg.get("ok") else str(msg.get("error", {}).get("code")))
                fs.close()
                with lock:
                    sent[name] += 1
                    replies[",".join(got) or "none"] += 1
            except (OSError, PriodError) as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(p["connections"])]
    print("ready", flush=True)
    started = time.monotonic()
    for t in threads:
        t.start()
    flag.wait()
    stopped = time.monotonic()
    for t in threads:  # each finishes the bomb it is on; one the daemon is slow to refuse is left
        t.join(max(0.0, stopped + 3.0 - time.monotonic()))
    with lock:
        return {
            "frames_sent": dict(sent),
            "frame_bytes": {name: len(f) for name, f in frames},
            "replies": dict(replies),
            "seconds": stopped - started,
            "threads_still_on_a_bomb": sum(t.is_alive() for t in threads),
            "failures": _errors_summary(failures),
            "hellos_refused": _errors_summary(hellos_refused),
        }


IDLE_OUTCOMES = {"no_hello": "no hello within", "per_uid_cap": "max_connections_per_uid", "max_clients": "max_clients"}
IDLE_OUTCOME_TEXT = {
    "per_uid_cap": "refused at once ([limits] max_connections_per_uid)",
    "max_clients": "refused at once ([server] max_clients)",
}
"""How the idle attacker's connections are told off, by a piece of the daemon's message."""


def attack_idle(p: dict[str, Any]) -> dict[str, Any]:
    """``n`` connections that never send a byte; record what the daemon says to each, and when
    it closes each (seconds after its connect)."""
    flag = _stop_flag()
    socks: list[socket.socket] = []
    connected: list[float] = []
    for _ in range(p["n"]):
        socks.append(_raw_connect(p["path"], p["uid"]))
        connected.append(time.monotonic())
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    data = [bytearray() for _ in socks]
    closed: list[float | None] = [None] * len(socks)
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    while not flag.is_set() and sel.get_map():
        for key, _ in sel.select(0.05):
            i = key.data
            try:
                chunk = socks[i].recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if chunk:
                data[i] += chunk
            else:
                closed[i] = time.monotonic() - connected[i]
                sel.unregister(socks[i])
    kinds: Counter[str] = Counter()
    after: dict[str, list[float]] = {}
    for i, s in enumerate(socks):
        s.close()
        msgs = FrameDecoder(1 << 20, REPLY_LIMITS).feed(bytes(data[i]))
        text = str(msgs[0].get("error", {}).get("message", "")) if msgs else ""
        kind = next((k for k, needle in IDLE_OUTCOMES.items() if needle in text), text[:60] or "nothing")
        kind += "" if closed[i] is not None else " (still open)"
        kinds[kind] += 1
        if closed[i] is not None:
            after.setdefault(kind, []).append(float(closed[i] or 0.0))
    return {
        "connections": len(socks),
        "connect_spread_s": connected[-1] - connected[0] if connected else 0.0,
        "outcomes": dict(kinds),
        "closed_after_s": {k: summarize(v, ("n", "min", "p50", "max")) for k, v in after.items()},
    }


def attack_mute(p: dict[str, Any]) -> dict[str, Any]:
    """``n`` connections (owners in turn from ``uids``) that never read. ``mode`` "status": each
    sends hello and ``requests`` status requests. "flood": each sends hello and then ping, ping,
    status... until the daemon has taken nothing for 0.3 s (it stopped reading)."""
    flag = _stop_flag()
    uids = p["uids"]
    socks = [_raw_connect(p["path"], uids[i % len(uids)]) for i in range(p["n"])]
    hello = encode({"id": 1, "op": "hello", "v": PROTOCOL_VERSION, "client": "mute"})
    sent = [0] * len(socks)
    if p["mode"] == "status":
        payload = hello + b"".join(encode({"id": n, "op": "status"}) for n in range(2, 2 + p["requests"]))
        for i, s in enumerate(socks):
            s.sendall(payload)
            sent[i] = len(payload)
    else:
        kinds = ({"op": "ping"}, {"op": "ping"}, {"op": "status"})
        payload = hello + b"".join(encode({"id": i, **kinds[i % 3]}) for i in range(2, 120_002))
        last = [time.monotonic()] * len(socks)
        for s in socks:
            s.setblocking(False)
        live = set(range(len(socks)))
        while live:
            progress = False
            for i in list(live):
                try:
                    n = socks[i].send(payload[sent[i] : sent[i] + 65536])
                    sent[i] += n
                    last[i] = time.monotonic()
                    progress = True
                except BlockingIOError:
                    pass
                if sent[i] >= len(payload) or time.monotonic() - last[i] > 0.3:
                    live.discard(i)
            if not progress:
                time.sleep(0.005)
    print("ready", flush=True)
    flag.wait()
    for s in socks:
        s.close()
    return {
        "connections": len(socks),
        "uids": sorted({u for u in uids if u is not None}),
        "bytes_sent": summarize(sent, ("n", "min", "p50", "max")),
    }


def attack_holds(p: dict[str, Any]) -> dict[str, Any]:
    """A hold page abused: every ``interval_s`` a new direct copy is announced on every lane of
    the page and none is ever ended, so each lane always has a fresh one under way (no copy is
    ever older than the interval, so ``direct_hold_max_ms`` never cuts it): only the uid's hold
    budget stands between this client and holding bulk back for good."""
    flag = _stop_flag()
    with effective_uid(p["uid"]):
        client = SyncClient(p["path"], copy_path="daemon", name="attacker")
    page = client.hold_page()
    slots = [page.slot(ln["device_uuid"], ln["direction"], ln["device"]) for ln in page.lanes]
    print("ready", flush=True)
    t0, announced = time.monotonic(), 0
    while not flag.is_set():
        for slot in slots:
            page.begin(slot)
        announced += 1
        time.sleep(p["interval_s"])
    seconds = time.monotonic() - t0
    status = client.status()["direct"]
    page.close()
    client.close()
    return {"announced_per_lane": announced, "seconds": seconds, "daemon_direct": status}


# -- tenant attacks: attackers of several uids at once (one process, connections of each uid) --------
def _reply_frames(buf: bytearray) -> int:
    """Remove the whole frames at the front of ``buf``; how many there were (replies counted,
    not decoded: the attacker's own CPU stays small beside the daemon's)."""
    n = pos = 0
    while len(buf) - pos >= HEADER.size:
        (size,) = HEADER.unpack_from(buf, pos)
        if len(buf) - pos - HEADER.size < size:
            break
        pos += HEADER.size + size
        n += 1
    del buf[:pos]
    return n


def _greeted(path: str, uid: int | None) -> tuple[socket.socket, BlockingFramedSocket]:
    # A uid still in request debt from the variant before waits for its bucket: a long timeout.
    sock = _raw_connect(path, uid, timeout=60.0)
    fs = BlockingFramedSocket(sock)
    fs.send({"id": 1, "op": "hello", "v": PROTOCOL_VERSION, "client": "attacker"})
    msg, _ = fs.receive()
    if not msg.get("ok"):
        fs.close()
        raise _refusal(msg)
    return sock, fs


def _refusal(msg: dict[str, Any]) -> PriodError:
    """The exception an error reply stands for, as the client library raises it."""
    err = msg.get("error") or {}
    return error_for_code(str(err.get("code")), str(err.get("message")))


def _ask(fs: BlockingFramedSocket, req: dict[str, Any]) -> dict[str, Any]:
    fs.send(req)
    msg, fds = fs.receive()
    for fd in fds:
        os.close(fd)
    if not msg.get("ok"):
        raise _refusal(msg)
    return dict(msg)


def attack_turns(p: dict[str, Any]) -> dict[str, Any]:
    """Tenant attack 1 (holds-uids): the ``uids`` take turns holding every lane through hold pages (one connection
    each), each within its own hold budget: in every ``period_s`` each has a turn of
    ``min(turn_s, period_s / n)`` (so with more than four uids the lanes are wanted throughout),
    and through its turn it announces ``copy_s`` copies back to back on every lane."""
    flag = _stop_flag()
    clients, pages = [], []
    for uid in p["uids"]:
        with effective_uid(uid):
            c = SyncClient(p["path"], copy_path="daemon", name="attacker")
        clients.append(c)
        pages.append(c.hold_page())
    slots = [[pg.slot(ln["device_uuid"], ln["direction"], ln["device"]) for ln in pg.lanes] for pg in pages]
    n = len(pages)
    turn = min(p["turn_s"], p["period_s"] / n)
    open_ = [False] * n
    announced = [0] * n
    print("ready", flush=True)
    t0 = time.monotonic()
    while not flag.is_set():
        phase = (time.monotonic() - t0) % p["period_s"]
        whose = int(phase // turn) if phase < turn * n else -1
        for k, pg in enumerate(pages):
            if open_[k]:
                for s in slots[k]:
                    pg.end(s)
                open_[k] = False
            if k == whose:
                for s in slots[k]:
                    pg.begin(s)
                open_[k] = True
                announced[k] += 1
        time.sleep(p["copy_s"])
    seconds = time.monotonic() - t0
    status = clients[0].status()["direct"]
    for pg, c in zip(pages, clients, strict=True):
        pg.close()
        c.close()
    return {"uids": len(pages), "turn_s": turn, "announced": announced, "seconds": seconds, "daemon_direct": status}


def _flood(conns: list[socket.socket], frames: list[bytes], window: int, flag: threading.Event) -> dict[str, Any]:
    """Keep ``window`` requests outstanding on every connection (``frames[i]`` on ``conns[i]``,
    over and over), replies counted and dropped, until ``flag``."""
    sel = selectors.DefaultSelector()
    sent = [0] * len(conns)
    answered = [0] * len(conns)
    bufs = [bytearray() for _ in conns]
    out = [memoryview(b"") for _ in conns]
    for i, s in enumerate(conns):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, i)
    t0 = time.monotonic()
    while not flag.is_set():
        for key, ev in sel.select(0.05):
            i, s = key.data, conns[key.data]
            if ev & selectors.EVENT_READ:
                try:
                    chunk = s.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    chunk = None
                except OSError:
                    chunk = b""
                if chunk == b"":
                    sel.unregister(s)
                    continue
                if chunk:
                    bufs[i] += chunk
                    answered[i] += _reply_frames(bufs[i])
            if ev & selectors.EVENT_WRITE:
                if not out[i] and sent[i] - answered[i] < window:
                    # Small requests go as many at once as the window has room for; large ones
                    # (batch tables) one at a time, without a copy of the frame.
                    k = window - (sent[i] - answered[i]) if len(frames[i]) < 64 * KiB else 1
                    out[i] = memoryview(frames[i] * k if k > 1 else frames[i])
                    sent[i] += k
                if out[i]:
                    try:
                        n = s.send(out[i])
                        out[i] = out[i][n:]
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        sel.unregister(s)
                        continue
            # Ask to write only while there is something to send or room in the window.
            want = selectors.EVENT_READ
            if out[i] or sent[i] - answered[i] < window:
                want |= selectors.EVENT_WRITE
            with contextlib.suppress(KeyError, ValueError):
                sel.modify(s, want, i)
    seconds = time.monotonic() - t0
    for s in conns:
        s.close()
    return {
        "connections": len(conns),
        "seconds": seconds,
        "requests_answered": sum(answered),
        "answered_per_s": sum(answered) / seconds if seconds else 0.0,
    }


def _uid_conns(
    p: dict[str, Any],
) -> tuple[list[tuple[int | None, socket.socket, BlockingFramedSocket]], list[str], list[str]]:
    """``conns`` greeted connections for each of ``uids``; the connects refused for any cause
    but the daemon's connection limits, and those its limits refused."""
    got: list[tuple[int | None, socket.socket, BlockingFramedSocket]] = []
    refused: list[str] = []
    limited: list[str] = []
    for uid in p["uids"]:
        for _ in range(p["conns"]):
            try:
                sock, fs = _greeted(p["path"], uid)
            except (OSError, PriodError, ConnectionClosed) as exc:
                # The daemon's own connection limits refusing is its defence at work, not an
                # attack that failed to start.
                (limited if isinstance(exc, LimitExceeded) else refused).append(f"{type(exc).__name__}: {exc}")
                continue
            got.append((uid, sock, fs))
    return got, refused, limited


def attack_status(p: dict[str, Any]) -> dict[str, Any]:
    """Tenant attack 2 (status-flood): each of ``uids`` pipelines ``status`` on ``conns`` connections, ``window``
    outstanding on each (the daemon's request rate per uid is all that slows them)."""
    flag = _stop_flag()
    conns, refused, limited = _uid_conns(p)
    print("ready", flush=True)
    frame = encode({"id": 9, "op": "status"})
    res = _flood([s for _, s, _ in conns], [frame] * len(conns), p["window"], flag)
    return {**res, "connects_refused": _errors_summary(refused), "connects_limited": _errors_summary(limited)}


def attack_batch(p: dict[str, Any]) -> dict[str, Any]:
    """Tenant attack 2 (batch-flood): each of ``uids`` sends copy_batch requests of ``segments`` segments on
    ``conns`` connections, ``window`` outstanding on each. ``mode`` "refused": 16-byte segments
    whose last one overlaps the first (refused only after the whole table is checked);
    "accepted": urgent batches of one- and two-byte segments, run."""
    flag = _stop_flag()
    conns, refused, limited = _uid_conns(p)
    n = p["segments"]
    if p["mode"] == "refused":
        rows = [(16 * i, 16 * i, 16) for i in range(n - 1)] + [(0, 0, 16)]
        size, priority = 16 * n, "bulk"
    else:
        rows = [(2 * i, 2 * i, 1 + i % 2) for i in range(n)]
        size, priority = 2 * n, "urgent"
    table = np.asarray(rows, dtype="<u8").tobytes()
    socks, frames = [], []
    for i, (_, sock, fs) in enumerate(conns):
        h = _ask(fs, {"id": 2, "op": "alloc_host", "nbytes": size})["region"]
        dv = _ask(fs, {"id": 3, "op": "alloc_device", "nbytes": size})["region"]
        socks.append(sock)
        frames.append(
            encode({"id": 10 + i, "op": "copy_batch", "dst": dv, "src": h, "segments": table, "priority": priority})
        )
    print("ready", flush=True)
    return {
        **_flood(socks, frames, p["window"], flag),
        "connects_refused": _errors_summary(refused),
        "connects_limited": _errors_summary(limited),
    }


def attack_pin(p: dict[str, Any]) -> dict[str, Any]:
    """Tenant attack 3 (pin-shared): each of ``uids`` queues ``copies`` copies into each of root's shared
    ``regions``, every one held on a wait_event of its own that never fires (a byte of its own
    device region, never set), and stays connected. Replies (the cancellations root's frees
    bring) are counted by code."""
    from priod.wire.ipc_event import sim_handle

    flag = _stop_flag()
    conns, refused, limited = _uid_conns({**p, "conns": 1})
    queued = 0
    for _, _, fs in conns:
        h = _ask(fs, {"id": 2, "op": "alloc_host", "nbytes": 4096})["region"]
        ev = _ask(fs, {"id": 3, "op": "alloc_device", "nbytes": 4096})["region"]
        for r in p["regions"]:
            for k in range(p["copies"]):
                fs.send(
                    {
                        "id": 100 + queued,
                        "op": "copy",
                        "dst": r,
                        "src": h,
                        "nbytes": 4096,
                        "dst_offset": 4096 * k,
                        "priority": "bulk",
                        "wait_event": sim_handle(ev, 0),
                    }
                )
                queued += 1
    print("ready", flush=True)
    codes: Counter[str] = Counter()
    sel = selectors.DefaultSelector()
    for _, sock, _ in conns:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, FrameDecoder(1 << 20, REPLY_LIMITS))
    while not flag.is_set():
        for key, _ in sel.select(0.05):
            try:
                chunk = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            for msg in key.data.feed(chunk):
                codes["ok" if msg.get("ok") else str(msg.get("error", {}).get("code"))] += 1
    for _, _, fs in conns:
        fs.close()
    return {
        "connections": len(conns),
        "copies_queued": queued,
        "replies": dict(codes),
        "connects_refused": _errors_summary(refused),
        "connects_limited": _errors_summary(limited),
    }


ATTACKER_KINDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "copies": attack_copies,
    "holds": attack_holds,
    "bombs": attack_bombs,
    "idle": attack_idle,
    "mute": attack_mute,
    "turns": attack_turns,
    "status": attack_status,
    "batch": attack_batch,
    "pin": attack_pin,
}


def attacker_main(kind: str, params: str) -> int:
    result = ATTACKER_KINDS[kind](json.loads(params))
    print(json.dumps(result, default=float), flush=True)
    return 0


def start_attacker(kind: str, **params: Any) -> LoadProcess:
    """An attacker of ``kind`` in its own process, ready (its connections are open)."""
    proc = LoadProcess([sys.executable, os.path.abspath(__file__), "_attacker", kind, json.dumps(params)])
    proc.what = f"attacker {kind}"
    try:
        proc.wait_ready(120)
    except BaseException:
        proc.kill()
        raise
    return proc


@contextlib.contextmanager
def attacker(kind: str, **params: Any) -> Iterator[tuple[LoadProcess, dict[str, Any]]]:
    """`start_attacker`; the dict it yields gets the attacker's result once the block ends."""
    proc = start_attacker(kind, **params)
    result: dict[str, Any] = {}
    try:
        yield proc, result
        try:
            result.update(proc.stop(REPLY_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            result["stop"] = f"killed: no result within {REPLY_TIMEOUT_S:g} s of SIGUSR1 (its copies got no reply)"
    finally:
        proc.kill()


# -- the honest client's measurements -----------------------------------------------------------
class Stalled(Exception):
    """The daemon stopped answering an honest client's copies."""


async def within(aw: Awaitable[T], seconds: float) -> T:
    """``aw``'s result, or TimeoutError after ``seconds``; unlike `asyncio.wait_for` it does
    not wait for the abandoned request to finish cancelling (a reply that never comes must not
    hold the measurement up for good)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        raise TimeoutError(f"no answer within {seconds:g} s")
    return task.result()


PROBE_BATCH = 10
"""Honest urgent copies per `urgent_copies` call: a copy that fails or lands wrong ends its
batch (`urgent_copies` raises), is counted, and the measurement goes on with the next."""


async def urgent_figures(client: Client, plan: Plan) -> dict[str, Any]:
    """1 MiB urgent h2d copies one at a time, every copy's bytes checked (`urgent_copies`)."""
    latency: list[float] = []
    queued: list[float] = []
    transfer: list[float] = []
    paths: Counter[str] = Counter()
    wrong, failed = 0, []
    for start in range(0, plan.probes, PROBE_BATCH):
        n = min(PROBE_BATCH, plan.probes - start)
        try:
            p = await asyncio.wait_for(
                urgent_copies(client, HONEST_COPY, n, interval_s=plan.probe_interval_s),
                REPLY_TIMEOUT_S + n * plan.probe_interval_s,
            )
        except AssertionError:
            wrong += 1  # reported done, other bytes at the destination
            continue
        except PriodError as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            continue
        except TimeoutError:
            failed.append(f"Stalled: no reply to an urgent copy within {REPLY_TIMEOUT_S:g} s")
            break  # a daemon that stopped answering copies does not come back
        latency += p.latency_us
        queued += p.queued_us
        transfer += p.transfer_us
        paths.update(p.paths)
    return {
        "latency_us": summarize(latency),
        "queued_us": summarize(queued),
        "transfer_us": summarize(transfer),
        "paths": dict(paths),
        "verified_copies": len(latency),
        "verified_bytes": len(latency) * HONEST_COPY,
        "wrong_copies": wrong,
        "failed": _errors_summary(failed),
    }


async def ping_rtts(client: Client, seconds: float, interval_s: float = 0.005) -> dict[str, float]:
    """Pings one at a time, ``interval_s`` apart, for ``seconds``; round trips in microseconds."""
    rtts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await asyncio.wait_for(client.ping(), REPLY_TIMEOUT_S)
        rtts.append((time.perf_counter() - t0) * 1e6)
        await asyncio.sleep(interval_s)
    return summarize(rtts)


def cpu_per_s(delta: dict[str, float], key: str = "cpu") -> float:
    """CPU seconds per second in a `CpuMeter.delta` (nanosecond figures where the kernel has them)."""
    return delta.get(f"{key}_ns", delta[key]) / delta["seconds"]


def rss_mib(d: DaemonProcess, key: str = "VmRSS") -> float:
    return float(memory_and_fds(d.proc.pid).get(key, float("nan")))


async def sample_rss(d: DaemonProcess, stop: asyncio.Event, every_s: float = 0.05) -> list[float]:
    """The daemon's VmRSS (MiB) every ``every_s`` until ``stop`` is set."""
    series = []
    while not stop.is_set():
        series.append(rss_mib(d))
        await asyncio.sleep(every_s)
    return series


async def connections_dropped(client: Client, left: int, since: float, limit_s: float) -> float | None:
    """Seconds from ``since`` until the daemon serves only ``left`` connections (``client``'s
    among them), asking every 0.25 s; None if it still serves more ``limit_s`` after ``since``."""
    while time.monotonic() - since < limit_s:
        st = await asyncio.wait_for(client.status(), limit_s)
        if st["clients_total"] <= left:
            return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


async def window(seconds: float) -> tuple[float, float]:
    """(start, end) of a wait of ``seconds``, CLOCK_MONOTONIC (as `BulkLoad.done`)."""
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    return t0, time.monotonic()


def serves(d: DaemonProcess) -> str:
    """Whether a new client gets a 64 KiB urgent copy and a bulk one done and checked: "yes",
    or "no: " and why (a daemon whose copy pump has died still accepts connections)."""
    try:
        with SyncClient(d.socket_path, copy_path="daemon", name="health", timeout=REPLY_TIMEOUT_S) as c:
            host, dev = c.alloc_host(64 * KiB), c.alloc_device(64 * KiB)
            for i, cls in enumerate(("urgent", "bulk")):
                if host.array is not None:
                    host.array[:] = 17 + i
                c.copy(dev, host, priority=cls)
                if dev.array is not None and host.array is not None and not np.array_equal(dev.array, host.array):
                    return f"no: a {cls} copy landed wrong"
        return "yes"
    except (PriodError, OSError) as exc:
        return f"no: {type(exc).__name__}: {exc}"


def daemon_log_findings(log: str) -> dict[str, Any]:
    """What a daemon's log says went wrong: Tracebacks (console format) and error-level events
    (json format: the daemon logs an unexpected exception in a request as ``request_failed``,
    and answers it ``internal``), with the first few of them."""
    errors = []
    for line in log.splitlines():
        if '"level":"error"' in line or '"level":"critical"' in line:
            try:
                ev = json.loads(line)
            except ValueError:
                errors.append(line[:300])
                continue
            exc = (ev.get("exception") or [{}])[-1]
            errors.append(
                f"{ev.get('event')}: {exc.get('exc_type', '')}: {exc.get('exc_value', ev.get('error', ''))}"[:300]
            )
    found: dict[str, Any] = {
        "tracebacks": log.count("Traceback"),
        "errors_logged": len(errors),
        "log_bytes": len(log.encode()),
    }
    if errors:
        found["first_errors"] = errors[:5]
    if found["tracebacks"]:
        found["log_tail"] = log[-3000:]
    return found


# -- the attacks ---------------------------------------------------------------------------------
class Run:
    """One run of the script: its settings, and a fresh daemon per attack."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args = args
        self.plan = plan
        self.root = os.geteuid() == 0
        self.env: dict[str, str] = {"PRIOD_SERVER__HELLO_TIMEOUT_S": str(HELLO_TIMEOUT_S), **args.env}
        if self.root:
            self.env["PRIOD_SERVER__SOCKET_MODE"] = "0o666"  # other uids must be able to connect

    @contextlib.contextmanager
    def daemon(
        self, out: dict[str, Any], env: dict[str, str] | None = None, *, stopped_here: bool = False
    ) -> Iterator[DaemonProcess]:
        """A fresh daemon for one attack. A record in ``out["daemons"]`` gets whether it ran to
        the end and still serves copies, how long SIGTERM took, its exit status and what its log
        says went wrong. ``stopped_here``: the attack stops it itself (and times that)."""
        rec: dict[str, Any] = {"settings": env or {}}
        out.setdefault("daemons", []).append(rec)
        dp: DaemonProcess | None = None
        try:
            with daemon_process(
                {**self.env, **(env or {})},
                backend=self.args.backend,
                config=self.args.config,
                socket_path=socket_path(),
            ) as d:
                dp = d
                try:
                    yield d
                finally:
                    rec["running_at_end"] = stopped_here or d.proc.poll() is None
                    if not stopped_here:
                        rec["serves_after"] = serves(d)
                        t0 = time.monotonic()
                        d.stop(timeout=SIGTERM_MAX_S + 5)  # SIGKILL after that: counted as a crash (exit status -9)
                        rec["sigterm_exit_s"] = time.monotonic() - t0
        finally:
            if dp is not None:
                rec.update(exit_code=dp.proc.returncode, **daemon_log_findings(dp.log()))

    def copies_attacker(
        self, d: DaemonProcess, **params: Any
    ) -> contextlib.AbstractContextManager[tuple[LoadProcess, dict[str, Any]]]:
        return attacker("copies", path=d.socket_path, uid=attacker_uids()[0], **params)

    # 1 and 3: an honest urgent copy's latency -------------------------------------------------
    async def urgent_latency(self, out: dict[str, Any], env: dict[str, str] | None, **flood: Any) -> None:
        with self.daemon(out, env) as d:
            client = await Client.connect(d.socket_path, copy_path="daemon", name="honest")
            meter = CpuMeter(d.proc.pid)
            try:
                t0, log0, c0 = time.monotonic(), os.path.getsize(d.log_path), meter.sample()
                out["honest_unloaded"] = await urgent_figures(client, self.plan)
                t1, log1, c1 = time.monotonic(), os.path.getsize(d.log_path), meter.sample()
                with self.copies_attacker(d, **flood) as (proc, result):
                    attacker_cpu = CpuMeter(proc.proc.pid)
                    await asyncio.sleep(self.plan.settle_s)
                    t2, log2, c2, a2 = (
                        time.monotonic(),
                        os.path.getsize(d.log_path),
                        meter.sample(),
                        attacker_cpu.sample(),
                    )
                    out["honest_attacked"] = await urgent_figures(client, self.plan)
                    t3, log3, c3, a3 = (
                        time.monotonic(),
                        os.path.getsize(d.log_path),
                        meter.sample(),
                        attacker_cpu.sample(),
                    )
                out["attacker"] = result
                out["daemon_log_bytes_per_s"] = {
                    "unloaded": (log1 - log0) / (t1 - t0),
                    "attacked": (log3 - log2) / (t3 - t2),
                }
                out["cpu_s_per_s"] = {
                    "daemon_unloaded": cpu_per_s(CpuMeter.delta(c0, c1)),
                    "daemon_attacked": cpu_per_s(CpuMeter.delta(c2, c3)),
                    "daemon_loop_attacked": cpu_per_s(CpuMeter.delta(c2, c3), "loop"),
                    "attacker": cpu_per_s(CpuMeter.delta(a2, a3)),
                }
            finally:
                await client.close()

    async def urgent64(self, out: dict[str, Any]) -> None:
        p = self.plan
        await self.urgent_latency(out, None, nbytes=p.flood_bytes, pipeline=p.flood_pipeline, priority="urgent")

    async def tiny(self, out: dict[str, Any]) -> None:
        await self.urgent_latency(out, None, nbytes=1, pipeline=self.plan.tiny_window, priority="urgent")

    # 2 and 4: another process's throughput in a class -------------------------------------------
    async def throughput(
        self, out: dict[str, Any], env: dict[str, str] | None, cls: str, kind: str = "copies", **flood: Any
    ) -> None:
        p = self.plan
        with self.daemon(out, env) as d:
            honest = BulkProcess(
                d.socket_path, p.throughput_bytes, p.throughput_pipeline, priority=cls, name="honest", verify=True
            )
            try:
                honest.wait_ready()
                await asyncio.sleep(p.settle_s)
                alone = await window(p.window_s)
                with attacker(kind, path=d.socket_path, uid=attacker_uids()[0], **flood) as (_, result):
                    await asyncio.sleep(p.settle_s)
                    attacked = await window(p.window_s)
                out["attacker"] = result
                try:
                    got = honest.stop(REPLY_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    honest.kill()
                    raise Stalled(
                        f"the honest {cls} client got no reply to its last copies within {REPLY_TIMEOUT_S:g} s of stopping"
                    ) from None
            finally:
                honest.kill()
        out["honest_class"] = cls
        out["honest_unloaded"] = throughput_between(got["done"], *alone)
        out["honest_attacked"] = throughput_between(got["done"], *attacked)
        out["honest_bytes"] = {
            k: got.get(k, 0) for k in ("verified_bytes", "corrupted_bytes", "corrupted_copies", "unverified_bytes")
        }
        out["honest_errors"] = _errors_summary(got["errors"])
        out["honest_copies"] = len(got["done"])

    async def urgent_dma(self, out: dict[str, Any]) -> None:
        p = self.plan
        await self.throughput(
            out,
            {"PRIOD_SCHEDULER__EXPRESS": "false"},
            "high",
            nbytes=p.flood_bytes,
            pipeline=p.flood_pipeline,
            priority="urgent",
        )

    async def deadline(self, out: dict[str, Any]) -> None:
        p = self.plan
        bad = ["-1e12", "nan", "inf"]
        await self.throughput(
            out,
            None,
            "bulk",
            nbytes=p.flood_bytes,
            pipeline=p.flood_pipeline,
            priority="bulk",
            deadline_ms=0.0,
            bad_deadlines=bad,
        )

    async def holds(self, out: dict[str, Any]) -> None:
        """9: a hold page whose copies never end, renewed every 2 ms, beside an honest bulk stream."""
        await self.throughput(out, None, "bulk", kind="holds", interval_s=0.002)

    # 5: msgpack bombs ------------------------------------------------------------------------------
    async def bombs(self, out: dict[str, Any]) -> None:
        p = self.plan
        with self.daemon(out) as d:
            client = await Client.connect(d.socket_path, copy_path="daemon", name="honest")
            try:
                out["honest_unloaded"] = await ping_rtts(client, p.ping_s)
                before = rss_mib(d)
                with attacker("bombs", path=d.socket_path, uid=attacker_uids()[0], connections=p.bomb_connections) as (
                    _,
                    result,
                ):
                    stop = asyncio.Event()
                    sampler = asyncio.ensure_future(sample_rss(d, stop, 0.25))
                    out["honest_attacked"] = await ping_rtts(client, p.ping_s)
                    stop.set()
                    series = await sampler
                await asyncio.sleep(1.0)
                out["rss_mib"] = {
                    "before": before,
                    "peak_during": max(series),
                    "during_every_0.25_s": series,
                    "1_s_after": rss_mib(d),
                }
                out["attacker"] = result
                await client.ping()
            finally:
                await client.close()

    # 6: idle connections without hello ----------------------------------------------------------
    async def idle(self, out: dict[str, Any]) -> None:
        p = self.plan

        async def root_connects() -> dict[str, Any]:
            t0 = time.perf_counter()
            try:
                c = await Client.connect(d.socket_path, copy_path="daemon", name="honest")
                await c.ping()
                await c.close()
                return {"connected": True, "ms": (time.perf_counter() - t0) * 1e3}
            except PriodError as exc:
                return {
                    "connected": False,
                    "ms": (time.perf_counter() - t0) * 1e3,
                    "error": f"{type(exc).__name__}: {exc}",
                }

        def other_uid_connects() -> dict[str, Any] | None:
            if not self.root:
                return None
            t0 = time.perf_counter()
            try:
                with effective_uid(ATTACKER_UIDS[1]):
                    c = SyncClient(d.socket_path, copy_path="daemon", name="other-uid", timeout=10)
                c.ping()
                c.close()
                return {"uid": ATTACKER_UIDS[1], "connected": True, "ms": (time.perf_counter() - t0) * 1e3}
            except PriodError as exc:
                return {"uid": ATTACKER_UIDS[1], "connected": False, "error": f"{type(exc).__name__}: {exc}"}

        with self.daemon(out) as d:
            out["honest_unloaded"] = await root_connects()
            with attacker("idle", path=d.socket_path, uid=attacker_uids()[0], n=p.idle_connections) as (_, result):
                ready = time.monotonic()
                out["honest_attacked"] = await root_connects()
                out["other_uid_attacked"] = other_uid_connects()
                await asyncio.sleep(max(0.0, ready + HELLO_TIMEOUT_S + 3.0 - time.monotonic()))
            out["attacker"] = result
            out["hello_timeout_s"] = HELLO_TIMEOUT_S
            out["honest_after"] = await root_connects()

    # 7: SIGTERM with clients that never read -----------------------------------------------------
    async def sigterm(self, out: dict[str, Any]) -> None:
        p = self.plan

        def terminate(d: DaemonProcess) -> dict[str, Any]:
            t0 = time.monotonic()
            code = d.stop(timeout=30.0)
            return {"seconds": time.monotonic() - t0, "exit_code": code}

        with self.daemon(out, stopped_here=True) as d:
            out["honest_unloaded"] = terminate(d)
        with self.daemon(out, stopped_here=True) as d:
            with attacker(
                "mute", path=d.socket_path, uids=attacker_uids(), n=p.sigterm_clients, mode="status", requests=200
            ) as (proc, result):
                deadline = time.monotonic() + 60
                stuck = 0
                while time.monotonic() < deadline:
                    with SyncClient(d.socket_path, timeout=30, copy_path="daemon") as c:
                        stuck = sum(
                            1 for x in c.status()["clients"] if x["pid"] == proc.proc.pid and x["output_buffered"] > 0
                        )
                    if stuck >= p.sigterm_clients:
                        break
                    await asyncio.sleep(0.1)
                out["clients_with_output_stuck"] = stuck
                out["honest_attacked"] = terminate(d)
            out["attacker"] = result

    # 8: clients that never read: the daemon's memory -----------------------------------------------
    async def mute(self, out: dict[str, Any]) -> None:
        p = self.plan
        # The per-uid request limits lifted: they alone keep two uids' 100 connections from filling
        # their output for many seconds (attack 3 and status-flood measure them); this attack is
        # about what a connection that never reads may cost the daemon's memory.
        unlimited = {"PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0", "PRIOD_LIMITS__REQUEST_LOOP_SHARE": "0"}
        with self.daemon(out, {"PRIOD_SERVER__MAX_OUTPUT_BYTES": str(MUTE_MAX_OUTPUT), **unlimited}) as d:
            client = await Client.connect(d.socket_path, copy_path="daemon", name="honest")
            try:
                await asyncio.sleep(0.5)
                out["ping_unloaded"] = await ping_rtts(client, min(p.ping_s, 1.5))
                before = {k: rss_mib(d, k) for k in ("VmRSS", "RssAnon")}
                with attacker("mute", path=d.socket_path, uids=attacker_uids(2), n=p.mute_clients, mode="flood") as (
                    proc,
                    result,
                ):
                    st = await client.status()
                    deadline = time.monotonic() + MUTE_FILL_S
                    while time.monotonic() < deadline and not _outputs_full(st, proc.proc.pid, p.mute_clients):
                        await asyncio.sleep(0.25)
                        st = await client.status()
                    after = {k: rss_mib(d, k) for k in ("VmRSS", "RssAnon")}
                    out["ping_attacked"] = await ping_rtts(client, min(p.ping_s, 1.5))
                # They are gone (their sockets closed): what do the requests they left behind cost?
                gone, meter = time.monotonic(), CpuMeter(d.proc.pid)
                c0 = meter.sample()
                out["ping_after_close"] = await ping_rtts(client, min(p.ping_s, 2.0))
                out["daemon_cpu_s_per_s_after_close"] = cpu_per_s(CpuMeter.delta(c0, meter.sample()))
                out["connections_dropped_after_s"] = await connections_dropped(client, 1, gone, p.drain_wait_s)
                out["drain_wait_s"] = p.drain_wait_s
                out["attacker"] = result
                out["rss_mib"] = {"before": before, "after": after}
                out["rss_anon_per_client_mib"] = (after["RssAnon"] - before["RssAnon"]) / p.mute_clients
                buffered = [x["output_buffered"] for x in st["clients"] if x["pid"] == proc.proc.pid]
                out["output_buffered"] = summarize(buffered, ("n", "min", "p50", "max"))
                out["max_output_bytes"] = MUTE_MAX_OUTPUT
            finally:
                await client.close()

    # Several uids at once ------------------------------------------------------------
    def tenant_variants(self, name: str) -> list[tuple[str, str, dict[str, Any]]]:
        """(label, attacker kind, its parameters) of each variant of a tenant attack; each runs
        with every uid count of ``--uids``."""
        p = self.plan
        if name == "holds-uids":
            return [("15 ms turns of 60 ms", "turns", {"period_s": 0.06, "turn_s": 0.015, "copy_s": 0.001})]
        if name == "status-flood":
            return [
                (f"{c} conn{'s' if c > 1 else ''}/uid", "status", {"conns": c, "window": 64}) for c in self.args.conns
            ]
        if name == "batch-flood":
            return [
                *(
                    (
                        f"refused, {c} conns/uid",
                        "batch",
                        {"conns": c, "mode": "refused", "window": 2, "segments": BATCH_SEGMENTS},
                    )
                    for c in self.args.conns
                    if c > 1
                ),
                (
                    "accepted, 4 conns/uid",
                    "batch",
                    {"conns": 4, "mode": "accepted", "window": 2, "segments": BATCH_SEGMENTS},
                ),
            ]
        if name == "pin-shared":
            return [("copies held into root's regions", "pin", {"copies": p.pin_copies})]
        raise ValueError(name)

    async def shared_regions(self, client: Client, uids: list[int | None]) -> list[Region]:
        """Root's device regions freed in a window, each shared with every attacker uid."""
        regions = []
        for _ in range(self.plan.frees):
            r = await client.alloc_device(MiB)
            for uid in sorted({u if u is not None else os.geteuid() for u in uids}):
                await client.share(r, uid)
            regions.append(r)
        return regions

    async def tenant_window(self, client: Client, pinger: Client, regions: list[Region]) -> dict[str, Any]:
        """One measurement window: root's urgent 1 MiB copies one at a time (bytes checked),
        pings on a connection of their own, and root freeing each of ``regions`` (its own, shared
        with the attacker uids) spread over the window; the bulk client's figure is taken from
        its completions afterwards (`throughput_between`)."""
        p = self.plan
        t0 = time.monotonic()
        end = t0 + p.tenant_window_s
        latency: list[float] = []
        rtts: list[float] = []
        frees: list[float] = []
        wrong, failed = 0, []
        timeouts: Counter[str] = Counter()

        async def urgent() -> None:
            nonlocal wrong
            while time.monotonic() < end:
                try:
                    probe = await within(
                        urgent_copies(client, HONEST_COPY, PROBE_BATCH, interval_s=p.probe_interval_s),
                        REPLY_TIMEOUT_S + PROBE_BATCH * p.probe_interval_s,
                    )
                except AssertionError:
                    wrong += 1
                    continue
                except PriodError as exc:
                    failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                except TimeoutError:
                    failed.append(f"Stalled: no reply to an urgent copy within {REPLY_TIMEOUT_S:g} s")
                    return
                latency.extend(probe.latency_us)

        # A ping or free with no answer within REPLY_TIMEOUT_S counts as that long (the figure
        # misses its target) and the window goes on: one stalled reply must not lose the others.
        async def ping() -> None:
            while time.monotonic() < end:
                q = time.perf_counter()
                try:
                    await within(pinger.ping(), REPLY_TIMEOUT_S)
                except TimeoutError:
                    timeouts["ping"] += 1
                rtts.append((time.perf_counter() - q) * 1e6)
                await asyncio.sleep(0.005)

        async def free() -> None:
            for i, r in enumerate(regions):
                await asyncio.sleep(max(0.0, t0 + p.tenant_window_s * (i + 1) / (len(regions) + 1) - time.monotonic()))
                q = time.perf_counter()
                try:
                    await within(client.free(r), REPLY_TIMEOUT_S)
                except TimeoutError:
                    timeouts["free"] += 1
                frees.append((time.perf_counter() - q) * 1e6)

        await asyncio.gather(urgent(), ping(), free())
        return {
            "t0": t0,
            "t1": time.monotonic(),
            "urgent_latency_us": summarize(latency),
            "ping_us": summarize(rtts),
            "free_us": {**summarize(frees, ("n", "p50", "max")), "each": frees},
            "timeouts": dict(timeouts),
            "verified_bytes": len(latency) * HONEST_COPY,
            "wrong_copies": wrong,
            "failed": _errors_summary(failed),
        }

    async def tenants(self, out: dict[str, Any], name: str) -> None:
        """A tenant attack: one daemon; root's bulk stream (another process, bytes
        checked) runs throughout; a window with no attacker, then one per variant and uid count
        with the attacker (one process, connections of every uid) running, then one more with none."""
        p = self.plan
        uids_most = attacker_uids(max(self.args.uids))
        with self.daemon(out) as d:
            honest = BulkProcess(
                d.socket_path, p.throughput_bytes, p.throughput_pipeline, priority="bulk", name="honest", verify=True
            )
            client = await Client.connect(d.socket_path, copy_path="daemon", name="honest")
            pinger = await Client.connect(d.socket_path, copy_path="daemon", name="honest-ping")
            try:
                honest.wait_ready()
                await asyncio.sleep(p.settle_s)
                out["alone"] = await self.tenant_window(client, pinger, await self.shared_regions(client, uids_most))
                ours = (await client.status())["clients_total"]  # the honest processes' connections
                runs: list[dict[str, Any]] = []
                for label, kind, params in self.tenant_variants(name):
                    for n in self.args.uids:
                        uids = attacker_uids(n)
                        regions = await self.shared_regions(client, uids)
                        _log(f"{name}: {label}, {n} uid{'s' if n > 1 else ''}")
                        with attacker(
                            kind, path=d.socket_path, uids=uids, regions=[r.id for r in regions], **params
                        ) as (_, result):
                            await asyncio.sleep(p.settle_s)
                            fig = await self.tenant_window(client, pinger, regions)
                        # The next window starts once the daemon is done with this attacker's
                        # connections: else they count against its connection limits there.
                        gone = await connections_dropped(client, ours, time.monotonic(), p.drain_wait_s)
                        runs.append(
                            {"variant": label, "uids": n, **fig, "attacker": result, "attacker_gone_after_s": gone}
                        )
                        await asyncio.sleep(p.settle_s / 2)
                out["runs"] = runs
                out["alone_after"] = await self.tenant_window(
                    client, pinger, await self.shared_regions(client, uids_most)
                )
                try:
                    got = honest.stop(REPLY_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    honest.kill()
                    raise Stalled(
                        f"the honest bulk client got no reply to its last copies within {REPLY_TIMEOUT_S:g} s of stopping"
                    ) from None
            finally:
                honest.kill()
                await pinger.close()
                await client.close()
        for w in [out["alone"], *out["runs"], out["alone_after"]]:
            w["bulk"] = throughput_between(got["done"], w["t0"], w["t1"])
        out["honest_bytes"] = {
            k: got.get(k, 0) for k in ("verified_bytes", "corrupted_bytes", "corrupted_copies", "unverified_bytes")
        }
        out["honest_errors"] = _errors_summary(got["errors"])


# -- report --------------------------------------------------------------------------------------
Row = tuple[str, str, str, str, str, str]
HEADS = ("attack", "honest figure", "unloaded", "with attacker", "target", "verdict")


def _latency_rows(name: str, r: dict[str, Any], what: str = "urgent 1 MiB copy") -> list[Row]:
    key = "latency_us" if "latency_us" in r["honest_unloaded"] else None
    base = r["honest_unloaded"][key] if key else r["honest_unloaded"]
    hit = r["honest_attacked"][key] if key else r["honest_attacked"]
    bound = 2 * base["p50"] + 5000
    bad = ""
    if key:
        wrong, failed = r["honest_attacked"]["wrong_copies"], r["honest_attacked"]["failed"]["count"]
        bad = f" ({hit['n']} ok, {wrong} with wrong bytes, {failed} failed)" if wrong or failed else ""
    return [
        (
            name,
            f"{what} p50",
            _ms(base["p50"]),
            _ms(hit["p50"]) + bad,
            f"<= 2x unloaded + 5 ms = {_ms(bound)}",
            _verdict(hit["p50"] <= bound),
        ),
        (name, f"{what} p99", _ms(base["p99"]), _ms(hit["p99"]), "report", "—"),
    ]


def _throughput_row(name: str, r: dict[str, Any]) -> Row:
    base, hit = r["honest_unloaded"]["gbps"], r["honest_attacked"]["gbps"]
    ratio = _ratio(hit, base)
    return (
        name,
        f"`{r['honest_class']}` throughput, other process, verified",
        f"{base:.2f} GB/s",
        f"{hit:.2f} GB/s ({ratio:.2f}x)",
        ">= 0.25x unloaded",
        _verdict(ratio >= 0.25),
    )


def build_rows(res: dict[str, Any]) -> list[Row]:
    """The closing table: one or more rows per attack that ran, then the integrity row."""
    rows: list[Row] = []
    for name, r in res["attacks"].items():
        if "error" in r:
            rows.append((name, "the attack did not complete", "—", r["error"][:160], "completes", "NOT met"))
            continue
        try:
            rows += attack_rows(name, r)
        except (KeyError, TypeError, ValueError) as exc:
            rows.append(
                (
                    name,
                    "figures missing (see attack.json)",
                    "—",
                    f"{type(exc).__name__}: {exc}",
                    "complete figures",
                    "NOT met",
                )
            )
    rows.append(integrity_row(res))
    return rows


def attack_rows(name: str, r: dict[str, Any]) -> list[Row]:
    """The table's rows for one attack."""
    rows: list[Row] = []
    if name == "urgent64":
        rows += _latency_rows("1. 64 MiB urgent copies, 4 outstanding", r)
    elif name == "urgent-dma":
        rows.append(_throughput_row("2. 64 MiB urgent DMA flood (express off)", r))
    elif name == "tiny":
        rows += _latency_rows("3. 1-byte urgent copy flood, 256 outstanding", r)
        att = r["attacker"]
        logs = r["daemon_log_bytes_per_s"]
        rate = (
            f"{att['copies_per_s']:,.0f} copies/s"
            if "copies_per_s" in att
            else "attacker killed, its copies unanswered"
        )
        rows.append(
            (
                "3. (same)",
                "daemon log growth (attacker's copies/s)",
                f"{logs['unloaded'] / 1e3:,.1f} kB/s",
                f"{logs['attacked'] / 1e3:,.1f} kB/s ({rate})",
                "report",
                "—",
            )
        )
    elif name == "deadline":
        answers = r["attacker"]["bad_deadline_answers"]
        total = sum(sum(v.values()) for v in answers.values())
        refused = sum(v.get("bad_request", 0) for v in answers.values())
        per = ", ".join(f"{k}: {v.get('bad_request', 0):,}/{sum(v.values()):,}" for k, v in answers.items())
        ok = total > 0 and refused == total
        rows.append(
            (
                "4. deadline_ms -1e12 / NaN / inf",
                "bad deadlines refused (bad_request)",
                "—",
                f"{refused:,} of {total:,} ({per})",
                "all",
                _verdict(ok),
            )
        )
        rows.append(_throughput_row("4. (same, beside 4 x 64 MiB bulk at deadline 0)", r))
    elif name == "holds":
        base, hit = r["honest_unloaded"]["gbps"], r["honest_attacked"]["gbps"]
        ratio = _ratio(hit, base)
        cut = sum(r["attacker"].get("daemon_direct", {}).get("cut", {}).values())
        rows.append(
            (
                "9. a hold page's copies never end, renewed every 2 ms",
                "`bulk` throughput, other process, verified",
                f"{base:.2f} GB/s",
                f"{hit:.2f} GB/s ({ratio:.2f}x; {cut:,} holds cut by the budget)",
                ">= 0.7x unloaded (1 - urgent_budget_share, less slack)",
                _verdict(ratio >= 0.7),
            )
        )
    elif name in TENANT_ATTACKS:
        verdicts = [tenant_verdict(tenant_alone(r), w) for w in r["runs"]]
        bad = [
            f"{w['variant']}, {w['uids']} uids: {', '.join(v)}" for w, v in zip(r["runs"], verdicts, strict=True) if v
        ]
        rows.append(
            (
                f"{TENANT_ATTACKS.index(name) + 10}. {name} (tenant)",
                "root's bulk, urgent p50, ping p99, free of its shared region",
                "alone, same daemon",
                f"{len(verdicts) - len(bad)} of {len(verdicts)} windows meet all four"
                + (f"; not: {'; '.join(bad)}" if bad else ""),
                "all (table below)",
                _verdict(not bad),
            )
        )
    elif name == "bombs":
        rows += _latency_rows("5. msgpack bombs, 4 connections", r, "ping")
        rss = r["rss_mib"]
        frames = sum(r["attacker"]["frames_sent"].values())
        rows.append(
            (
                "5. (same)",
                f"daemon RSS (VmRSS) growth, {frames:,} bombs in {r['attacker']['seconds']:.1f} s",
                f"{rss['before']:.0f} MiB",
                f"+{rss['peak_during'] - rss['before']:.0f} MiB at peak, +{rss['1_s_after'] - rss['before']:.0f} MiB 1 s after",
                f"report (the test's bound, for 8 bombs: < {RSS_GROWTH_MAX_MIB:.0f} MiB)",
                "—",
            )
        )
        replies = r["attacker"]["replies"]
        n = sum(replies.values())
        absent = _not_carried_out(r["attacker"])
        rows.append(
            (
                "5. (same)",
                "bombs refused with bad_frame",
                "—",
                f"{replies.get('bad_frame', 0):,} of {n:,}" + absent,
                "all",
                _verdict(n > 0 and replies.get("bad_frame", 0) == n and not absent),
            )
        )
    elif name == "idle":
        u, h = r["honest_unloaded"], r["honest_attacked"]
        rows.append(
            (
                "6. 256 connections, no hello, one uid",
                "root client connects",
                f"{'yes' if u['connected'] else 'no'}, {u['ms']:.1f} ms",
                f"{'yes' if h['connected'] else 'no'}, {h['ms']:.1f} ms",
                "yes",
                _verdict(h["connected"]),
            )
        )
        other = r.get("other_uid_attacked")
        if other is not None:
            rows.append(
                (
                    "6. (same)",
                    f"uid {other['uid']} client connects",
                    "—",
                    "yes" if other["connected"] else f"no: {other.get('error', '')[:60]}",
                    "report",
                    "—",
                )
            )
        att = r["attacker"]
        expired = att["closed_after_s"].get("no_hello", {"n": 0, "min": math.nan, "max": math.nan})
        open_left = sum(v for k, v in att["outcomes"].items() if "still open" in k)
        others = ", ".join(f"{v} {IDLE_OUTCOME_TEXT.get(k, k)}" for k, v in att["outcomes"].items() if k != "no_hello")
        ok = (
            expired["n"] > 0
            and open_left == 0
            and expired["min"] >= HELLO_TIMEOUT_S
            and expired["max"] <= HELLO_TIMEOUT_S + 2.0
        )
        rows.append(
            (
                "6. (same)",
                f"admitted silent connections closed (hello_timeout_s = {HELLO_TIMEOUT_S:g})",
                "—",
                f"{expired['n']} closed after {expired['min']:.2f}-{expired['max']:.2f} s; {others}",
                f"all, within {HELLO_TIMEOUT_S:g}-{HELLO_TIMEOUT_S + 2:g} s",
                _verdict(ok),
            )
        )
    elif name == "sigterm":
        u, h = r["honest_unloaded"], r["honest_attacked"]
        rows.append(
            (
                f"7. {r['clients_with_output_stuck']} non-reading clients, then SIGTERM",
                "daemon exit after SIGTERM",
                f"{u['seconds']:.2f} s, status {u['exit_code']}",
                f"{h['seconds']:.2f} s, status {h['exit_code']}",
                f"< {SIGTERM_MAX_S:g} s, status 0 (every client with replies waiting)",
                _verdict(
                    h["seconds"] < SIGTERM_MAX_S
                    and h["exit_code"] == 0
                    and r["clients_with_output_stuck"] >= r["attacker"]["connections"]
                ),
            )
        )
    elif name == "mute":
        per = r["rss_anon_per_client_mib"]
        bound = r["max_output_bytes"] / MiB + 1.0
        buffered = r["output_buffered"]
        rows.append(
            (
                "8. 100 non-reading clients",
                f"daemon anonymous RSS per client (max_output_bytes {r['max_output_bytes'] / MiB:g} MiB)",
                f"{r['rss_mib']['before']['RssAnon']:.0f} MiB in all",
                f"{per:.2f} MiB (replies waiting in the daemon per connection: "
                f"{buffered['min'] / MiB:.2f}-{buffered['max'] / MiB:.2f} MiB)",
                f"<= {bound:g} MiB, every connection with replies waiting",
                _verdict(per <= bound and buffered["n"] == r["attacker"]["connections"] and buffered["min"] > 0),
            )
        )
        pu, pa, pc = r["ping_unloaded"], r["ping_attacked"], r["ping_after_close"]
        rows.append(("8. (same)", "ping p50 while they do not read", _ms(pu["p50"]), _ms(pa["p50"]), "report", "—"))
        bound = 2 * pu["p50"] + 5000
        rows.append(
            (
                "8. (same, once they close)",
                "ping p50 in the next 2 s",
                _ms(pu["p50"]),
                f"{_ms(pc['p50'])} ({pc['n']} pings, max {_ms(pc['max'])}; daemon CPU {r['daemon_cpu_s_per_s_after_close']:.2f} s/s)",
                f"<= 2x unloaded + 5 ms = {_ms(bound)}",
                _verdict(pc["p50"] <= bound),
            )
        )
        dropped = r["connections_dropped_after_s"]
        rows.append(
            (
                "8. (same, once they close)",
                "the daemon is done with their connections after",
                "—",
                f"{dropped:.1f} s" if dropped is not None else f"> {r['drain_wait_s']:g} s (still serving them)",
                "report",
                "—",
            )
        )
    return rows


TENANT_HEADS = (
    "attack",
    "variant",
    "uids",
    "root bulk",
    "root urgent p50",
    "ping p99",
    "root free (max)",
    "verdict",
)


def tenant_alone(r: dict[str, Any]) -> dict[str, float]:
    """Root's figures alone: the mean of the windows before and after the attackers (one
    window of a few seconds on a 2-core machine varies by 10-20% from the next)."""
    ws = [r["alone"], r["alone_after"]]
    return {
        "gbps": sum(w["bulk"]["gbps"] for w in ws) / 2,
        "urgent_p50_us": sum(w["urgent_latency_us"]["p50"] for w in ws) / 2,
    }


def tenant_figures(alone: dict[str, float], w: dict[str, Any]) -> dict[str, float]:
    return {
        "bulk_ratio": _ratio(w["bulk"]["gbps"], alone["gbps"]),
        "urgent_p50_us": w["urgent_latency_us"]["p50"],
        "urgent_bound_us": 2 * alone["urgent_p50_us"] + 5000,
        "ping_p99_us": w["ping_us"]["p99"],
        "free_max_us": w["free_us"]["max"],
    }


def _outputs_full(status: dict[str, Any], pid: int, n: int) -> bool:
    """Whether ``n`` connections of process ``pid`` each have at least half of
    ``MUTE_MAX_OUTPUT`` of replies waiting in the daemon."""
    waiting = [c["output_buffered"] for c in status["clients"] if c["pid"] == pid]
    return len(waiting) >= n and min(waiting) >= MUTE_MAX_OUTPUT // 2


def _limited_note(attacker: dict[str, Any]) -> str:
    """How many of an attacker's connects the daemon's connection limits refused, if any."""
    n = attacker.get("connects_limited", {}).get("count", 0)
    return f" ({n} of its connects refused by the daemon's limits)" if n else ""


def _not_carried_out(attacker: dict[str, Any]) -> str:
    """Why an attacker's result shows it did not attack ("" if it did): its connections were
    refused (a hello the daemon does not take, a limit), so an honest figure measured beside it
    says nothing of the attack."""
    refused = attacker.get("connects_refused", {}).get("count", 0)
    if refused or attacker.get("connections", 1) == 0:
        first = attacker.get("connects_refused", {}).get("first", [""])
        return f" ({refused} connects refused: {first[0][:120]})" if refused else " (no connection)"
    hellos = attacker.get("hellos_refused", {}).get("count", 0)  # the bomber's
    return f" ({hellos} hellos refused)" if hellos else ""


def tenant_verdict(alone: dict[str, float], w: dict[str, Any]) -> list[str]:
    """The targets a window of a tenant attack misses (empty: all met). A figure that is not a
    number (no sample) misses."""
    f = tenant_figures(alone, w)
    missed = []
    if not f["bulk_ratio"] >= BULK_MIN_RATIO:
        missed.append("bulk")
    if not f["urgent_p50_us"] <= f["urgent_bound_us"]:
        missed.append("urgent")
    if not f["ping_p99_us"] < PING_P99_MAX_US:
        missed.append("ping")
    if not f["free_max_us"] <= FREE_MAX_US:
        missed.append("free")
    if w["wrong_copies"] or w["failed"]["count"]:
        missed.append("honest copies failed")
    if absent := _not_carried_out(w.get("attacker", {})):
        missed.append("attack not carried out" + absent)
    return missed


def tenant_rows(res: dict[str, Any]) -> list[tuple[str, ...]]:
    """The compact table of the tenant attacks: the alone window, then one row per variant and
    uid count."""
    rows: list[tuple[str, ...]] = []
    for name, r in res["attacks"].items():
        if name not in TENANT_ATTACKS or "error" in r:
            continue
        a = tenant_alone(r)
        for label, w in (("alone, before", r["alone"]), ("alone, after", r["alone_after"])):
            rows.append(
                (
                    name,
                    label,
                    "0",
                    f"{w['bulk']['gbps']:.2f} GB/s",
                    _ms(w["urgent_latency_us"]["p50"]),
                    _ms(w["ping_us"]["p99"]),
                    _ms(w["free_us"]["max"]),
                    "—",
                )
            )
        for w in r["runs"]:
            f = tenant_figures(a, w)
            missed = tenant_verdict(a, w)
            rows.append(
                (
                    name,
                    w["variant"],
                    str(w["uids"]),
                    f"{f['bulk_ratio']:.2f}x",
                    f"{_ms(f['urgent_p50_us'])} (<= {_ms(f['urgent_bound_us'])})",
                    _ms(f["ping_p99_us"]),
                    _ms(f["free_max_us"]),
                    ("met" if not missed else "NOT met: " + ", ".join(missed)) + _limited_note(w.get("attacker", {})),
                )
            )
    return rows


def integrity(res: dict[str, Any]) -> dict[str, Any]:
    """Over every attack: daemons run, crashed, honest bytes verified, corrupted, lost."""
    daemons = logged = verified = 0
    crashed: list[str] = []
    wrong: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for name, r in res["attacks"].items():
        for rec in r.get("daemons", []):
            daemons += 1
            if (
                rec.get("exit_code") != 0
                or rec.get("tracebacks")
                or not rec.get("running_at_end", False)
                or rec.get("serves_after", "yes") != "yes"
            ):
                crashed.append(name)
            logged += int(rec.get("errors_logged", 0))
        for key in ("honest_unloaded", "honest_attacked"):
            v = r.get(key)
            if isinstance(v, dict) and "wrong_copies" in v:
                verified += int(v["verified_bytes"])
                wrong[name] += int(v["wrong_copies"])
                failed[name] += int(v["failed"]["count"])
        for w in [r.get("alone"), *r.get("runs", []), r.get("alone_after")]:
            if isinstance(w, dict):  # a tenant attack's windows: root's urgent copies
                verified += int(w["verified_bytes"])
                wrong[name] += int(w["wrong_copies"])
                failed[name] += int(w["failed"]["count"])
        hb = r.get("honest_bytes", {})
        verified += int(hb.get("verified_bytes", 0))
        wrong[name] += int(hb.get("corrupted_copies", 0))
        failed[name] += int(r.get("honest_errors", {}).get("count", 0))
        if r.get("error_from") == "honest":
            failed[name] += 1  # an honest request failed outside the probes (the attack stopped there)
    return {
        "daemons": daemons,
        "crashed": crashed,
        "errors_logged": logged,
        "honest_verified_bytes": verified,
        "honest_wrong_copies": {k: v for k, v in wrong.items() if v},
        "honest_failed_copies": {k: v for k, v in failed.items() if v},
    }


def _per_attack(counts: dict[str, int]) -> str:
    return f"{sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else "0"


def integrity_row(res: dict[str, Any]) -> Row:
    i = res["integrity"] = integrity(res)
    which = f" ({', '.join(i['crashed'])})" if i["crashed"] else ""
    return (
        "all of the above",
        "daemons crashed or stuck, errors logged; honest bytes lost or corrupted",
        "—",
        f"{len(i['crashed'])} of {i['daemons']} daemons crashed or stuck{which}, {i['errors_logged']} errors logged; {i['honest_verified_bytes'] / 1e9:.2f} GB verified; "
        f"copies with wrong bytes: {_per_attack(i['honest_wrong_copies'])}; copies failed: {_per_attack(i['honest_failed_copies'])}",
        "0 crashes, 0 errors, 0 lost, 0 corrupted",
        _verdict(
            not i["crashed"]
            and i["errors_logged"] == 0
            and not i["honest_wrong_copies"]
            and not i["honest_failed_copies"]
        ),
    )


def format_table(rows: list[Row] | list[tuple[str, ...]], heads: tuple[str, ...] = HEADS) -> str:
    w = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    lines = [" | ".join(h.ljust(w[i]) for i, h in enumerate(heads)), "-+-".join("-" * x for x in w)]
    lines += [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def markdown_table(rows: list[Row] | list[tuple[str, ...]], heads: tuple[str, ...] = HEADS) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def checkout() -> dict[str, Any]:
    """The commit and the uncommitted changes of the checkout the daemons ran from (read-only git)."""
    try:
        head = subprocess.run(
            ["git", "-C", _ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", _ROOT, "status", "--short"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"head": head, "uncommitted": changed}


def uid_note() -> str:
    if os.geteuid() == 0:
        return f"the honest client runs as root (uid 0); attackers as uids {ATTACKER_UIDS[0]} down to {ATTACKER_UIDS[-1]} (two, or as many as a tenant attack has)"
    return (
        f"attackers and the honest client share uid {os.geteuid()} (not run as root): the daemon's per-uid fairness "
        "and limits cannot tell them apart here; run as root for separate uids"
    )


# -- entry point ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="priod against hostile clients: an honest client's figures without and with each attacker."
    )
    p.add_argument(
        "--backend", choices=["sim", "cuda", "auto"], default="sim", help="copy engine of the daemons (default: sim)"
    )
    p.add_argument("--config", help="TOML config for every daemon (each attack adds its own settings)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="extra setting for every daemon, e.g. scheduler__max_block_us=500",
    )
    p.add_argument("--out", default="out/attack", help="directory for attack.json (default: out/attack)")
    p.add_argument("--quick", action="store_true", help="fewer samples and shorter windows, about 1-1.5 minutes")
    p.add_argument("--only", help=f"comma-separated attacks to run, of: {', '.join(ATTACKS)}")
    p.add_argument(
        "--uids", default="1,3,8", help="attacker uid counts of each tenant attack (default 1,3,8; at most 8)"
    )
    p.add_argument(
        "--conns",
        default="1,4,32",
        help="connections per uid of status-flood, and (those > 1) of batch-flood's refused batches (default 1,4,32)",
    )
    args = p.parse_args(argv)
    try:
        args.uids = [int(x) for x in args.uids.split(",")]
        args.conns = [int(x) for x in args.conns.split(",")]
    except ValueError:
        p.error("--uids and --conns take comma-separated whole numbers")
    if not all(1 <= n <= len(ATTACKER_UIDS) for n in args.uids) or not all(c >= 1 for c in args.conns):
        p.error(f"--uids: 1 to {len(ATTACKER_UIDS)} each; --conns: 1 or more each")
    args.attacks = ATTACKS if not args.only else tuple(a.strip() for a in args.only.split(","))
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        p.error(f"--only: unknown attack(s) {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    try:
        args.env = settings_env(args.set)
    except ValueError as exc:
        p.error(str(exc))
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan.quick() if args.quick else Plan()
    r = Run(args, plan)
    res: dict[str, Any] = {
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": machine(euid=os.geteuid()),
        "checkout": checkout(),
        "uids": uid_note(),
        "plan": asdict(plan),
        "settings": {"backend": args.backend, "config": args.config, "env": r.env},
        "attacks": {},
    }
    steps: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {
        "urgent64": r.urgent64,
        "urgent-dma": r.urgent_dma,
        "tiny": r.tiny,
        "deadline": r.deadline,
        "bombs": r.bombs,
        "idle": r.idle,
        "sigterm": r.sigterm,
        "mute": r.mute,
        "holds": r.holds,
        **{name: functools.partial(r.tenants, name=name) for name in TENANT_ATTACKS},
    }
    for name in args.attacks:
        out: dict[str, Any] = {}
        res["attacks"][name] = out
        _log(f"{name}: start")
        t0 = time.monotonic()
        try:
            await steps[name](out)
        except Exception as exc:  # one attack failing must not hide the others' figures
            out["error"] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (PriodError, Stalled, TimeoutError)):
                out["error_from"] = "honest"  # attackers fail in their own processes
            _log(f"{name}: FAILED: {out['error']}")
        out["elapsed_s"] = time.monotonic() - t0
        _log(f"{name}: done in {out['elapsed_s']:.1f} s")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_attacker"]:
        return attacker_main(argv[1], argv[2])
    args = parse_args(argv)
    started = time.monotonic()
    res = uvloop.run(run(args))
    res["elapsed_s"] = time.monotonic() - started
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attack.json")
    with open(path, "w") as fp:  # first without the table: a bug in the report must not lose the figures
        json.dump(res, fp, indent=1, default=float)
    rows = build_rows(res)
    res["table"] = [dict(zip(HEADS, row, strict=True)) for row in rows]
    res["table_markdown"] = markdown_table(rows)
    try:
        tenants = tenant_rows(res)
    except (KeyError, TypeError, ValueError) as exc:
        tenants = []
        _log(f"tenant table: figures missing: {type(exc).__name__}: {exc}")
    if tenants:
        res["tenant_table_markdown"] = markdown_table(tenants, TENANT_HEADS)
    with open(path, "w") as fp:
        json.dump(res, fp, indent=1, default=float)
    print()
    print(
        f"priod attack: {res['machine']['nproc']} CPUs, Python {res['machine']['python']}, backend {args.backend}, "
        f"{res['elapsed_s']:.0f} s; full numbers in {path}"
    )
    print(f"uids: {res['uids']}")
    print(format_table(rows))
    if tenants:
        print()
        print(
            f"tenant attacks, root beside several attacker uids (targets: bulk >= {BULK_MIN_RATIO}x alone, urgent p50 <= 2x alone + 5 ms, "
            f"ping p99 < {PING_P99_MAX_US / 1000:g} ms, free <= {FREE_MAX_US / 1000:g} ms)"
        )
        print(format_table(tenants, TENANT_HEADS))
    return 0 if all(row[5] != "NOT met" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
