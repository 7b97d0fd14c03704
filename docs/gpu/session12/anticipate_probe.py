"""Lab (session 12): bulk chunks that grow between urgent copies that come on a beat.

Derived from docs/gpu/stream_probe/gate_probe.py (its text below): two contexts in one process,
the client's urgent copy every 5 ms closing a gate in front of each queued bulk chunk itself.
- gate: 4 MiB gated chunks throughout (the daemon's short bound, 150 us).
- anticipate: large gated chunks (BIG MiB) while the next urgent copy is not expected, 4 MiB ones
  from LEAD before it is expected (the last copy's start plus the last gap between starts) until
  AFTER past the end of a copy. LEAD covers two large chunks (one running, one queued) and a
  margin, so no large chunk is left on the engine when the copy comes on time. A copy that comes
  early waits for a large chunk: what the p99 shows if the beat is not kept.

Can a GPU-side gate stop a queued bulk chunk from starting, so an urgent copy in another
context waits for the running chunk only?

Two contexts in one process (cuCtxCreate), as the daemon (B) and a client's direct copy (U).
A bulk thread feeds h2d chunks of CH MiB in B, at most DEPTH in flight, and hands out none while
the main thread has an urgent copy pending (the daemon's hold today). The main thread issues
urgent h2d copies in U, one every 5 ms.
- hold: as the daemon does today.
- gate-early (CASES=early): as gate, the copy issued 300 us after the gate closed, when the
  running chunk has ended and the stream waits at the gate (its latency counted from the issue).
- gate: each bulk chunk is preceded on its stream by cuStreamWaitValue32(word == 0), the word in
  B's mapped pinned memory; the main thread writes 1 to it before its urgent copy and 0 after, so
  a queued chunk that has not started waits on the GPU, and goes the moment the word is 0 again.
DIR=d2h: both directions device to host; CASES=early-only: gate-early alone; ROUNDS (2); N
copies per size (100); with OUT set, every copy's latency goes to $OUT/gate_probe.json.
Prints urgent p50/p99 per size, bulk GB/s while urgent copies come (x one 2 GiB copy), and bulk
alone. The question for the gate: does a channel waiting on a semaphore let the copy engine switch
to the other context at once (else the urgent copy waits out a time slice)?
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

import numpy as np
from cuda.bindings import driver as cu

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (64 * KiB, 1 * MiB, 16 * MiB)
OK = cu.CUresult.CUDA_SUCCESS


def check(r):
    err, *rest = r if isinstance(r, tuple) else (r,)
    if err != OK:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else (rest or None)


def new_ctx(dev):
    try:
        return check(cu.cuCtxCreate(None, 0, dev))  # CUDA 13 signature (params, flags, dev)
    except TypeError:
        return check(cu.cuCtxCreate(0, dev))


check(cu.cuInit(0))
dev = check(cu.cuDeviceGet(0))
ctx_b, ctx_u = new_ctx(dev), new_ctx(dev)
portable = cu.CU_MEMHOSTALLOC_PORTABLE
check(cu.cuCtxSetCurrent(ctx_b))
hb = check(cu.cuMemHostAlloc(2 * GiB, portable))
db = check(cu.cuMemAlloc(2 * GiB))
sb = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
gate_host = check(cu.cuMemHostAlloc(4096, portable | cu.CU_MEMHOSTALLOC_DEVICEMAP))
gate_dev = check(cu.cuMemHostGetDevicePointer(gate_host, 0))
gate = (ctypes.c_uint32 * 1).from_address(int(gate_host))
gate[0] = 0
AFTER_S = 200e-6
MARGIN_S = 150e-6
beat = {"start": 0.0, "gap": 0.0, "end": 0.0}
"""The urgent copies' beat as the bulk feeder sees it: last start, last gap between starts, last end."""
check(cu.cuCtxSetCurrent(ctx_u))
hu = check(cu.cuMemHostAlloc(16 * MiB, portable))
du = check(cu.cuMemAlloc(16 * MiB))
lo, hi = check(cu.cuCtxGetStreamPriorityRange())
su = check(cu.cuStreamCreateWithPriority(cu.CUstream_flags.CU_STREAM_NON_BLOCKING, hi))
EQ = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
EARLY_S = 300e-6
D2H = os.environ.get("DIR", "h2d") == "d2h"
"""DIR=d2h: bulk and urgent copies device to host instead (both the same direction)."""


def copy(dst_dev: object, dst_host: object, n: int, stream: object) -> None:
    """One copy of ``n`` bytes between a device and a host buffer, in the probe's direction."""
    if D2H:
        check(cu.cuMemcpyDtoHAsync(dst_host, dst_dev, n, stream))
    else:
        check(cu.cuMemcpyHtoDAsync(dst_dev, dst_host, n, stream))


