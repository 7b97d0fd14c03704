"""Lab: where a direct urgent copy's time goes on an idle link (no daemon, no bulk).

64 KiB h2d, one copy every 5 ms (as the benchmark's idle rows), alternating per round:
- sync: cudaMemcpyAsync, then cudaStreamSynchronize (bench_gpu.py's in-process idle-5ms row);
- query: cudaMemcpyAsync, then spinning on cudaStreamQuery (what DirectCopies does);
- query default: the same with cudaMemcpyDefault (the runtime finds the direction);
- direct: DirectPair.copy (the hold page written, the device scope, the same copy and spin);
- direct _run: its inner call alone (no device scope);
- direct, runtime scope: DirectPair.copy with the device scope calling cudaGetDevice each time
  (the shipped one; runs 3 and 4 of idle_probe_out.txt compared it with two others);
- and each of those after 300 us of spinning on the CPU first (the CPU awake, as a copy
  announced ahead is), latency from the copy's issue.
The hold page is a memfd of our own (no daemon reads it: its writes cost what they cost).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
import cupy as cp

import priod.direct as priod_direct
from priod.direct import DirectCopies, HoldPage
from priod.engines.cuda._driver import bindings, check, gpu_uuid
from priod.holds import PAGE_BYTES

N = 64 << 10
ROUNDS = int(os.environ.get("ROUNDS", "300"))
rt, _ = bindings()
check(rt.cudaSetDevice(0))
host = cp.cuda.alloc_pinned_memory(N)
dev = cp.cuda.alloc(N)
_, high = check(rt.cudaDeviceGetStreamPriorityRange())
stream = check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, high))
kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
fd = os.memfd_create("holds")
os.ftruncate(fd, PAGE_BYTES)
lanes = [{"device": 0, "device_uuid": gpu_uuid(0), "direction": d} for d in ("h2d", "d2h")]
direct = DirectCopies(HoldPage(fd, lanes))
pair = direct.pair((dev.ptr, N), (host.ptr, N))
ok, not_ready = rt.cudaError_t.cudaSuccess, rt.cudaError_t.cudaErrorNotReady


def sync() -> None:
    check(rt.cudaMemcpyAsync(dev.ptr, host.ptr, N, kind, stream))
    check(rt.cudaStreamSynchronize(stream))


def query(copy_kind: object = kind) -> None:
    check(rt.cudaMemcpyAsync(dev.ptr, host.ptr, N, copy_kind, stream))
    while True:
        (err,) = rt.cudaStreamQuery(stream)
        if err == ok:
            return
        if err != not_ready:
            check((err,))


def query_default() -> None:
    query(rt.cudaMemcpyKind.cudaMemcpyDefault)


def by_pair() -> None:
    pair.copy(N)


def by_run() -> None:  # DirectPair.copy less its checks and its device scope
    direct._run(0, pair._slot, dev.ptr, host.ptr, N)


class RuntimeScope:
    """DeviceScope as it was: the runtime's cudaGetDevice on every entry."""

    def __init__(self, device: int) -> None:
        self._device = device

    def __enter__(self) -> None:
        self._previous = int(check(rt.cudaGetDevice()))
        if self._previous != self._device:
            check(rt.cudaSetDevice(self._device))

    def __exit__(self, *exc: object) -> None:
        if self._previous != self._device:
            rt.cudaSetDevice(self._previous)


def by_pair_runtime_scope() -> None:
    shipped = priod_direct.DeviceScope
    priod_direct.DeviceScope = RuntimeScope  # type: ignore[misc]
    try:
        pair.copy(N)
    finally:
        priod_direct.DeviceScope = shipped  # type: ignore[misc]


cases = {"sync": sync, "query": query, "query default": query_default, "direct": by_pair, "direct _run": by_run,
         "direct, runtime scope": by_pair_runtime_scope}
_, drv = bindings()
for label, call in (("cudaGetDevice", rt.cudaGetDevice), ("cuCtxGetDevice", drv.cuCtxGetDevice)):
    t = time.perf_counter()
    for _ in range(10_000):
        call()
    print(f"{label}: {(time.perf_counter() - t) / 10_000 * 1e6:.2f} us a call, back to back")
lat: dict[str, list[float]] = {f"{k}{w}": [] for k in cases for w in ("", " +awake")}
for fn in cases.values():  # warm
    for _ in range(5):
        fn()
for _ in range(ROUNDS):
    for name, fn in cases.items():
        for awake in (False, True):
            time.sleep(0.005)
            if awake:
                until = time.perf_counter() + 300e-6
                while time.perf_counter() < until:
                    pass
            t0 = time.perf_counter()
            fn()
            lat[name + (" +awake" if awake else "")].append((time.perf_counter() - t0) * 1e6)
for name, v in lat.items():
    print(f"{name:22s} p50 {np.percentile(v, 50):6.1f}  p99 {np.percentile(v, 99):6.1f} us  ({len(v)} copies of 64 KiB h2d, 5 ms apart)")
