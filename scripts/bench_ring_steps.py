#!/usr/bin/env python3
"""What each step of a copy's round trip costs, as a frame on the socket and as a descriptor on
the copy ring, side by side in one run (docs/design.md, "The copy ring").

    .venv/bin/python scripts/bench_ring_steps.py        # about 20 s

In-process steps (each timed over many repetitions, median of rounds, microseconds):
client encode, daemon decode and check, daemon reply, client reply decode. Then the wake-up
floor between two processes: a blocking ping-pong over a Unix socket pair (64-byte frames) and
over two eventfds, round trip, p50 / p99. The daemon's own work between (scheduler, engine) is
the same for both and not here: `scripts/bench.py` measures whole round trips.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from priod.wire.frames import REQUEST_LIMITS, FrameDecoder, encode
from priod.wire.messages import Copy, decode_request
from priod.wire.replies import CopyReply
from priod.wire.ring import (
    RING_ENTRIES,
    CompletionReader,
    CompletionWriter,
    SubmissionReader,
    SubmissionWriter,
    ring_bytes,
    write_header,
)


def per_call_us(fn: Callable[[], object], n: int = 20_000, rounds: int = 5) -> float:
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def in_process_steps() -> dict[str, dict[str, float]]:
    req = Copy(3, 4, 65536, 0, 0, "urgent")
    reply = CopyReply(65536, 12.345, 23.456, 35.801, "dma")
    frame = encode(req.encode(7))
    reply_frame = encode(reply.encode(7))
    dec = FrameDecoder(limits=REQUEST_LIMITS)
    rdec = FrameDecoder()

    def frame_decode() -> None:
        (msg,) = dec.feed(frame)
        decode_request(msg)

    def reply_decode() -> None:
        (msg,) = rdec.feed(reply_frame)
        CopyReply.decode(msg)

    m = mmap.mmap(-1, ring_bytes())
    buf = memoryview(m)
    write_header(buf)
    sw, sr = SubmissionWriter(buf, RING_ENTRIES), SubmissionReader(buf, RING_ENTRIES)
    cw, cr = CompletionWriter(buf, RING_ENTRIES), CompletionReader(buf, RING_ENTRIES)

    def ring_submit_take() -> None:
        sw.try_submit(7, req)
        taken = sr.take()
        assert taken is not None
        copy = taken[1]
        assert isinstance(copy, Copy)
        copy.check()

    def ring_complete_drain() -> None:
        cw.try_complete(7, 65536, 12.345, 23.456, 35.801, "dma", False)
        cr.drain()

    out = {
        "frame": {
            "client_encode": per_call_us(lambda: encode(req.encode(7))),
            "daemon_decode_check": per_call_us(frame_decode),
            "daemon_reply_encode": per_call_us(lambda: encode(reply.encode(7))),
            "client_reply_decode": per_call_us(reply_decode),
        },
        "ring": {
            "submit_and_take_check": per_call_us(ring_submit_take),
            "complete_and_drain": per_call_us(ring_complete_drain),
        },
    }
    for side in (sw, sr, cw, cr):
        side.release()
    buf.release()
    m.close()
    return out


def ping_pong(kind: str, n: int) -> list[float]:
    """Round trips between this process and a child, each side blocking in read."""
    if kind == "socket":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        frame = b"x" * 64
        pid = os.fork()
        if pid == 0:
            a.close()
            for _ in range(n):
                b.recv(64)
                b.send(frame)
            os._exit(0)
        b.close()
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            a.send(frame)
            a.recv(64)
            lat.append((time.perf_counter() - t0) * 1e6)
        a.close()
    else:
        to_child, to_parent = os.eventfd(0), os.eventfd(0)
        pid = os.fork()
        if pid == 0:
            for _ in range(n):
                os.eventfd_read(to_child)
                os.eventfd_write(to_parent, 1)
            os._exit(0)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            os.eventfd_write(to_child, 1)
            os.eventfd_read(to_parent)
            lat.append((time.perf_counter() - t0) * 1e6)
        os.close(to_child)
        os.close(to_parent)
    os.waitpid(pid, 0)
    return lat[n // 10 :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/ring_steps", help="directory for ring_steps.json")
    p.add_argument("--wakeups", type=int, default=5000)
    args = p.parse_args()
    res: dict[str, object] = {"steps_us": in_process_steps()}
    wake: dict[str, dict[str, float]] = {}
    for kind in ("socket", "eventfd", "socket", "eventfd"):
        lat = ping_pong(kind, args.wakeups)
        prev = wake.get(kind, {"p50": 0.0, "p99": 0.0})
        wake[kind] = {
            "p50": max(prev["p50"], float(np.percentile(lat, 50))),
            "p99": max(prev["p99"], float(np.percentile(lat, 99))),
        }
    res["wakeup_round_trip_us"] = wake
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ring_steps.json"), "w") as fp:
        json.dump(res, fp, indent=1)
    steps = res["steps_us"]
    assert isinstance(steps, dict)
    f, r = steps["frame"], steps["ring"]
    frame_total = sum(f.values())
    ring_total = sum(r.values())
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; full numbers in {args.out}/ring_steps.json")
    print("step (us per copy)                         | frame | ring")
    print(
        f"client encode / publish + daemon take+check | {f['client_encode'] + f['daemon_decode_check']:5.2f} | {r['submit_and_take_check']:5.2f}"
    )
    print(
        f"daemon reply / complete + client read      | {f['daemon_reply_encode'] + f['client_reply_decode']:5.2f} | {r['complete_and_drain']:5.2f}"
    )
    print(f"total in-process                           | {frame_total:5.2f} | {ring_total:5.2f}")
    print(
        "wake-up round trip between processes p50/p99 us: socket "
        f"{wake['socket']['p50']:.1f}/{wake['socket']['p99']:.1f}, eventfd {wake['eventfd']['p50']:.1f}/{wake['eventfd']['p99']:.1f}"
    )


if __name__ == "__main__":
    main()
