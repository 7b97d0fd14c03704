"""Two questions, in-process on one GPU, no daemon.

1. Chunked bulk: how much of the link do back-to-back DMA chunks of 2-27 MiB keep, enqueued all
   at once (the engine's own cost per copy) and fed at depth 2/3 by a Python thread that spins on
   the oldest chunk's event (what a daemon that reacts at once could reach)?
2. Batched DMA from a second thread: what does cuMemcpyBatchAsync cost a segment when another
   thread of the process runs Python, spins on cuEventQuery, or polls 6,000 times a second?
"""
import os, sys, time, threading, json
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
lane = eng._devices[0].h2d
stream, kind = lane.dma, lane.kind
hp, dp = host.host_pointer, dev.pointer
ok = rt.cudaError_t.cudaSuccess
out = {}

def event():
    return check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))

def sync():
    check(rt.cudaStreamSynchronize(stream))

def one_copy(total):
    sync(); t0 = time.perf_counter()
    check(rt.cudaMemcpyAsync(dp, hp, total, kind, stream)); sync()
    return total / (time.perf_counter() - t0) / 1e9

def all_at_once(size, total):
    n = total // size
    sync(); t0 = time.perf_counter()
    for i in range(n):
        check(rt.cudaMemcpyAsync(dp + i * size, hp + i * size, size, kind, stream))
    sync()
    return n * size / (time.perf_counter() - t0) / 1e9

events = [event() for _ in range(8)]

def fed(size, total, depth):
    """Keep `depth` chunks on the stream: issue the next the moment the oldest's event is done."""
    n = total // size
    sync(); t0 = time.perf_counter()
    for i in range(n):
        if i >= depth:
            e = events[(i - depth) % 8]
            while rt.cudaEventQuery(e)[0] != ok:
                pass
        check(rt.cudaMemcpyAsync(dp + i * size, hp + i * size, size, kind, stream))
        check(rt.cudaEventRecord(events[i % 8], stream))
    sync()
    return n * size / (time.perf_counter() - t0) / 1e9

raw = max(one_copy(REGION) for _ in range(3))
rows = [("one 2 GiB copy", raw, raw)]
for size_mib in (2, 4, 8, 16, 27):
    size = size_mib * MiB
    a = max(all_at_once(size, REGION) for _ in range(2))
    f2 = max(fed(size, REGION, 2) for _ in range(2))
    f3 = max(fed(size, REGION, 3) for _ in range(2))
    rows.append((f"{size_mib} MiB chunks", a, f2, f3))
print("chunked h2d bulk, GB/s (x the one copy)")
for r in rows[1:]:
    print(f"  {r[0]:16s} all enqueued {r[1]:6.1f} ({r[1]/raw:.3f})  fed depth 2 {r[2]:6.1f} ({r[2]/raw:.3f})  depth 3 {r[3]:6.1f} ({r[3]/raw:.3f})", flush=True)
print(f"  one 2 GiB copy {raw:.1f} GB/s")
out["chunked"] = rows

# 2. batched DMA from a thread, beside other work in the process
BLOCK = 64 << 10; SEG = 416  # a 27 MiB chunk of 64 KiB blocks, as the daemon's 1 ms bound gives
rng = np.random.default_rng(1)
slots = REGION // BLOCK
pool = [(rng.choice(slots, SEG, replace=False).astype(np.uint64) * BLOCK,
         rng.choice(slots, SEG, replace=False).astype(np.uint64) * BLOCK) for _ in range(16)]
sizes = np.full(SEG, BLOCK, dtype=np.uint64)
done_event = event(); check(rt.cudaEventRecord(done_event, stream)); sync()

def feeder(seconds, res):
    bd = BatchedDma()
    check(rt.cudaSetDevice(0))
    enq = 0.0; segs = 0; i = 0
    sync(); t0 = time.perf_counter(); end = t0 + seconds
    while time.perf_counter() < end:
        if i >= 2:
            e = events[(i - 2) % 8]
            while rt.cudaEventQuery(e)[0] != ok:
                pass
        d, s = pool[i % 16]
        a = time.perf_counter()
        bd.copy(dp, hp, d, s, sizes, kind, stream)
        enq += time.perf_counter() - a; segs += SEG
        check(rt.cudaEventRecord(events[i % 8], stream)); i += 1
    sync()
    el = time.perf_counter() - t0
    res.update(gbps=segs * BLOCK / el / 1e9, us_per_seg=enq / segs * 1e6)

def background(kind_, stop):
    if kind_ == "python spin":
        x = 0
        while not stop.is_set():
            x += 1
    elif kind_ == "cuEventQuery spin":
        while not stop.is_set():
            drv.cuEventQuery(done_event)
    elif kind_ == "poll 6k/s":
        while not stop.is_set():
            drv.cuEventQuery(done_event); time.sleep(0.00012)
    elif kind_ == "python spin + query":
        x = 0
        while not stop.is_set():
            for _ in range(20):
                x += 1
            drv.cuEventQuery(done_event)

def trial(where, bg, switch=None):
    old = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(switch)
    res = {}
    stop = threading.Event()
    b = None
    if bg:
        b = threading.Thread(target=background, args=(bg, stop)); b.start()
    if where == "main":
        feeder(1.0, res)
    else:
        t = threading.Thread(target=feeder, args=(1.0, res)); t.start(); t.join()
    stop.set()
    if b: b.join()
    sys.setswitchinterval(old)
    return res

print("batched DMA, 416 x 64 KiB a chunk, depth 2, from a thread, beside:")
trials = [("main", None, None), ("thread", None, None), ("thread", "python spin", None),
          ("thread", "python spin", 1e-4), ("thread", "cuEventQuery spin", None),
          ("thread", "poll 6k/s", None), ("thread", "python spin + query", None),
          ("thread", "python spin + query", 1e-4), ("main", None, None), ("thread", None, None)]
out["batched"] = []
for where, bg, sw in trials:
    r = trial(where, bg, sw)
    out["batched"].append((where, bg, sw, r))
    print(f"  {where:6s} {str(bg):22s} switch {str(sw):6s}  {r['gbps']:5.1f} GB/s ({r['gbps']/raw:.3f})  enqueue {r['us_per_seg']:.2f} us/seg", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "feed_probe.json"), "w"), default=str)
