"""Urgent 64 KiB copies through the daemon while another client streams bulk batches of 64 KiB
blocks: with the pusher (bulk batch chunks enqueued off the loop) and without (inline)."""
import os, sys, time, json, multiprocessing as mp
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import numpy as np
import priod
from priod.testing import daemon_process, percentile

def bulk(path, seconds, q):
    from bench_gpu_batch import batch_bulk
    with priod.SyncClient(path) as c:
        q.put(batch_bulk(c, "h2d", 256, seconds, 60))

def run(no_pusher):
    if no_pusher: os.environ["PROBE_NO_PUSHER"] = "1"
    else: os.environ.pop("PROBE_NO_PUSHER", None)
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, spin_us=2000) as c:
        h, dv = c.alloc_host(1 << 20), c.alloc_device(1 << 20)
        for _ in range(20): c.copy(dv, h, 65536, priority="urgent")
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=bulk, args=(d.socket_path, 4.0, q)); p.start()
        time.sleep(1.5)
        lat = []
        t_end = time.perf_counter() + 2.0
        while time.perf_counter() < t_end:
            t0 = time.perf_counter(); c.copy(dv, h, 65536, priority="urgent"); lat.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.002)
        r = q.get(timeout=120); p.join()
        return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat), "bulk_gbps": r["gbps"]}

if __name__ == "__main__":
    out = {}
    for name, flag in (("pusher", False), ("inline", True), ("pusher2", False), ("inline2", True)):
        out[name] = run(flag)
        print(name, json.dumps(out[name]), flush=True)
