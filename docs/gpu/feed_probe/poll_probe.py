"""One 1 GiB h2d bulk stream through the daemon (two copies outstanding, 3 s), nothing urgent:
the daemon's CPU (by thread), its polls, and what each poll found (PROBE_POLL_LOG;
sitecustomize.py in docs/gpu/batch_probe). Second form: the tree before this change (BASE, first
on the daemon's PYTHONPATH: sitecustomize imports priod before ``-m priod`` looks in the working
directory) against this one."""
import os, sys, time, json, asyncio
import numpy as np
sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process, cpu_seconds
GiB = 1 << 30

async def stream(path, seconds):
    c = await priod.connect(path, name="bulk")
    h, d = await c.alloc_host(GiB), await c.alloc_device(GiB)
    await c.copy(d, h, priority="bulk")
    t0 = time.perf_counter(); moved = 0
    pending = [c.start_copy(d, h, priority="bulk") for _ in range(2)]
    while pending:
        r = await pending.pop(0); moved += r.nbytes
        if time.perf_counter() - t0 < seconds:
            pending.append(c.start_copy(d, h, priority="bulk"))
    el = time.perf_counter() - t0
    await c.close()
    return moved / el / 1e9

BASE = os.environ.get("BASE")
PATH = os.environ.get("PYTHONPATH", "")

def thread_cpu(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out

rows = []
for i, formula in enumerate(["before", "after", "before", "after"] if BASE else ["shipped"]):
    os.environ["PYTHONPATH"] = f"{BASE}:{PATH}" if formula == "before" else PATH
    log = os.path.join(os.environ["OUT"], f"polls_{i}.json"); os.environ["PROBE_POLL_LOG"] = log
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SERVER__BULK_POLL": '"timer"'}
    with daemon_process(env, backend="cuda", start_timeout=180) as dm, priod.SyncClient(dm.socket_path) as sc:
        pid = dm.proc.pid
        th0 = thread_cpu(pid)
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        st0 = sc.status()
        gbps = asyncio.run(stream(dm.socket_path, 3.0))
        st1 = sc.status()
        c1, t1 = cpu_seconds(pid), time.perf_counter()
        th1 = thread_cpu(pid)
        by_thread = sorted(((th1[k] - th0.get(k, 0.0)) / (t1 - t0), "main" if k == pid else "other") for k in th1)[::-1][:4]
        lane = next(l for l in st1["lanes"] if l["lane"] == "gpu0/h2d")
    time.sleep(0.3)
    dumped = json.load(open(log)); os.remove(log)
    print(formula, "daemon ran", dumped["pump"].replace(os.getcwd(), "."), flush=True)
    p = np.array(dumped["polls"])
    p = p[(p[:, 0] > t0 + 0.5) & (p[:, 0] < t1 - 0.3)]
    span = p[-1, 0] - p[0, 0]
    found = p[:, 1] > 0
    gaps = np.diff(p[:, 0]) * 1e6
    chunks_s = gbps * 1e9 / lane["chunk_bytes"]
    rows.append((formula, gbps, (c1 - c0) / (t1 - t0), len(p) / span, found.mean(), len(p) / span / chunks_s, float(np.median(gaps)), lane["chunk_bytes"], by_thread))
    print(rows[-1], flush=True)
print(f"{'next_poll_at':10s} {'GB/s':>6s} {'CPU s/s':>8s} {'polls/s':>8s} {'found':>6s} {'polls/chunk':>11s} {'gap p50 us':>10s}")
for f, g, cpu, ps, fd, pc, gap, cb, th in rows:
    print(f"{f:10s} {g:6.1f} {cpu:8.3f} {ps:8.0f} {fd:6.2f} {pc:11.2f} {gap:10.0f}   chunk {cb/2**20:.1f} MiB; CPU s/s by thread " + ", ".join(f"{n} {c:.3f}" for c, n in th))
