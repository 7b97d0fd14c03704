import os, sys, time, json
sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds
from bench_gpu_batch import batch_bulk
rows = []
for cost in ("1e-6", "0.1e-6", "0.3e-6", "1e-6", "0.1e-6"):
    os.environ["PROBE_SEGCOST"] = cost
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0"}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path) as c:
        pid = d.proc.pid
        st0 = c.status(); c0 = cpu_seconds(pid); t0 = time.perf_counter()
        r = batch_bulk(c, "h2d", 256, 3.0, 60)
        st1 = c.status(); c1 = cpu_seconds(pid); t1 = time.perf_counter()
        lane = next(l for l in st1["lanes"] if l["lane"] == "gpu0/h2d")
        rows.append((cost, r, (c1 - c0) / (t1 - t0), (st1.get("polls", 0) - st0.get("polls", 0)) / (t1 - t0), lane.get("chunk_bytes")))
        print(cost, json.dumps(r), flush=True)
for cost, r, cpu, polls, chunk in rows:
    print(f"segcost {cost:7s} {r.get('gbps', r)} cpu {cpu:.2f} s/s polls/s {polls:.0f} chunk {chunk}")
