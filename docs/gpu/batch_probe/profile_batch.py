import os, sys, time, json
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds
from bench_gpu_batch import batch_bulk
os.environ["PROBE_SEGCOST"] = "0.1e-6"
os.environ["PROBE_PROFILE"] = os.path.join(os.environ["OUT"], "profile_batch.txt")
env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    r = batch_bulk(c, "h2d", 256, 3.0, 60)
    print("profiled batch bulk", r)
time.sleep(1)
