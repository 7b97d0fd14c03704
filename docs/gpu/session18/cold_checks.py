"""Segments.decode + check_regions of two trees, alternating, each after 5 ms asleep and 32 MiB
of writes (the daemon's cold start on a batch). OLD: a tree before (`git archive REV priod | tar -x -C DIR`).

    OLD=/tmp/oldtree .venv/bin/python docs/gpu/session18/cold_checks.py
"""
import os, sys, time, statistics
import numpy as np
def load(path, name):
    sys.path.insert(0, path)
    for k in [k for k in sys.modules if k == 'priod' or k.startswith('priod.')]: del sys.modules[k]
    import priod.batch as b
    sys.path.remove(path)
    return b
old = load(os.environ['OLD'], 'old').Segments
new = load(os.getcwd(), 'new').Segments
junk = np.zeros(32 << 20, np.uint8)
def evict():
    time.sleep(0.005); junk[:] = 1
rng = np.random.default_rng(1)
for n in (64, 256, 512, 4096):
    B = 64 << 10
    t = np.stack([rng.choice(4 * n, n, replace=False) * B, rng.choice(4 * n, n, replace=False) * B, np.full(n, B)], axis=1).astype(np.uint64)
    raw = t.tobytes()
    res = {'old': [], 'new': []}
    for i in range(80):
        for name, S in (('old', old), ('new', new)) if i % 2 else (('new', new), ('old', old)):
            evict()
            t0 = time.perf_counter(); s = S.decode(raw); s.check_regions(1 << 40, 1 << 40, None, 1, 2); res[name].append((time.perf_counter() - t0) * 1e6)
    print(n, {k: round(statistics.median(v[5:]), 1) for k, v in res.items()})
