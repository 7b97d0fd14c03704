"""Why bulk batches of 16 MiB (256 x 64 KiB) move at ~0.5-0.6 of the link with two outstanding,
where batches of 256 MiB reach ~0.99 (batch_bulk_probe.py, *-quiet phases): the daemon's own
timestamps of each batch (probe_site/sitecustomize.py of session 16: frame readable, taken,
first chunk submitted, last chunk seen done, reply sent), h2d, nothing else running; the client
keeps OUTSTANDING batches in flight. Per batch, medians: the gaps that leave the link idle.

    PYTHONPATH=<wheels>:. OUTSTANDING=2 MIB=16 python3 docs/gpu/session17/bulk_batch_timeline.py
    DEPTH=4 ...   # the daemon's [scheduler] depth (default 2: also each tenant's chunks in flight)
"""
import itertools, json, os, sys, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.getcwd())
site = os.path.join(os.path.dirname(HERE), "session16", "probe_site")
os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", ""), os.getcwd()])
import priod
from priod.testing import daemon_process

OUT = os.environ.get("OUT", ".")
MIB, OUTSTANDING, SECONDS = int(os.environ.get("MIB", "16")), int(os.environ.get("OUTSTANDING", "2")), 2.0
times = os.path.join(OUT, f"bulk_timeline_{MIB}_{OUTSTANDING}_{os.environ.get('DEPTH', 'd')}.json")
os.environ["PROBE_TIMES"] = times
client = []
settings = {"PRIOD_LOG__LEVEL": '"warning"', "PROBE_TIMES": times}
if os.environ.get("DEPTH"):
    settings["PRIOD_SCHEDULER__DEPTH"] = os.environ["DEPTH"]
with daemon_process(settings, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="bulk") as c:
    n = MIB << 20
    h, dv = c.alloc_host(n), c.alloc_device(n)
    blocks = n // (64 << 10)
    rng = np.random.default_rng(7)
    segs = np.stack([rng.permutation(blocks) * (64 << 10), np.arange(blocks) * (64 << 10), np.full(blocks, 64 << 10)], axis=1)
    c.start_copy_batch(dv, h, segs, priority="bulk").wait(60)
    pending = [(time.perf_counter(), c.start_copy_batch(dv, h, segs, priority="bulk")) for _ in range(OUTSTANDING)]
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < SECONDS:
        sent, p = pending.pop(0)
        moved += p.wait(60).nbytes
        client.append((sent, time.perf_counter()))
        pending.append((time.perf_counter(), c.start_copy_batch(dv, h, segs, priority="bulk")))
    took = time.perf_counter() - t0
    for _, p in pending:
        p.wait(60)
recs = sorted((r for r in json.load(open(times)) if r["batch"] and r["nbytes"] == n), key=lambda r: r["arrival"])[1:]  # the first warms up
link_us = n / 55e9 * 1e6
rows = {"readable to taken": [], "taken to first chunk": [], "first chunk to last seen done": [],
        "last done to reply sent": [], "last done to the next batch's last done": [], "prev last done to this first chunk": []}
for a, b in itertools.pairwise(recs):
    rows["readable to taken"].append(b["arrival"] - b["readable"])
    rows["taken to first chunk"].append(b["first"] - b["arrival"])
    rows["first chunk to last seen done"].append(b["last"] - b["first"])
    rows["last done to reply sent"].append(b["sent"] - b["last"])
    rows["last done to the next batch's last done"].append(b["last"] - a["last"])
    rows["prev last done to this first chunk"].append(b["first"] - a["last"])
print(f"depth {os.environ.get('DEPTH', 'default')}: {MIB} MiB batches of 64 KiB blocks, {OUTSTANDING} outstanding: {moved / took / 1e9:.2f} GB/s ({len(recs)} batches; the link moves one in {link_us:.0f} us at 55 GB/s)")
for k, v in rows.items():
    if v:
        print(f"  {k:42s} p50 {np.median(v) * 1e6:7.0f}  p90 {np.percentile(v, 90) * 1e6:7.0f} us")
