"""Where a bulk batch stream of 64 KiB blocks through the daemon loses the link: the GPU-side
start and end of every chunk the pusher enqueues (timing events around its calls,
PROBE_BATCH_TIMELINE in sitecustomize.py beside this file). Between chunks: the stream ran dry
(the next chunk was not handed out or pushed in time); inside a chunk: time beyond its bytes at
the link's rate (its calls enqueued slower than the blocks move)."""
import os, sys, time, json
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds
from bench_gpu_batch import batch_bulk
RAW = float(os.environ.get("RAW_GBPS", "55.0"))
for i, (name, extra) in enumerate([("calls of 64 (shipped)", {}), ("calls of 208", {"PROBE_BULK_CALL": "208"}), ("calls of 64 (shipped)", {})]):
    os.environ.pop("PROBE_BULK_CALL", None); os.environ.update(extra)
    path = os.path.join(os.environ["OUT"], f"timeline_{i}.json"); os.environ["PROBE_BATCH_TIMELINE"] = path
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
        pid = d.proc.pid; c0 = cpu_seconds(pid); t0 = time.perf_counter()
        r = batch_bulk(c, "h2d", 256, 3.0, 60)
        cpu = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
    time.sleep(0.3)
    t = np.array(json.load(open(path))); os.remove(path)
    t = t[len(t) // 10:]  # past the warm-up
    st, en = t[:, 0] / 1e3, t[:, 1] / 1e3
    span = en[-1] - st[0]
    between = np.clip(st[1:] - en[:-1], 0, None)
    ideal = t[:, 4] / (RAW * 1e9)
    inside = (en - st) - ideal
    push = (t[:, 3] - t[:, 2]) * 1e6
    print(f"{name:22s} {r['gbps']:5.1f} GB/s  cpu {cpu:.2f} s/s  chunks {len(t)}  GPU span {span:.3f} s: bytes at {RAW:.0f} GB/s {ideal.sum()/span:.3f}, "
          f"dry between chunks {between.sum()/span:.3f} (p50 {np.median(between)*1e6:.0f} us, p90 {np.percentile(between,90)*1e6:.0f}), "
          f"beyond the bytes inside chunks {inside.sum()/span:.3f} (p50 {np.median(inside)*1e6:.0f} us);  push p50 {np.median(push):.0f} us for {np.median(t[:,5]):.0f} segments", flush=True)
