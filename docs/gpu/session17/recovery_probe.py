"""What the daemon's ``[scheduler] explore_every`` (choice.EXPLORE_EVERY) does on the GPU: a
GEMM co-tenant comes and goes while an urgent client alternates a copy_batch of 256 x 64 KiB and
a 16 MiB contiguous copy, 5 ms apart, h2d, under a bulk client's 256 MiB copies. Phases: no
co-tenant (0-4 s), GEMMs running (4-10 s), GEMMs stopped (10-16 s). Per form and phase: the
paths taken, p50 and p99 (the first 0.5 s after each change left out), and how long after the
GEMMs start and stop each form's path first changes. Run once per setting, EXPLORE_EVERY=200
(the default) and 1 (a look at the other path every explore_ms, the behaviour before).

    PYTHONPATH=<wheels>:. EXPLORE_EVERY=200 python3 docs/gpu/session17/recovery_probe.py
"""
import json, os, subprocess, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "session16"))
import priod
from priod.testing import daemon_process
from priod.testing.load import BulkProcess
from bench_gpu_batch import scattered
from enqueue_probe_gemm import GEMM

KiB, MiB = 1 << 10, 1 << 20
EVERY = os.environ.get("EXPLORE_EVERY", "200")
PHASES = (("none", 4.0), ("gemm", 6.0), ("after", 6.0))
copies = []
env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SCHEDULER__EXPLORE_EVERY": EVERY}
with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="urgent", spin_us=2000) as c:
    size = 2 * 256 * 64 * KiB
    h, dv = c.alloc_host(size), c.alloc_device(size)
    segs = scattered(256, 64 * KiB, seed=4)
    bulk = BulkProcess(d.socket_path, 256 * MiB, 2, "h2d")
    gemm = None
    try:
        bulk.wait_ready(timeout=120); time.sleep(0.5)
        start = time.perf_counter()
        changes = {}
        for phase, seconds in PHASES:
            if phase == "gemm":
                gemm = subprocess.Popen([sys.executable, "-c", GEMM], stdout=subprocess.PIPE, text=True)
                gemm.stdout.readline()
            elif phase == "after" and gemm is not None:
                gemm.terminate(); gemm.wait(30); gemm = None
            changes[phase] = time.perf_counter() - start
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                for form in ("batch", "contiguous"):
                    t0 = time.perf_counter()
                    r = c.copy_batch(dv, h, segs, priority="urgent") if form == "batch" else c.copy(dv, h, 256 * 64 * KiB, priority="urgent")
                    t1 = time.perf_counter()
                    copies.append({"t": t0 - start, "phase": phase, "form": form, "path": r.path, "us": (t1 - t0) * 1e6})
                    time.sleep(0.005)
        bulk.stop(timeout=60)
    finally:
        bulk.kill()
        if gemm is not None:
            gemm.terminate(); gemm.wait(30)
print(f"explore_every = {EVERY}")
for form in ("batch", "contiguous"):
    for phase, _ in PHASES:
        rows = [x for x in copies if x["form"] == form and x["phase"] == phase and x["t"] >= changes[phase] + 0.5]
        us = [x["us"] for x in rows]
        paths = {p: sum(1 for x in rows if x["path"] == p) for p in ("express", "dma")}
        print(f"{form:10s} {phase:5s} n={len(us):4d} express {paths['express']:4d} dma {paths['dma']:4d}  p50 {np.percentile(us, 50):6.0f}  p99 {np.percentile(us, 99):6.0f}")
    for phase in ("gemm", "after"):
        rows = [x for x in copies if x["form"] == form and x["t"] >= changes[phase]]
        before = [x for x in copies if x["form"] == form and x["t"] < changes[phase]][-20:]
        usual = max(("express", "dma"), key=lambda p: sum(1 for x in before if x["path"] == p))
        switched = next((x for x in rows if x["path"] != usual), None)
        settled = [x for x in rows if x["t"] < changes[phase] + 4.0]
        share = sum(1 for x in settled[-50:] if x["path"] != usual) / max(1, len(settled[-50:]))
        when = f"{switched['t'] - changes[phase]:5.2f} s" if switched else "never"
        print(f"{form:10s} GEMMs {'start' if phase == 'gemm' else 'stop '}: was {usual:7s}; first other path after {when}; share of the other path at 3-4 s: {share:.2f}")
with open(os.path.join(os.environ.get("OUT", "."), f"recovery_probe_{EVERY}.json"), "w") as fp:
    json.dump({"explore_every": EVERY, "changes": changes, "copies": copies}, fp)
