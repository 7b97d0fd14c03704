"""Where an urgent copy's time goes: timestamps on both sides of the socket.

Not part of priod: run it from a throwaway copy of the tree with probe.patch applied (it stamps
the daemon's read, request, arrival, submit, completion and reply times into each reply).

    patch -p1 < docs/gpu/rtt_probe/probe.patch
    python3 docs/gpu/rtt_probe/rtt.py cuda timer,spin     # or: sim spin

Prints the median of each step for 64 KiB urgent h2d copies under a 1 GiB bulk stream.
"""
import sys
import time
import os
import multiprocessing as mp
import numpy as np
sys.path.insert(0, os.getcwd())
import priod
from priod.testing import daemon_process
def bulk(path, stop):
    with priod.SyncClient(path, name="bulk") as c:
        h, d = c.alloc_host(1 << 30), c.alloc_device(1 << 30)
        while not stop.is_set(): c.copy(d, h, priority="bulk")
names = ["send>read", "read>recv", "recv>arrival", "arrival>submit", "submit>done", "done>send", "send>client"]
if __name__ == "__main__":
    backend = sys.argv[1]
    for mode in sys.argv[2].split(","):
        with daemon_process({"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_SERVER__BULK_POLL": f'"{mode}"'}, backend=backend, start_timeout=120) as d:
            ctx = mp.get_context("spawn"); stop = ctx.Event(); b = ctx.Process(target=bulk, args=(d.socket_path, stop)); b.start()
            with priod.SyncClient(d.socket_path, spin_us=2000) as c:
                h = c.alloc_host(1 << 20); g = c.alloc_device(1 << 20)
                time.sleep(3)
                for n in (65536,):
                    rows = []
                    for i in range(400):
                        t0 = time.perf_counter(); r = c._request({"op": "copy", "dst": g.id, "src": h.id, "nbytes": n, "priority": "urgent"}); t5 = time.perf_counter()
                        rows.append(np.diff([t0] + r["t"] + [t5])); time.sleep(0.003)
                    a = np.percentile(np.array(rows[50:]) * 1e6, 50, axis=0)
                    print(backend, mode, n, " ".join(f"{k} {v:.0f}" for k, v in zip(names, a)), "| sum of medians %.0f" % a.sum(), flush=True)
            stop.set(); b.join()
