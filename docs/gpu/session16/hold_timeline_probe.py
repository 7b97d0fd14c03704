"""Where a direct DMA batch under priod's bulk loses ~200 us against a contiguous copy, when
in-process with no bulk it loses ~70-130 (enqueue_probe.py). Per batch: host time at each
batched call's return, and a timing event after each call on the copy's stream (E0 before the
first), so the GPU-side end of each call's blocks is known relative to E0. Forms, 5 ms apart,
interleaved: direct contiguous; direct batch by DMA in calls of 64 (shipped), 32, and one call;
the same buffers' batch in calls of 64 on a stream of this process with no hold (priod's bulk
still runs in the daemon). A bulk client streams 256 MiB copies through the daemon throughout.

    python3 docs/gpu/session16/hold_timeline_probe.py   (PYTHONPATH=<wheels>:.)
"""
import json, os, subprocess, sys, time
import numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import cupy as cp
import priod
from priod.direct import DirectCopies
from priod.engines.cuda._driver import bindings, check
from priod.engines.cuda.batched import BatchedDma
from priod.testing import daemon_process
from priod.testing.load import BulkProcess
from bench_gpu_batch import scattered
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from enqueue_probe_gemm import GEMM

rt, drv = bindings()
KiB, MiB = 1 << 10, 1 << 20
BLOCKS, BLOCK = 256, 64 * KiB

class Timeline(BatchedDma):
    """BatchedDma that records, per batch, E0 before the first call and an event after each."""
    def __init__(self, call_segments):
        super().__init__(call_segments)
        self.pool = [check(rt.cudaEventCreate()) for _ in range(64)]
        self.rec = []
    def copy_pointers(self, pointers, kind, stream):
        self.events, self.host = [], []
        ev = self.pool[0]; check(rt.cudaEventRecord(ev, stream)); self.events.append(ev); self.host.append(time.perf_counter())
        super().copy_pointers(pointers, kind, stream)
    def _call(self, arrays, first, count, stream):
        super()._call(arrays, first, count, stream)
        self.host.append(time.perf_counter())
        ev = self.pool[len(self.events)]; check(rt.cudaEventRecord(ev, stream)); self.events.append(ev)
    def harvest(self, t0):
        gpu = [check(rt.cudaEventElapsedTime(self.events[0], e)) * 1e3 for e in self.events[1:]]
        host = [(h - t0) * 1e6 for h in self.host]
        self.rec.append({"host_us": host, "gpu_us": gpu})

def pause(s):
    time.sleep(s)

def rows(c, direction, count, cot):
    size = 2 * BLOCKS * BLOCK
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8); cp.cuda.Device().synchronize()
    page = c.hold_page()
    copies = {}
    for k in (64, 32, 256):
        d = DirectCopies(page, batch_path="dma"); d._batched = Timeline(k); copies[f"direct DMA calls of {k}"] = d
    pairs = {k: (d.pair(dev, host) if direction == "h2d" else d.pair(host, dev)) for k, d in copies.items()}
    contig = pairs["direct DMA calls of 64"]
    segs = scattered(BLOCKS, BLOCK, seed=6)
    own = Timeline(64)
    stream = cp.cuda.Stream(non_blocking=True)
    rs = rt.cudaStream_t(stream.ptr)
    dst, src = (dev.data.ptr, pinned.ptr) if direction == "h2d" else (pinned.ptr, dev.data.ptr)
    u = segs.astype(np.uint64)
    forms = ["direct contiguous", *pairs, "own stream, no hold, calls of 64"]
    lat = {f: [] for f in forms}
    for i in range(5 + count):
        for f in forms:
            t0 = time.perf_counter()
            if f == "direct contiguous":
                contig.copy(BLOCKS * BLOCK)
            elif f.startswith("direct DMA"):
                pairs[f].copy_batch(segs)
            else:
                own.copy(dst, src, u[:, 0].copy(), u[:, 1].copy(), u[:, 2].copy(), rt.cudaMemcpyKind.cudaMemcpyDefault, rs)
                stream.synchronize()
            took = (time.perf_counter() - t0) * 1e6
            if i >= 5:
                lat[f].append(took)
                b = copies[f]._batched if f.startswith("direct DMA") else (own if f.startswith("own") else None)
                if b is not None:
                    b.harvest(t0)
            pause(0.005)
    out = {}
    for f in forms:
        v = np.array(lat[f]); row = {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "lat": lat[f]}
        b = copies[f]._batched if f.startswith("direct DMA") else (own if f.startswith("own") else None)
        if b is not None:
            row["timeline"] = b.rec
            first_ret = np.array([r["host_us"][1] for r in b.rec]); e0 = np.array([r["host_us"][0] for r in b.rec])
            last_ret = np.array([r["host_us"][-1] for r in b.rec])
            gpu_first = np.array([r["gpu_us"][0] for r in b.rec]); gpu_last = np.array([r["gpu_us"][-1] for r in b.rec])
            gaps = np.array([np.diff([0.0] + r["gpu_us"]).max() for r in b.rec])
            row.update(e0_host=float(np.median(e0)), first_call_return=float(np.median(first_ret)), last_call_return=float(np.median(last_ret)),
                       gpu_first_call_end=float(np.median(gpu_first)), gpu_last_end=float(np.median(gpu_last)), gpu_last_end_p99=float(np.percentile(gpu_last, 99)),
                       widest_call_p50=float(np.median(gaps)))
        out[f] = row
        extra = "" if b is None else (f"  host: E0 {row['e0_host']:5.0f} 1st call back {row['first_call_return']:5.0f} last {row['last_call_return']:5.0f} | "
                                      f"GPU from E0: 1st call done {row['gpu_first_call_end']:5.0f} all done {row['gpu_last_end']:5.0f} (p99 {row['gpu_last_end_p99']:5.0f}), widest call {row['widest_call_p50']:4.0f}")
        print(f"{cot:5s} {direction} {f:34s} p50 {row['p50']:6.0f} p99 {row['p99']:6.0f}{extra}", flush=True)
    for d in copies.values():
        d.close()
    return out

if __name__ == "__main__":
    results = {}
    env = {"PRIOD_LOG__LEVEL": '"warning"'}
    with daemon_process(env, backend="cuda", start_timeout=180) as d:
        for cot in ("none", "gemm"):
            gemm = None
            if cot == "gemm":
                gemm = subprocess.Popen([sys.executable, "-c", GEMM], stdout=subprocess.PIPE, text=True)
                print(gemm.stdout.readline().strip(), flush=True)
            for direction in ("h2d", "d2h"):
                bulk = BulkProcess(d.socket_path, 256 * MiB, 2, direction)
                try:
                    bulk.wait_ready(timeout=120); time.sleep(0.5)
                    with priod.SyncClient(d.socket_path, name="direct") as c:
                        results[f"{cot} {direction}"] = rows(c, direction, 100, cot)
                    res = bulk.stop(timeout=60)
                finally:
                    bulk.kill()
            if gemm is not None:
                gemm.terminate(); gemm.wait(30)
    with open(os.path.join(os.environ.get("OUT", "."), "hold_timeline.json"), "w") as fp:
        json.dump(results, fp)
