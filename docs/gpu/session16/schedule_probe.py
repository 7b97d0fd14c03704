"""Does a direct DMA batch finish sooner when its first batched call is short (the copy engine
starts after fewer blocks are enqueued) and its last call short (less left to copy after the
host is done)? hold_timeline_probe.py showed a batch of 256 x 64 KiB under priod's bulk spends
~125 us enqueuing its first call of 64 before the engine starts, then keeps the engine just
busy. Direct batches by DMA (priod.direct, batch_path="dma") with the calls' sizes as listed,
against a direct contiguous copy, 5 ms apart, interleaved, under a bulk client's 256 MiB copies
through the daemon; nothing else and beside a GEMM process; h2d and d2h.

    python3 docs/gpu/session16/schedule_probe.py   (PYTHONPATH=<wheels>:.)
"""
import json, os, subprocess, sys, time
import numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp
import priod
from priod.direct import DirectCopies
from priod.engines.cuda.batched import BatchedDma
from priod.testing import daemon_process
from priod.testing.load import BulkProcess
from bench_gpu_batch import scattered
from enqueue_probe_gemm import GEMM

KiB, MiB = 1 << 10, 1 << 20
BLOCKS, BLOCK = 256, 64 * KiB
ROUNDS = int(os.environ.get("ROUNDS", "200"))

class Scheduled(BatchedDma):
    def __init__(self, sizes):
        super().__init__()
        self.sizes = sizes
    def copy_pointers(self, pointers, kind, stream):
        count = pointers.shape[1]
        base = pointers.ctypes.data
        arrays = (base, base + 8 * count, base + 16 * count)
        done = 0
        for n in self.sizes:
            n = min(n, count - done)
            if n <= 0:
                break
            self._call(arrays, done, n, stream)
            done += n
        if done < count:
            self._call(arrays, done, count - done, stream)

SCHEDULES = {
    "64,64,64,64 (shipped)": None,
    "16,32,64,64,64,16": [16, 32, 64, 64, 64, 16],
    "8,16,32,64,64,64,8": [8, 16, 32, 64, 64, 64, 8],
    "16,48,64,64,64": [16, 48, 64, 64, 64],
    "32,64,64,64,32": [32, 64, 64, 64, 32],
    "16,32,48,64,64,32": [16, 32, 48, 64, 64, 32],
}

def rows(c, direction, cot):
    size = 2 * BLOCKS * BLOCK
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8); cp.cuda.Device().synchronize()
    page = c.hold_page()
    copies = {}
    for name, sizes in SCHEDULES.items():
        d = DirectCopies(page, batch_path="dma")
        if sizes is not None:
            d._batched = Scheduled(sizes)
        copies[name] = d
    pairs = {k: (d.pair(dev, host) if direction == "h2d" else d.pair(host, dev)) for k, d in copies.items()}
    contig = next(iter(pairs.values()))
    segs = scattered(BLOCKS, BLOCK, seed=6)
    forms = ["direct contiguous", *pairs]
    lat = {f: [] for f in forms}
    for i in range(10 + ROUNDS):
        for f in forms:
            t0 = time.perf_counter()
            if f == "direct contiguous":
                contig.copy(BLOCKS * BLOCK)
            else:
                pairs[f].copy_batch(segs)
            if i >= 10:
                lat[f].append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.005)
    if direction == "h2d":
        for p in pairs.values():
            dev[:] = 0; cp.cuda.Device().synchronize()
            p.copy_batch(segs)
            got = cp.asnumpy(dev)
            for d_off, s_off, n in segs.tolist():
                assert np.array_equal(got[d_off:d_off + n], host[s_off:s_off + n]), "a block differs"
    out = {}
    c50 = float(np.percentile(lat["direct contiguous"], 50)); c99 = float(np.percentile(lat["direct contiguous"], 99))
    for f in forms:
        v = np.array(lat[f]); p50, p99 = float(np.percentile(v, 50)), float(np.percentile(v, 99))
        out[f] = {"p50": p50, "p99": p99, "p90": float(np.percentile(v, 90)), "lat": lat[f]}
        print(f"{cot:5s} {direction} {f:24s} p50 {p50:6.0f} p90 {out[f]['p90']:6.0f} p99 {p99:6.0f}   minus contiguous p50 {p50 - c50:+5.0f} p99 {p99 - c99:+5.0f}", flush=True)
    for d in copies.values():
        d.close()
    return out

if __name__ == "__main__":
    results = {}
    with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=180) as d:
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
                        results[f"{cot} {direction}"] = rows(c, direction, cot)
                    bulk.stop(timeout=60)
                finally:
                    bulk.kill()
            if gemm is not None:
                gemm.terminate(); gemm.wait(30)
    with open(os.path.join(os.environ.get("OUT", "."), "schedule_probe.json"), "w") as fp:
        json.dump(results, fp)