def raw_gbps() -> float:
    check(cu.cuCtxSetCurrent(ctx_b))
    check(cu.cuStreamSynchronize(sb))
    t0 = time.perf_counter()
    copy(db, hb, 2 * GiB, sb)
    check(cu.cuStreamSynchronize(sb))
    return 2 * GiB / (time.perf_counter() - t0) / 1e9


def case(mode: str, ch_mib: int, depth: int, n: int, big_mib: int = 0) -> dict:
    ch = ch_mib * MiB
    big = big_mib * MiB
    lead_s = 2 * big / (55e9) + MARGIN_S
    beat.update(start=0.0, gap=0.0, end=0.0)
    sizes_used = {ch: 0, big: 0}
    hold = threading.Event()
    stop = threading.Event()
    moved: list = []

    def bulk() -> None:
        check(cu.cuCtxSetCurrent(ctx_b))
        evs: list = []
        off = 0
        while not stop.is_set():
            while evs and cu.cuEventQuery(evs[0][0])[0] == OK:
                e, nbytes = evs.pop(0)
                check(cu.cuEventDestroy(e))
                moved.append((time.perf_counter(), nbytes))
            if len(evs) < depth and not hold.is_set():
                size = ch
                if mode == "anticipate":
                    now = time.perf_counter()
                    expected = beat["start"] + beat["gap"]
                    if beat["gap"] and now - beat["end"] >= AFTER_S and now < expected - lead_s:
                        size = big
                sizes_used[size] += 1
                check(cu.cuStreamWaitValue32(sb, gate_dev, 0, EQ))
                copy(int(db) + off, int(hb) + off, size, sb)
                e = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
                check(cu.cuEventRecord(e, sb))
                evs.append((e, size))
                off = (off + size) % (2 * GiB - max(ch, big))
            else:
                time.sleep(0)
        gate[0] = 0
        check(cu.cuStreamSynchronize(sb))

    th = threading.Thread(target=bulk)
    th.start()
    time.sleep(0.3)
    t_alone0 = time.perf_counter()
    time.sleep(0.5)
    t_alone1 = time.perf_counter()
    check(cu.cuCtxSetCurrent(ctx_u))
    ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    rows = {}
    series: dict = {}
    t_u0 = time.perf_counter()
    for s in SIZES:
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            hold.set()
            if beat["start"]:
                beat["gap"] = t0 - beat["start"]
            beat["start"] = t0
            gate[0] = 1
            if mode == "gate-early":
                # The gate closes well before the copy is issued: the running chunk ends first,
                # and the daemon's stream sits at its closed gate with nothing else on the engine.
                while time.perf_counter() < t0 + EARLY_S:
                    pass
            copy(du, hu, s, su)
            check(cu.cuEventRecord(ev, su))
            while cu.cuEventQuery(ev)[0] != OK:
                pass
            gate[0] = 0
            beat["end"] = time.perf_counter()
            hold.clear()
            lat.append((time.perf_counter() - t0) * 1e6 - (EARLY_S * 1e6 if mode == "gate-early" else 0.0))
            while time.perf_counter() < t0 + 0.005:
                time.sleep(0.0005)
        rows[s] = (float(np.percentile(lat, 50)), float(np.percentile(lat, 99)))
        series[s] = lat
    t_u1 = time.perf_counter()
    stop.set()
    th.join()

    def gbps(a: float, b: float) -> float:
        return sum(nb for t, nb in moved if a <= t < b) / (b - a) / 1e9
    return {"mode": mode, "ch_mib": ch_mib, "big_mib": big_mib, "chunks": {str(k): v for k, v in sizes_used.items()}, "depth": depth,
            "urgent": rows, "series": {str(k): v for k, v in series.items()},
            "bulk_alone": gbps(t_alone0, t_alone1), "bulk_urgent": gbps(t_u0, t_u1)}


def main() -> int:
    n = int(os.environ.get("N", "100"))
    sys.setswitchinterval(2e-5)  # two Python threads: the bulk feeder must not wait 5 ms for the GIL
    cases = [("gate", 4, 2, 0), ("anticipate", 4, 2, 16), ("anticipate", 4, 2, 32)]
    raw = max(raw_gbps() for _ in range(3))
    results = []
    for rnd in range(int(os.environ.get("ROUNDS", "2"))):
        for mode, ch, depth, big in cases:
            r = case(mode, ch, depth, n, big)
            results.append(r)
            u = r["urgent"]
            print(f"round {rnd} {mode:10s} {ch}/{big} MiB x {depth}: " + "  ".join(f"{s >> 10}K {p[0]:.0f}/{p[1]:.0f}" for s, p in u.items())
                  + f"  bulk alone {r['bulk_alone'] / raw:.3f}  with urgent {r['bulk_urgent'] / raw:.3f}  chunks {r['chunks']}", flush=True)
    print(f"raw one 2 GiB copy: {raw:.1f} GB/s; urgent p50/p99 us, bulk x raw")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "anticipate_probe.json"), "w") as f:
            json.dump({"raw": raw, "results": [{**r, "urgent": {str(k): v for k, v in r["urgent"].items()}} for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
