import os, sys, time, json
sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds, BulkProcess
GiB = 1 << 30
prof = len(sys.argv) > 1 and sys.argv[1] == "profile"
if prof:
    os.environ["PROBE_PROFILE"] = os.path.join(os.environ["OUT"], "profile_bulk.txt")
env = {"PRIOD_LOG__LEVEL": '"warning"'}
with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
    bulk = BulkProcess(d.socket_path, 2 * GiB, 2, "h2d")
    try:
        bulk.wait_ready(timeout=120)
        time.sleep(1.0)
        pid = d.proc.pid
        s0 = c.status(); c0 = cpu_seconds(pid); t0 = time.perf_counter()
        time.sleep(3.0)
        s1 = c.status(); c1 = cpu_seconds(pid); t1 = time.perf_counter()
        bulk.stop(timeout=60)
    finally:
        bulk.kill()
    gb = (s1["lane_bytes"]["gpu0/h2d"] - s0["lane_bytes"]["gpu0/h2d"]) / (t1 - t0) / 1e9
    print(f"bulk alone {'(profiled)' if prof else ''}: {gb:.2f} GB/s cpu {(c1-c0)/(t1-t0):.3f} s/s polls/s {(s1['polls']-s0['polls'])/(t1-t0):.0f}")
