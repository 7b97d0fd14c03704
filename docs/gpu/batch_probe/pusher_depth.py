"""(Second form: the scheduler's depth, and calls per chunk.) A bulk batch stream of 64 KiB blocks through the daemon (4096 blocks a request, two
outstanding, 3 s), with the pusher's batched calls of 64 segments (as shipped) or of a whole chunk
at once, and the daemon's GIL switch interval as shipped (5 ms) or 0.5 ms; pusher busy time and
its cost per segment from PROBE_PUSHER_TIMES (sitecustomize.py beside this file)."""
import os, sys, time, json
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds
from bench_gpu_batch import batch_bulk
variants = [("shipped", {}), ("depth 3", {"DEPTH": "3"}), ("depth 3, one call", {"DEPTH": "3", "PROBE_BULK_CALL": "100000"}),
            ("depth 4, one call", {"DEPTH": "4", "PROBE_BULK_CALL": "100000"}), ("calls of 208", {"PROBE_BULK_CALL": "208"}),
            ("depth 3, calls of 128", {"DEPTH": "3", "PROBE_BULK_CALL": "128"}), ("shipped", {}), ("depth 3", {"DEPTH": "3"})]
rows = []
for i, (name, extra) in enumerate(variants):
    for k in ("PROBE_BULK_CALL", "PROBE_SWITCH"):
        os.environ.pop(k, None)
    extra = dict(extra); depth = extra.pop("DEPTH", "2")
    os.environ.update(extra)
    path = os.path.join(os.environ["OUT"], f"pusher_times_{i}.json")
    os.environ["PROBE_PUSHER_TIMES"] = path
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0", "PRIOD_SCHEDULER__DEPTH": depth}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
        pid = d.proc.pid
        st0 = c.status(); c0 = cpu_seconds(pid); t0 = time.perf_counter()
        r = batch_bulk(c, "h2d", 256, 3.0, 60)
        st1 = c.status(); c1 = cpu_seconds(pid); t1 = time.perf_counter()
        lane_chunk = next(l for l in st1["lanes"] if l["lane"] == "gpu0/h2d")["chunk_bytes"]
    time.sleep(0.3)
    t = np.array(json.load(open(path)))
    t = t[t[:, 2] > 0]
    run = (t[:, 2] - t[:, 1]) * 1e6
    span = t[-1, 2] - t[0, 0]
    rows.append((name, r["gbps"], (c1 - c0) / (t1 - t0), (st1["polls"] - st0["polls"]) / (t1 - t0), run.sum() / 1e6 / span, float(np.median(run)) / (lane_chunk / 65536)))
    os.remove(path)
    print(rows[-1], flush=True)
print(f"{'variant':28s} {'GB/s':>6s} {'cpu s/s':>8s} {'polls/s':>8s} {'pusher busy':>11s} {'us/seg (p50 job/segments)':>20s}")
for name, g, cpu, polls, busy, seg in rows:
    print(f"{name:28s} {g:6.1f} {cpu:8.2f} {polls:8.0f} {busy:11.2f} {seg:20.2f}")
