"""Where an urgent copy's time goes through the daemon, end to end: client-side start and end
of each copy, and the daemon's own timestamps of it (probe_site/sitecustomize.py: socket
readable, taken, first chunk submitted, last seen done, reply built and sent). One CLOCK_MONOTONIC
on both sides. Forms, 5 ms apart, interleaved: one urgent copy_batch of 256 x 64 KiB, one urgent
16 MiB contiguous copy, one urgent 64 KiB copy; h2d; the daemon idle, then under a bulk client's
256 MiB copies.

    PYTHONPATH=<wheels>:. python3 docs/gpu/session16/round_trip_probe.py
"""
import json, os, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "probe_site"), os.environ.get("PYTHONPATH", ""), os.getcwd()])
import priod
from priod.testing import daemon_process
from priod.testing.load import BulkProcess
from bench_gpu_batch import scattered

KiB, MiB = 1 << 10, 1 << 20
BACKEND = os.environ.get("BACKEND", "cuda")
COUNT = int(os.environ.get("COUNT", "150"))
OUT = os.environ.get("OUT", ".")
times_path = os.path.join(OUT, "daemon_times.json")
env = {"PRIOD_LOG__LEVEL": '"warning"', "PROBE_TIMES": times_path}
if BACKEND == "sim":
    env.update(PRIOD_SIM__H2D_GBPS="55", PRIOD_SIM__D2H_GBPS="55")
os.environ["PROBE_TIMES"] = times_path
client = []
with daemon_process(env, backend=BACKEND, start_timeout=180) as d, priod.SyncClient(d.socket_path, name="urgent", spin_us=2000) as c:
    size = 2 * 256 * 64 * KiB
    h, dv = c.alloc_host(size), c.alloc_device(size)
    h.array[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    segs = scattered(256, 64 * KiB, seed=4)
    for phase in ("idle", "bulk"):
        bulk = BulkProcess(d.socket_path, 256 * MiB, 2, "h2d") if phase == "bulk" else None
        try:
            if bulk:
                bulk.wait_ready(timeout=120); time.sleep(0.5)
            for i in range(5 + COUNT):
                for form in ("batch", "contiguous", "64KiB"):
                    t0 = time.perf_counter()
                    if form == "batch":
                        r = c.copy_batch(dv, h, segs, priority="urgent")
                    elif form == "contiguous":
                        r = c.copy(dv, h, 256 * 64 * KiB, priority="urgent")
                    else:
                        r = c.copy(dv, h, 64 * KiB, priority="urgent")
                    t1 = time.perf_counter()
                    client.append({"phase": phase, "form": form, "t0": t0, "t1": t1, "warm": i >= 5, "path": r.path})
                    time.sleep(0.005)
            if bulk:
                bulk.stop(timeout=60)
        finally:
            if bulk:
                bulk.kill()
    conn = None
recs = json.load(open(times_path))
# this client's records, in order: the session that took batches
mine = [r for r in recs if r["nbytes"] in (256 * 64 * KiB, 64 * KiB)]
conn_ids = {r["conn"] for r in mine if r["batch"]}
mine = [r for r in mine if r["conn"] in conn_ids]
assert len(mine) == len(client), (len(mine), len(client))
rows = {}
for cl, dm in zip(client, mine):
    if not cl["warm"]:
        continue
    parts = {
        "client to readable": dm["readable"] - cl["t0"],
        "readable to taken": dm["arrival"] - dm["readable"],
        "taken to first chunk": dm["first"] - dm["arrival"],
        "first chunk to last done": dm["last"] - dm["first"],
        "last done to finished": dm["finished"] - dm["last"],
        "reply built, sent": dm["sent"] - dm["finished"],
        "sent to client": cl["t1"] - dm["sent"],
        "total": cl["t1"] - cl["t0"],
    }
    rows.setdefault((cl["phase"], cl["form"], cl["path"]), []).append(parts)
out = {}
for (phase, form, path), lst in rows.items():
    med = {k: float(np.median([p[k] for p in lst])) * 1e6 for k in lst[0]}
    p99 = float(np.percentile([p["total"] for p in lst], 99)) * 1e6
    out[f"{phase} {form} {path}"] = {"p50": med, "total_p99": p99, "n": len(lst)}
    print(f"{phase:4s} {form:10s} {path:7s} n={len(lst):3d} " + " ".join(f"{k.split()[0] if k != 'total' else 'total'}:{v:6.0f}" for k, v in med.items()) + f"  p99 {p99:6.0f}")
print("columns: client->readable, readable->taken, taken->first chunk, first->last done, last done->finished, reply built+sent, sent->client, total (p50 us)")
with open(os.path.join(OUT, "round_trip_probe.json"), "w") as fp:
    json.dump({"client": client, "daemon": mine, "summary": out}, fp)
