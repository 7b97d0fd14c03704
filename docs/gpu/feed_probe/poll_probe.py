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

def where(pid, pc):
    """The mapped file holding address ``pc`` of process ``pid``."""
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= pc < hi:
            return os.path.basename(parts[5]) if len(parts) > 5 else "anon"
    return "?"

def sample_threads(pid, stop, out):
    """What each of the daemon's threads is doing, sampled: its syscall (or running), wchan."""
    from collections import Counter
    while not stop.is_set():
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                sc = open(f"/proc/{pid}/task/{tid}/syscall").read().split()[0]
                wc = open(f"/proc/{pid}/task/{tid}/wchan").read().strip()
            except OSError:
                continue
            fields = open(f"/proc/{pid}/task/{tid}/syscall").read().split()
            lib = where(pid, int(fields[-1], 16)) if len(fields) > 2 else ""
            out.setdefault(int(tid), Counter())[f"{sc}:{wc}:{lib}"] += 1
        time.sleep(0.003)

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

names = {}

def thread_cpu(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        names[int(tid)] = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
    return out

rows = []
for i, formula in enumerate(["before", "after", "before", "after"] if BASE else ["shipped"]):
    os.environ["PYTHONPATH"] = f"{BASE}:{PATH}" if formula == "before" else PATH
    log = os.path.join(os.environ["OUT"], f"polls_{i}.json"); os.environ["PROBE_POLL_LOG"] = log
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SERVER__BULK_POLL": '"timer"'}
    if os.environ.get("PROBE_THREADLOG_SO"):  # log every thread the daemon starts, and who started it
        env.update(LD_PRELOAD=os.environ["PROBE_THREADLOG_SO"], THREADLOG=os.path.join(os.environ["OUT"], "threads"))
    with daemon_process(env, backend="cuda", start_timeout=180) as dm, priod.SyncClient(dm.socket_path) as sc:
        pid = dm.proc.pid
        th0 = thread_cpu(pid)
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        st0 = sc.status()
        import threading
        stop, samples = threading.Event(), {}
        sampler = threading.Thread(target=sample_threads, args=(pid, stop, samples)); sampler.start()
        import signal
        dumper = threading.Timer(1.5, os.kill, (pid, signal.SIGUSR1)) if os.environ.get("PROBE_FAULTHANDLER") else None
        if dumper:
            dumper.start()
        gbps = asyncio.run(stream(dm.socket_path, 3.0))
        stop.set(); sampler.join()
        for tid, cnt in sorted(samples.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k.startswith("running")))[:3]:
            start = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[19]
            print(f"  thread {tid} (start {start}): " + ", ".join(f"{k} {v}" for k, v in cnt.most_common(4)), flush=True)
        st1 = sc.status()
        c1, t1 = cpu_seconds(pid), time.perf_counter()
        th1 = thread_cpu(pid)
        by_thread = sorted(((th1[k] - th0.get(k, 0.0)) / (t1 - t0), "main" if k == pid else f"{names.get(k, '?')}/{k}") for k in th1)[::-1][:4]
        lane = next(l for l in st1["lanes"] if l["lane"] == "gpu0/h2d")
    time.sleep(0.3)
    dumped = json.load(open(log)); os.remove(log)
    print(formula, "daemon ran", dumped["pump"].replace(os.getcwd(), "."), flush=True)
    p = np.array(dumped["polls"])
    print("python threads at exit:", dumped["threads"], "; busiest:", by_thread, flush=True)
    if os.environ.get("PROBE_THREADLOG_SO"):
        busiest = by_thread[1][1].rsplit("/", 1)[-1]
        log_text = open(os.path.join(os.environ["OUT"], f"threads.{pid}")).read()
        seq = next((line.split()[1] for line in log_text.splitlines() if line.endswith(f" is tid {busiest}")), None)
        print(f"the busiest other thread, tid {busiest}, is thread {seq}; its creation:")
        if seq is not None:
            block = log_text.split(f"create {seq} by")[1].split("create #")[0]
            print("create", seq, "by" + block, flush=True)
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
