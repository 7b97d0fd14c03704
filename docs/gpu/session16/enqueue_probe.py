"""Is a batched DMA's latency its enqueue? One 256 x 64 KiB batch (h2d and d2h), in-process,
no daemon, each form interleaved, 5 ms asleep before each (as urgent copies come) and back to
back; with nothing else on the GPU and beside a GEMM process. Forms: one contiguous copy;
BatchedDma in calls of 64 (what priod does); the same split over 2 and 4 threads, each on a
stream of its own (ctypes releases the GIL for the driver call), helpers woken by a queue;
srcAccessOrder ANY instead of STREAM. Every form's bytes are checked once per cotenant.

    python3 docs/gpu/session16/enqueue_probe.py   (PYTHONPATH=<wheels>:.)
"""
import ctypes, json, os, queue, sys, threading, time
import numpy as np
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.batched import BatchedDma
import subprocess
from enqueue_probe_gemm import GEMM

rt, drv = bindings()
MiB = 1 << 20; REGION = 64 * MiB; BLOCK = 64 << 10; N = 256
eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
fd = os.memfd_create("probe"); os.ftruncate(fd, REGION)
host = eng.map_host(fd, REGION); dev = eng.alloc_device(REGION, 0)
import mmap
hview = np.frombuffer(mmap.mmap(fd, REGION), dtype=np.uint8)
def new_stream():
    return check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
streams = [new_stream() for _ in range(4)]
rng = np.random.default_rng(1)
slots = REGION // BLOCK

class Helper:
    def __init__(self, stream):
        self.q = queue.SimpleQueue(); self.done = queue.SimpleQueue(); self.b = BatchedDma(); self.stream = stream
        threading.Thread(target=self.run, daemon=True).start()
    def run(self):
        while True:
            ptrs, kind = self.q.get()
            self.b.copy_pointers(ptrs, kind, self.stream)
            self.done.put(None)

helpers = [Helper(s) for s in streams[1:]]
main_b = BatchedDma()
any_b = BatchedDma()
any_b._attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY

def table(direction):
    d = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    s = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    if direction == "h2d":
        dp, sp = dev.pointer, host.host_pointer
    else:
        dp, sp = host.host_pointer, dev.pointer
    p = np.empty((3, N), dtype=np.uint64); p[0] = d + np.uint64(dp); p[1] = s + np.uint64(sp); p[2] = BLOCK
    return p, d, s

def split(k):
    def f(p, kind):
        parts = np.array_split(np.arange(N), k)
        for h, idx in zip(helpers[: k - 1], parts[1:]):
            h.q.put((np.ascontiguousarray(p[:, idx]), kind))
        main_b.copy_pointers(np.ascontiguousarray(p[:, parts[0]]), kind, streams[0])
        for h in helpers[: k - 1]:
            h.done.get()
        return k
    return f

def forms(direction):
    kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice if direction == "h2d" else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    def contiguous(p, kind=kind):
        a, b = (dev.pointer, host.host_pointer) if direction == "h2d" else (host.host_pointer, dev.pointer)
        check(rt.cudaMemcpyAsync(a, b, N * BLOCK, kind, streams[0])); return 1
    return kind, {
        "contiguous": contiguous,
        "calls of 64": lambda p, kind=kind: (main_b.copy_pointers(p, kind, streams[0]), 1)[1],
        "order ANY, calls of 64": lambda p, kind=kind: (any_b.copy_pointers(p, kind, streams[0]), 1)[1],
        "2 threads": split(2),
        "4 threads": split(4),
    }

def wait_all(k):
    for s in streams[:k]:
        while rt.cudaStreamQuery(s)[0] != rt.cudaError_t.cudaSuccess:
            pass

def verify(direction, f, kind):
    """Fresh random bytes at the sources, the form's batch, every destination block compared."""
    ref = rng.integers(0, 256, REGION, dtype=np.uint8)
    hview[:] = ref
    if direction == "h2d":
        check(rt.cudaMemset(dev.pointer, 7, REGION))
    else:
        check(rt.cudaMemcpy(dev.pointer, host.host_pointer, REGION, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
        hview[:] = 0
    check(rt.cudaDeviceSynchronize())
    p, d, s = table(direction)
    wait_all(f(p, kind))
    got = np.empty(REGION, dtype=np.uint8)
    if direction == "h2d":
        check(rt.cudaMemcpy(got.ctypes.data, dev.pointer, REGION, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    else:
        got[:] = hview
    for i in range(N):
        di, si = int(d[i]), int(s[i])
        if not np.array_equal(got[di:di + BLOCK], ref[si:si + BLOCK]):
            raise SystemExit(f"{direction}: block {i} differs")

def measure(cot, results, rounds=200):
    for direction in ("h2d", "d2h"):
        kind, fs = forms(direction)
        for name, f in fs.items():
            if name != "contiguous":
                verify(direction, f, kind)
        for cadence, nap in (("5 ms apart", 0.005), ("back to back", 0.0)):
            lat = {k: [] for k in fs}; enq = {k: [] for k in fs}
            for r in range(rounds):
                for name, f in fs.items():
                    p, _, _ = table(direction)
                    check(rt.cudaDeviceSynchronize())
                    if nap: time.sleep(nap)
                    t0 = time.perf_counter(); k = f(p, kind); t1 = time.perf_counter(); wait_all(k); t2 = time.perf_counter()
                    if r >= 10:
                        lat[name].append((t2 - t0) * 1e6); enq[name].append((t1 - t0) * 1e6)
            for name in fs:
                row = {"cotenant": cot, "direction": direction, "cadence": cadence, "form": name,
                       "p50": float(np.percentile(lat[name], 50)), "p99": float(np.percentile(lat[name], 99)),
                       "enqueue_p50": float(np.percentile(enq[name], 50)), "lat": lat[name], "enq": enq[name]}
                results.append(row)
                print(f"{cot:5s} {direction} {cadence:12s} {name:24s} p50 {row['p50']:7.1f} p99 {row['p99']:7.1f} enqueue p50 {row['enqueue_p50']:6.1f}", flush=True)

if __name__ == "__main__":
    results = []
    measure("none", results)
    gemm = subprocess.Popen([sys.executable, "-c", GEMM], stdout=subprocess.PIPE, text=True)
    print(gemm.stdout.readline().strip(), flush=True)
    measure("gemm", results)
    gemm.terminate(); gemm.wait(30)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "enqueue_probe.json"), "w") as fp:
        json.dump(results, fp)
