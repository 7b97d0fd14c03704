"""Where an urgent copy's round trip goes: timestamps on both sides of the socket
(perf_counter is one clock across processes). Run from the root of a throwaway copy of the
tree with docs/gpu/rtt_probe/probe.patch applied:

    cp -r . /tmp/p && cd /tmp/p && patch -p1 < docs/gpu/rtt_probe/probe.patch
    python3 docs/gpu/rtt_probe/probe_client.py cuda 65536 2000 0.005   # backend, bytes, client spin us, gap s
"""
import sys
import os
import time
import json
HERE = os.getcwd()  # the root of a patched throwaway copy of the tree
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
import numpy as np
from priod.client import SyncClient
from priod.testing import daemon_process
from priod import transport
backend, size, spin, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
stamps = []
orig_send = transport.BlockingFramedSocket.send
orig_recv = transport.BlockingFramedSocket._recv
def send(self, msg, fds=()):
    stamps.append(("csend", time.perf_counter())); return orig_send(self, msg, fds)
def recv(self):
    r = orig_recv(self); stamps.append(("crecv", time.perf_counter())); return r
transport.BlockingFramedSocket.send = send; transport.BlockingFramedSocket._recv = recv
try: os.unlink("/tmp/probe_daemon.json")
except FileNotFoundError: pass
with daemon_process({"PRIOD_LOG__LEVEL": '"warning"'}, backend=backend) as d, SyncClient(d.socket_path, spin_us=spin) as c:
    h, dv = c.alloc_host(size), c.alloc_device(size)
    t = []; tot = []
    for i in range(600):
        stamps.clear() if i == 100 else None
        t0 = time.perf_counter(); r = c.copy(dv, h, size, priority="urgent"); t.append(time.perf_counter() - t0); tot.append(r.total_us)
        time.sleep(gap)
time.sleep(0.5)
with open("/tmp/probe_daemon.json") as fp:
    dm = json.load(fp)
ev = {}
for k, v in stamps + [tuple(x) for x in dm]:
    ev.setdefault(k, []).append(v)
for k in ev: ev[k] = np.sort(np.array(ev[k]))
arr = ev["arrival"][ev["arrival"] > ev["csend"][0]]
def before(kind, ts):  # the latest stamp of kind at or before each ts
    a = ev[kind]; i = np.searchsorted(a, ts, side="right") - 1
    return a[i]
def after(kind, ts):
    a = ev[kind]; i = np.searchsorted(a, ts, side="left")
    ok = i < len(a); return a[np.minimum(i, len(a) - 1)], ok
read = before("read", arr); csend = before("csend", arr)
fin, _ = after("finish", arr); sent, _ = after("sent", fin); crecv, _ = after("crecv", sent)
print(f"{backend} {size} B spin {spin} gap {gap}: client p50 {np.median(t[100:])*1e6:.1f} p99 {np.percentile(t[100:],99)*1e6:.1f}; daemon total_us p50 {np.median(tot[100:]):.1f}")
for name, a, b in (("csend->read", csend, read), ("read->arrival", read, arr), ("arrival->finish", arr, fin), ("finish->sent", fin, sent), ("sent->crecv", sent, crecv)):
    d = (b - a) * 1e6
    print(f"  {name:<16} p50 {np.median(d):7.1f}  p90 {np.percentile(d, 90):7.1f} us")
