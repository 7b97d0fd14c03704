"""Async-client 4 KiB copy round trip against sim daemons of two trees, interleaved; then CPU profiles."""
import os
import subprocess
import sys
import time
import tempfile
import pstats
ROOT = os.getcwd(); trees = {"baseline": os.path.join(ROOT, ".probe/baseline"), "main": ROOT}
sys.path.insert(0, ROOT)
import numpy as np
import uvloop
from priod.client import Client
SITE = os.environ.get("PYTHONPATH", "")
def run(dtree, n, prof=None, prio="normal"):
    sock = os.path.join(tempfile.mkdtemp(), "p.sock")
    env = dict(os.environ, PYTHONPATH=dtree + ":" + SITE, PRIOD_LOG__LEVEL='"warning"')
    cmd = [sys.executable, os.path.join(ROOT, "docs/gpu/rtt_probe/profd.py"), prof] if prof else [sys.executable, "-m", "priod"]
    p = subprocess.Popen([*cmd, "serve", "--backend", "sim", "--socket", sock], env=env, cwd=dtree)
    lat = []
    async def main():
        c = await Client.connect(sock, wait_s=20)
        h, dv = await c.alloc_host(4096), await c.alloc_device(4096)
        for i in range(n):
            t0 = time.perf_counter(); await c.copy(dv, h, 4096, priority=prio); lat.append(time.perf_counter() - t0)
        await c.close()
    try:
        uvloop.run(main())
    finally:
        p.terminate(); p.wait()
    a = np.array(lat[300:]) * 1e6
    return np.percentile(a, 50), np.percentile(a, 90)
for rep in range(3):
    for name, t in trees.items():
        for prio in ("normal", "urgent"):
            p50, p90 = run(t, 3000, prio=prio)
            print(f"rep {rep} daemon {name:8} {prio:6} async client p50 {p50:6.1f} p90 {p90:6.1f} us", flush=True)
n = 5000
for name, t in trees.items():
    prof = f"/tmp/prof_{name}.out"
    run(t, n, prof=prof)
    st = pstats.Stats(prof)
    items = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
    print(f"== {name}: daemon CPU {sum(v[2] for v in st.stats.values()) / n * 1e6:.1f} us/copy (incl. start-up)")
    for (f, line, fn), (_cc, nc, tt, _ct, _) in items:
        print("%8d %6.2f us/copy  %s:%d %s" % (nc, tt / n * 1e6, os.path.basename(f), line, fn))
