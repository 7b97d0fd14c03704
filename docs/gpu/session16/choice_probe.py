"""Why the daemon's path choice kept the express lane for 16 MiB h2d copies beside a GEMM
process in 3 of 6 runs of Session 15 (p50 2.0 ms where DMA gave 1.1-1.5): every urgent copy's
path, client latency and the daemon's queued/transfer times, over ~15 s of alternating urgent
copy_batch (256 x 64 KiB, or BLOCK_KIB blocks of the same 16 MiB) and 16 MiB contiguous copies 5 ms apart, while a bulk client streams
256 MiB copies and a GEMM process computes; the daemon's path figures every 0.5 s.

    PYTHONPATH=<wheels>:. python3 docs/gpu/session16/choice_probe.py
"""
import json, os, subprocess, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, HERE)
import priod
from priod.testing import daemon_process
from priod.testing.load import BulkProcess
from bench_gpu_batch import scattered
from enqueue_probe_gemm import GEMM

KiB, MiB = 1 << 10, 1 << 20
SECONDS = float(os.environ.get("SECONDS_", "15"))
BLOCK_KIB = int(os.environ.get("BLOCK_KIB", "64"))  # the batch: 16 MiB in blocks of this size
copies, figures = [], []
with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="urgent", spin_us=2000) as c:
    size = 2 * 256 * 64 * KiB
    h, dv = c.alloc_host(size), c.alloc_device(size)
    segs = scattered(256 * 64 // BLOCK_KIB, BLOCK_KIB * KiB, seed=4)
    gemm = subprocess.Popen([sys.executable, "-c", GEMM], stdout=subprocess.PIPE, text=True)
    print(gemm.stdout.readline().strip(), flush=True)
    bulk = BulkProcess(d.socket_path, 256 * MiB, 2, "h2d")
    try:
        bulk.wait_ready(timeout=120); time.sleep(0.5)
        start = time.perf_counter(); next_status = start
        while time.perf_counter() - start < SECONDS:
            for form in ("batch", "contiguous"):
                t0 = time.perf_counter()
                r = c.copy_batch(dv, h, segs, priority="urgent") if form == "batch" else c.copy(dv, h, 256 * 64 * KiB, priority="urgent")
                t1 = time.perf_counter()
                copies.append({"t": t0 - start, "form": form, "path": r.path, "us": (t1 - t0) * 1e6, "queued_us": r.queued_us, "transfer_us": r.transfer_us})
                time.sleep(0.005)
            if time.perf_counter() >= next_status:
                st = c.status()
                figures.append({"t": time.perf_counter() - start, "paths": st.get("urgent_paths")})
                next_status += 0.5
        bulk.stop(timeout=60)
    finally:
        bulk.kill(); gemm.terminate(); gemm.wait(30)
for x in copies:
    if x["path"] == "dma":
        print(f"t {x['t']:6.2f} {x['form']:10s} DMA  {x['us']:7.0f} us (queued {x['queued_us']:6.0f}, transfer {x['transfer_us']:6.0f})")
for form in ("batch", "contiguous"):
    for path in ("express", "dma"):
        v = [x["us"] for x in copies if x["form"] == form and x["path"] == path]
        if v:
            print(f"{form:10s} {path:7s} n={len(v):4d} p50 {np.percentile(v, 50):6.0f} p99 {np.percentile(v, 99):6.0f}")
for f in figures[:: max(1, len(figures) // 10)]:
    print(f"t {f['t']:5.1f} " + " | ".join(f"{p['size_bytes'] >> 20} MiB ex {p['express_us']} dma {p['dma_us']} ({p['express_chosen']}/{p['dma_chosen']})" for p in (f["paths"] or [])))
with open(os.path.join(os.environ.get("OUT", "."), "choice_probe.json"), "w") as fp:
    json.dump({"copies": copies, "figures": figures}, fp)
