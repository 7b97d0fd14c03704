"""Lab: why the daemon's pusher pays ~1.66 us a segment of cuMemcpyBatchAsync where a probe pays 0.9-1.1.

One process, the daemon's own `BatchedDma` (calls of 64 segments), 64 KiB blocks at scattered
offsets, h2d, enqueue time per call (the GPU runs behind), then the stream's GB/s. Host memory:
- alloc: cudaHostAlloc(portable | mapped), as a probe's (or CuPy's) pinned memory;
- memfd: a memfd mapping pinned with cudaHostRegister(mapped | portable), as the daemon pins a
  client's region (engines/cuda/memory.py);
- memfd+64: the same with 64 more such regions registered (a daemon serving many clients);
and the calls on a second thread while the main thread runs Python (the daemon's loop), with the
switch interval at its default and at 20 us.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.getcwd())
from priod.engines.cuda._driver import bindings, check
from priod.engines.cuda.batched import BatchedDma

MiB = 1 << 20
SIZE = 256 * MiB
BLOCK = 64 << 10
CALLS = 400
rt, drv = bindings()
check(rt.cudaSetDevice(0))
check(rt.cudaFree(0))
dev = int(check(rt.cudaMalloc(SIZE)))
stream = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
keep: list = []


def memfd_region(nbytes: int) -> int:
    fd = os.memfd_create("probe")
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    m.write(b"\1" * nbytes)  # the pages exist before pinning, as the daemon has them
    a = np.frombuffer(m, dtype=np.uint8)
    addr = int(a.ctypes.data)
    check(rt.cudaHostRegister(addr, nbytes, flags))
    keep.append((fd, m, a))
    return addr


def run(host: int, label: str) -> None:
    dma = BatchedDma()
    rng = np.random.default_rng(0)
    n = SIZE // BLOCK
    offs = [(rng.permutation(n)[:64].astype(np.uint64) * BLOCK, rng.permutation(n)[:64].astype(np.uint64) * BLOCK) for _ in range(16)]
    sizes = np.full(64, BLOCK, dtype=np.uint64)
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    per_call = []
    check(rt.cudaStreamSynchronize(stream))
    t0 = time.perf_counter()
    for i in range(CALLS):
        d, s = offs[i % 16]
        a = time.perf_counter()
        dma.copy(dev, host, d, s, sizes, kind, stream)
        per_call.append(time.perf_counter() - a)
    t1 = time.perf_counter()
    check(rt.cudaStreamSynchronize(stream))
    t2 = time.perf_counter()
    us = np.array(per_call) * 1e6 / 64
    print(f"{label:34s} enqueue p50 {np.median(us):.2f} p90 {np.percentile(us, 90):.2f} us/segment; enqueue {t1 - t0:.3f} s, "
          f"stream {CALLS * 64 * BLOCK / (t2 - t0) / 1e9:.1f} GB/s", flush=True)


def threaded(host: int, label: str) -> None:
    done = threading.Event()
    th = threading.Thread(target=lambda: (run(host, label), done.set()))
    th.start()
    x = 0
    while not done.is_set():  # the loop thread: Python bytecode all the time
        x += 1
    th.join()


alloc = int(check(rt.cudaHostAlloc(SIZE, rt.cudaHostAllocPortable | rt.cudaHostAllocMapped)))
memfd = memfd_region(SIZE)
for rnd in range(2):
    run(alloc, f"[{rnd}] alloc")
    run(memfd, f"[{rnd}] memfd")
if True:
    for _ in range(64):
        memfd_region(4 * MiB)
    for rnd in range(2):
        run(memfd, f"[{rnd}] memfd+64")
        run(alloc, f"[{rnd}] alloc+64")
    for interval in (sys.getswitchinterval(), 2e-5):
        sys.setswitchinterval(interval)
        threaded(memfd, f"memfd+64, thread, switch {interval * 1e6:.0f} us")
        threaded(alloc, f"alloc+64, thread, switch {interval * 1e6:.0f} us")
