"""Is the copy engine's ~2.7 us a chunk the cost of a copy, or of stream order between copies?

In-process on one GPU, no daemon. Back-to-back DMA chunks of 1-8 MiB from a 2 GiB region:
- on one stream (each copy ordered after the one before it, as the daemon's bulk stream does);
- alternating over two or four streams of the same context (chunks of one bulk copy need no
  order between them);
- as one-segment cuMemcpyBatchAsync calls on one stream;
each all enqueued at once, and fed at depth 2 by a thread spinning on the oldest chunk's event
(what a daemon that reacts at once could reach). h2d and d2h. GB/s and x one 2 GiB copy.
"""
import os, sys, time, json
import numpy as np
sys.path.insert(0, os.getcwd())
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.batched import BatchedDma

rt, drv = bindings()
MiB = 1 << 20
eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
REGION = 2048 * MiB
fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
hp, dp = host.host_pointer, dev.pointer
ok = rt.cudaError_t.cudaSuccess
streams = [check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)) for _ in range(4)]
events = [check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)) for _ in range(8)]
bd = BatchedDma()
out = {"rows": []}


def sync():
    for s in streams:
        check(rt.cudaStreamSynchronize(s))


def ends(kind):
    return (dp, hp) if kind == rt.cudaMemcpyKind.cudaMemcpyHostToDevice else (hp, dp)


def one_copy(kind):
    d, s = ends(kind)
    sync(); t0 = time.perf_counter()
    check(rt.cudaMemcpyAsync(d, s, REGION, kind, streams[0])); sync()
    return REGION / (time.perf_counter() - t0) / 1e9


def run(kind, size, nstreams, depth=None, batch=False):
    """GB/s of REGION moved in `size` chunks over `nstreams` streams; depth None: all at once."""
    d, s = ends(kind)
    n = REGION // size
    one = np.array([size], dtype=np.uint64)
    sync(); t0 = time.perf_counter()
    for i in range(n):
        st = streams[i % nstreams]
        if depth is not None and i >= depth:
            e = events[(i - depth) % 8]
            while rt.cudaEventQuery(e)[0] != ok:
                pass
        if batch:
            off = np.array([i * size], dtype=np.uint64)
            bd.copy(d, s, off, off, one, kind, st)
        else:
            check(rt.cudaMemcpyAsync(d + i * size, s + i * size, size, kind, st))
        if depth is not None:
            check(rt.cudaEventRecord(events[i % 8], st))
    sync()
    return n * size / (time.perf_counter() - t0) / 1e9


for name, kind in (("h2d", rt.cudaMemcpyKind.cudaMemcpyHostToDevice), ("d2h", rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)):
    raw = max(one_copy(kind) for _ in range(3))
    print(f"{name}: one 2 GiB copy {raw:.1f} GB/s; chunks x that (best of 2)", flush=True)
    print(f"  {'chunk':>6s} {'1 stream':>9s} {'2 streams':>9s} {'4 streams':>9s} {'batch1':>9s} | fed depth 2: {'1 stream':>9s} {'2 streams':>9s}", flush=True)
    for mib in (1, 2, 4, 8):
        size = mib * MiB
        cells = {
            "one": max(run(kind, size, 1) for _ in range(2)),
            "two": max(run(kind, size, 2) for _ in range(2)),
            "four": max(run(kind, size, 4) for _ in range(2)),
            "batch1": max(run(kind, size, 1, batch=True) for _ in range(2)),
            "fed_one": max(run(kind, size, 1, depth=2) for _ in range(2)),
            "fed_two": max(run(kind, size, 2, depth=2) for _ in range(2)),
        }
        out["rows"].append({"dir": name, "raw": raw, "mib": mib, **cells})
        r = {k: v / raw for k, v in cells.items()}
        print(f"  {mib:>4d}Mi {r['one']:9.3f} {r['two']:9.3f} {r['four']:9.3f} {r['batch1']:9.3f} |              {r['fed_one']:9.3f} {r['fed_two']:9.3f}", flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "stream_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
