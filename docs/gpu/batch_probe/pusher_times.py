import os, sys, json, time
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process
from bench_gpu_batch import batch_bulk
path = os.path.join(os.environ["OUT"], "pusher_times.json")
os.environ["PROBE_PUSHER_TIMES"] = path
env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    r = batch_bulk(c, "h2d", 256, 3.0, 60)
    st = c.status()
print("batch bulk", r)
time.sleep(0.5)
t = np.array(json.load(open(path)))
t = t[t[:, 2] > 0]
wait = (t[:, 1] - t[:, 0]) * 1e6; run = (t[:, 2] - t[:, 1]) * 1e6
gap = (t[1:, 1] - t[:-1, 2]) * 1e6  # pusher idle between jobs
print(f"jobs {len(t)}  queue wait p50 {np.median(wait):.0f} p90 {np.percentile(wait,90):.0f} us  run p50 {np.median(run):.0f} p90 {np.percentile(run,90):.0f} us  idle between jobs p50 {np.median(gap):.0f} p90 {np.percentile(gap,90):.0f} us")
span = t[-1, 2] - t[0, 0]
print(f"pusher busy {run.sum()/1e6/span:.2f} of {span:.2f} s")
