"""Where does an urgent copy by the copy kernel lose its 65-80 us to the same copy by DMA, h2d,
outside the daemon's own timings (paths_probe.py, run H)? Session 16's round-trip stamps (socket
readable, taken, first chunk, last seen done, finished, reply sent; one clock on both sides) with
the path forced (stamp_force_site/: both sites at once), one daemon at a time, no bulk, nothing
computing: 256 x 64 KiB as one urgent copy_batch and 16 MiB as one urgent copy, alternating,
COUNT each, 5 ms asleep after each. (Session 19, run I.)

    DIRECTION=h2d COUNT=200 python3 docs/gpu/session19/steps_probe.py
"""
import json, os, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import priod
from priod.testing import daemon_process
from bench_gpu_batch import scattered

KiB = 1 << 10
BACKEND = os.environ.get("BACKEND", "cuda")
COUNT = int(os.environ.get("COUNT", "200"))
DIRECTION = os.environ.get("DIRECTION", "h2d")
OUT = os.environ.get("OUT", ".")
SITE = os.path.join(HERE, "stamp_force_site")
steps = ("client to readable", "readable to taken", "taken to first chunk", "first chunk to last done", "last done to finished", "reply built, sent", "sent to client", "total")
summary = {}
for forced in ("express", "dma"):
    times_path = os.path.join(OUT, f"daemon_times_{DIRECTION}_{forced}.json")
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PROBE_TIMES": times_path, "FORCE_URGENT_PATH": forced,
           "PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", ""), os.getcwd()])}
    client = []
    with daemon_process(env, backend=BACKEND, start_timeout=180) as d, priod.SyncClient(d.socket_path, name="steps", spin_us=2000) as c:
        size = 2 * 256 * 64 * KiB
        h, dv = c.alloc_host(size), c.alloc_device(size)
        dst, src = (dv, h) if DIRECTION == "h2d" else (h, dv)
        segs = scattered(256, 64 * KiB, seed=4)
        for i in range(10 + COUNT):
            for form in ("batch", "contiguous") if i % 2 == 0 else ("contiguous", "batch"):
                t0 = time.perf_counter()
                r = c.copy_batch(dst, src, segs, priority="urgent") if form == "batch" else c.copy(dst, src, 256 * 64 * KiB, priority="urgent")
                t1 = time.perf_counter()
                client.append({"form": form, "t0": t0, "t1": t1, "warm": i >= 10, "path": r.path})
                time.sleep(0.005)
    recs = [r for r in json.load(open(times_path)) if r["nbytes"] == 256 * 64 * KiB]
    assert len(recs) == len(client), (len(recs), len(client))
    for cl, dm in zip(client, recs):
        if not cl["warm"]:
            continue
        parts = [dm["readable"] - cl["t0"], dm["arrival"] - dm["readable"], dm["first"] - dm["arrival"], dm["last"] - dm["first"],
                 dm["finished"] - dm["last"], dm["sent"] - dm["finished"], cl["t1"] - dm["sent"], cl["t1"] - cl["t0"]]
        summary.setdefault(f"{forced} {cl['form']} ({cl['path']})", []).append(parts)
print(f"\n{DIRECTION}, forced path, one daemon at a time, {COUNT} each; p50 us of each step")
print(f"{'path, form':<28}" + "".join(f"{s.split()[0] if s != 'total' else 'total':>9}" for s in steps))
for k, v in summary.items():
    med = np.median(np.array(v), axis=0) * 1e6
    print(f"{k:<28}" + "".join(f"{x:9.0f}" for x in med))
print("columns: client->readable, readable->taken, taken->first chunk, first->last done, last done->finished, reply built+sent, sent->client, total")
with open(os.path.join(OUT, f"steps_probe_{DIRECTION}.json"), "w") as fp:
    json.dump({k: v for k, v in summary.items()}, fp)
