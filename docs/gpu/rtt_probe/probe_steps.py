"""Where an urgent copy's round trip goes, step by step: stamps on both sides of the socket
(perf_counter is one clock across processes); the daemon's come from sitecustomize.py beside
this file, loaded through PYTHONPATH. Run from the tree root:

    python3 docs/gpu/rtt_probe/probe_steps.py cuda 65536 0.005 sleep   # backend, bytes, gap s, sleep|spin[, PRIOD_X__Y=V,...]
"""
import os
import sys
import time
import json
ROOT = os.getcwd(); sys.path.insert(0, ROOT)
import numpy as np
from priod.client import SyncClient
from priod.testing import daemon_process
from priod import transport
backend, size, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]); mode = sys.argv[4] if len(sys.argv) > 4 else "sleep"
extra = dict(kv.split("=", 1) for kv in sys.argv[5].split(",")) if len(sys.argv) > 5 else {}  # PRIOD_X__Y=V,...
out = f"/tmp/probe_{backend}_{size}.json"
stamps = []
ob, orr = transport.BlockingFramedSocket.send, transport.BlockingFramedSocket._recv
def send(self, msg, fds=()):
    stamps.append(("csend", time.perf_counter())); return ob(self, msg, fds)
def recv(self):
    r = orr(self); stamps.append(("crecv", time.perf_counter())); return r
transport.BlockingFramedSocket.send = send; transport.BlockingFramedSocket._recv = recv
env = {**extra, "PRIOD_LOG__LEVEL": '"warning"', "PRIOD_PROBE_OUT": out, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", "")}
t = []; tot = []; paths = set()
cpus = [int(x) for x in os.environ.get("PROBE_CPUS", "").split(",") if x]  # daemon's CPU, client's CPU
with daemon_process(env, backend=backend) as d, SyncClient(d.socket_path, spin_us=2000) as c:
    if cpus:
        for tid in os.listdir(f"/proc/{d.proc.pid}/task"):  # every thread of the daemon
            os.sched_setaffinity(int(tid), {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
    h, dv = c.alloc_host(size), c.alloc_device(size)
    for i in range(700):
        if i == 200: stamps.clear()
        t0 = time.perf_counter(); r = c.copy(dv, h, size, priority="urgent"); t1 = time.perf_counter()
        if i >= 200: t.append((t0, t1)); tot.append(r.total_us); paths.add(r.path)
        if mode == "spin":
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(gap)
with open(out) as fp:
    dm = json.load(fp)
ev = {}
for k, v in stamps + [tuple(x) for x in dm]:
    ev.setdefault(k, []).append(v)
ev = {k: np.sort(np.array(v)) for k, v in ev.items()}
def first_after(kind, ts):
    a = ev[kind]; i = np.searchsorted(a, ts, side="left"); return a[np.minimum(i, len(a) - 1)]
def last_before(kind, ts):
    a = ev[kind]; i = np.searchsorted(a, ts, side="right") - 1; return a[np.maximum(i, 0)]
t0s = np.array([a for a, _ in t]); t1s = np.array([b for _, b in t])
cs = first_after("csend", t0s); rd = first_after("read", cs); ar = first_after("arrival", rd); sb = first_after("submitted", ar)
fi = first_after("finish", sb); se = first_after("sent", fi); cr = last_before("crecv", t1s)
lat = (t1s - t0s) * 1e6
print(f"{backend} {size} B gap {gap}s {mode} {extra} paths {sorted(paths)}: client p50 {np.median(lat):.1f} p99 {np.percentile(lat, 99):.1f}; "
      f"daemon total_us p50 {np.median(tot):.1f}")
steps = (
    ("t0->csend", t0s, cs), ("csend->read", cs, rd), ("read->arrival", rd, ar), ("arrival->submitted", ar, sb),
    ("submitted->finish(seen)", sb, fi), ("finish->sent", fi, se), ("sent->crecv", se, cr), ("crecv->t1", cr, t1s),
)
for name, a, b in steps:
    dd = (b - a) * 1e6
    print(f"  {name:<24} p50 {np.median(dd):7.1f}  p90 {np.percentile(dd, 90):7.1f} us")
