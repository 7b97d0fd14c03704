"""Where one copy_batch's time goes on the sim engine, this VM (Session 19): bench_batch.py's
batch rounds (512 scattered 16 KiB blocks, 55 GB/s link, fresh random host bytes and a read-back
between rounds), with timestamps on both sides of the socket (perf_counter is one clock across
processes). Run from a tree with stamps.patch applied, after `mkdir -p /tmp/priod-stamps`:

    git apply docs/gpu/session19/vm_sim_batch/stamps.patch   # in a scratch copy of the tree
    PYTHONPATH=$PWD ROUNDS=100 .venv/bin/python docs/gpu/session19/vm_sim_batch/batch_rounds.py
    python3 docs/gpu/session19/vm_sim_batch/steps.py
"""
import asyncio, os, sys, time, subprocess, signal, statistics
import numpy as np
sys.path.insert(0, os.getcwd())
import priod
import priod.transport as _pt
_CR=[]
_orig=_pt.FramedSocket._on_readable
def _hook(self):
    _CR.append(time.perf_counter()); _orig(self)
_pt.FramedSocket._on_readable=_hook
import priod.client_base as _cb, priod.client as _cl
_ST={}
_obr=_cl.batch_request
def _br(*a, **k):
    _ST['b0']=time.perf_counter(); r=_obr(*a, **k); _ST['b1']=time.perf_counter(); return r
_cl.batch_request=_br
_osend=_pt.FramedSocket.send
def _snd(self, msg, fds=()):
    _ST['s0']=time.perf_counter(); _ST['frame']=msg; r=_osend(self, msg, fds); _ST['s1']=time.perf_counter(); return r
_pt.FramedSocket.send=_snd
_oss=None
from priod.testing import daemon_process
n, block, slots = 512, 16 << 10, 1024
async def main():
    env = {"PRIOD_LOG__LEVEL": '"warning"', "PRIOD_LIMITS__MAX_REQUESTS_PER_S_PER_UID": "0", "PRIOD_SIM__H2D_GBPS": "55", "PRIOD_SIM__D2H_GBPS": "55"}
    rng = np.random.default_rng(1)
    with daemon_process(env, backend="sim", start_timeout=120) as d:
        async with priod.connect(d.socket_path, name="prof") as c:
            host, dev, back = await c.alloc_host(slots * block), await c.alloc_device(slots * block), await c.alloc_host(slots * block)
            segs = [np.stack([rng.choice(slots, n, replace=False) * block, rng.choice(slots, n, replace=False) * block, np.full(n, block)], 1).astype(np.int64) for _ in range(8)]
            for i in range(20): await c.copy_batch(dev, host, segs[i % 8])
            spy = None
            ts = []; tot = []; tr = []; q = []
            for i in range(int(os.environ.get("ROUNDS","200"))):
                host.array[:] = rng.integers(0, 256, slots * block, dtype=np.uint8); sg = np.stack([rng.choice(slots, n, replace=False) * block, rng.choice(slots, n, replace=False) * block, np.full(n, block)], 1).astype(np.int64)
                t = time.perf_counter(); h = c.start_copy_batch(dev, host, sg); tb = time.perf_counter(); _S2=dict(_ST); _CR.clear(); r = await h; tc = time.perf_counter(); cr = _CR[-1] if _CR else 0; ts.append(tc - t); open('/tmp/priod-stamps/client.log','a').write(f'{t:.6f} {tb:.6f} {tc:.6f} {cr:.6f} {_S2["b0"]:.6f} {_S2["b1"]:.6f} {_S2["s0"]:.6f} {_S2["s1"]:.6f}\n')
                await c.copy(back, dev); tot.append(r.total_us); tr.append(r.transfer_us); q.append(r.queued_us)
            if spy: spy.send_signal(signal.SIGINT); spy.wait()
            print(f"wall p50 {statistics.median(ts)*1e6:.0f} us, total {statistics.median(tot):.0f} transfer {statistics.median(tr):.0f} queued {statistics.median(q):.0f}")
asyncio.run(main())
