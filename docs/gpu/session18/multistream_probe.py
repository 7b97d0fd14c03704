"""Can several threads enqueue one batch faster than one? Latency of one 256 x 64 KiB batch
(h2d or d2h, DIRECTION env), in-process, one thread and one stream (BatchedDma, as priod does
today) against the same table split over K streams, each part enqueued by its own thread at
once (the calling thread takes the first part; helpers wake on an Event), against one
contiguous copy of the same bytes. Interleaved; idle GPU, then beside a GEMM co-tenant process
(bench_gpu.py's). Also each variant's enqueue time (calling thread) and the helpers' wake-up."""
import os, sys, time, threading, json
import numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.batched import BatchedDma
rt, drv = bindings()
from bench_gpu import cotenant


def main():
    MiB = 1 << 20; REGION = 256 * MiB; BLOCK = 64 << 10; N = 256
    DIRECTION = os.environ.get("DIRECTION", "h2d")
    ROUNDS = int(os.environ.get("ROUNDS", "60"))
    eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
    host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
    rng = np.random.default_rng(1)
    slots = REGION // BLOCK
    d = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    s = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    z = np.full(N, BLOCK, dtype=np.uint64)
    if DIRECTION == "h2d":
        dp, sp, kind = dev.pointer, host.host_pointer, rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    else:
        dp, sp, kind = host.host_pointer, dev.pointer, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    lo, hi = check(rt.cudaDeviceGetStreamPriorityRange())
    streams = [check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, hi)) for _ in range(8)]
    ok = rt.cudaError_t.cudaSuccess
    pointers = np.empty((3, N), dtype=np.uint64)
    np.add(d, np.uint64(dp), out=pointers[0]); np.add(s, np.uint64(sp), out=pointers[1]); pointers[2] = z

    class Helper(threading.Thread):
        def __init__(self, stream):
            super().__init__(daemon=True); self.stream = stream; self.go = threading.Event(); self.part = None
            self.dma = BatchedDma(); self.woke = []; self.t_go = 0.0; self.busy = []
        def run(self):
            while True:
                self.go.wait(); self.go.clear()
                t = time.perf_counter(); self.woke.append((t - self.t_go) * 1e6)
                part, calls = self.part
                self.dma.copy_pointers(part, kind, self.stream, call_segments=calls)
                self.busy.append((time.perf_counter() - t) * 1e6)
                self.part = None

    helpers = [Helper(st) for st in streams[1:]]
    for h in helpers: h.start()
    main_dma = BatchedDma()
    parts_cache = {}
    def split(k):
        if k not in parts_cache:
            bounds = np.linspace(0, N, k + 1).astype(int)
            parts_cache[k] = [np.ascontiguousarray(pointers[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        return parts_cache[k]

    def multi(k, calls):
        def f():
            parts = split(k)
            now = time.perf_counter()
            for h, p in zip(helpers[: k - 1], parts[1:]):
                h.part = (p, calls); h.t_go = now; h.go.set()
            main_dma.copy_pointers(parts[0], kind, streams[0], call_segments=calls)
            for h in helpers[: k - 1]:
                while h.part is not None: time.sleep(0)  # helpers' enqueues done
            return k
        return f
    def single(calls):
        def f():
            main_dma.copy_pointers(pointers, kind, streams[0], call_segments=calls); return 1
        return f
    def contiguous():
        check(rt.cudaMemcpyAsync(dp, sp, N * BLOCK, kind, streams[0])); return 1
    variants = {
        "contiguous": contiguous,
        "1 stream, calls of 64 (today)": single(64),
        "1 stream, calls of 128": single(128),
        "2 streams, calls of 64": multi(2, 64),
        "2 streams, calls of 32": multi(2, 32),
        "4 streams, calls of 64": multi(4, 64),
        "4 streams, calls of 32": multi(4, 32),
        "8 streams, calls of 32": multi(8, 32),
    }
    def measure(label):
        lat = {k: [] for k in variants}; push = {k: [] for k in variants}
        for h in helpers: h.woke.clear(); h.busy.clear()
        for i in range(ROUNDS + 10):
            for k, f in variants.items():
                check(rt.cudaDeviceSynchronize()); time.sleep(0.003)
                t0 = time.perf_counter(); used = f(); t1 = time.perf_counter()
                for st in streams[:used]:
                    while rt.cudaStreamQuery(st)[0] != ok: pass
                t2 = time.perf_counter()
                if i >= 10: lat[k].append((t2 - t0) * 1e6); push[k].append((t1 - t0) * 1e6)
        rows = {}
        for k in variants:
            rows[k] = {"p50": float(np.percentile(lat[k], 50)), "p99": float(np.percentile(lat[k], 99)), "enqueue_p50": float(np.percentile(push[k], 50))}
        woke = [w for h in helpers for w in h.woke]
        return rows, {"helper_wake_p50": float(np.percentile(woke, 50)), "helper_wake_p99": float(np.percentile(woke, 99))}

    out = {}
    for cot in ("none", "gemm"):
        with cotenant(cot, 8192):
            time.sleep(0.5)
            out[cot] = measure(cot)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"multistream_{DIRECTION}.json"), "w"), indent=1)
    for cot, (rows, wake) in out.items():
        c = rows["contiguous"]["p99"]
        print(f"-- {DIRECTION}, co-tenant {cot}; helpers woke p50 {wake['helper_wake_p50']:.1f} p99 {wake['helper_wake_p99']:.1f} us")
        for k, r in rows.items():
            print(f"{k:32s} p50 {r['p50']:7.1f} p99 {r['p99']:7.1f} (p99 - contiguous {r['p99'] - c:+6.1f})  enqueue p50 {r['enqueue_p50']:6.1f} us")


if __name__ == "__main__":
    main()
