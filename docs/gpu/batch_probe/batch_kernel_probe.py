"""Probe: can the table copy kernel move bulk batches of 64 KiB blocks at >= 0.9 of the link?"""
import os, mmap, time, sys, json
import numpy as np
sys.path.insert(0, os.getcwd())
from priod.engines.base import LaneKey, Direction, Path
from priod.engines.cuda import CudaEngine
from priod.engines.cuda._driver import check, bindings
from priod.engines.cuda.express import TABLE_MAX

MiB = 1 << 20
REGION = 512 * MiB
BLOCK = 64 << 10
N = 256
REPS = 40

def host_region(n):
    fd = os.memfd_create("probe"); os.ftruncate(fd, n); return fd

eng = CudaEngine(devices=[0], calibrate_bytes=256 << 20)
fd = host_region(REGION)
host = eng.map_host(fd, REGION)
dev = eng.alloc_device(REGION, 0)
rng = np.random.default_rng(1)
slots = REGION // BLOCK
def table():
    d = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    s = rng.choice(slots, N, replace=False).astype(np.uint64) * BLOCK
    return d, s, np.full(N, BLOCK, dtype=np.uint64)
tabs = [table() for _ in range(8)]

def run(label, direction, submit_one, nbytes_each):
    lane = LaneKey(0, direction)
    # warm
    c = None
    for i in range(3): c = submit_one(lane, i)
    while not c.done(): pass
    t0 = time.perf_counter()
    comps = [submit_one(lane, i) for i in range(REPS)]
    while not comps[-1].done(): pass
    dt = time.perf_counter() - t0
    for x in comps:
        while not x.done(): pass
        x.release()
    gbps = REPS * nbytes_each / dt / 1e9
    return gbps

res = {}
for direction in (Direction.H2D, Direction.D2H):
    dst, src = (dev, host) if direction is Direction.H2D else (host, dev)
    row = {}
    row["dma contiguous 16MiB"] = run("c", direction, lambda lane, i: eng.submit(lane, Path.DMA, dst, (i % 8) * 16 * MiB, src, (i % 8) * 16 * MiB, 16 * MiB), 16 * MiB)
    row["dma batch"] = run("b", direction, lambda lane, i: eng.submit_segments(lane, Path.DMA, dst, tabs[i % 8][0], src, tabs[i % 8][1], tabs[i % 8][2]), N * BLOCK)
    for bps in (1, 2, 4):
        eng.express_blocks_per_sm = bps
        row[f"kernel table bps{bps}"] = run("k", direction, lambda lane, i: eng.submit_segments(lane, Path.EXPRESS, dst, tabs[i % 8][0], src, tabs[i % 8][1], tabs[i % 8][2]), N * BLOCK)
    eng.express_blocks_per_sm = 2
    row["kernel contiguous 16MiB"] = run("kc", direction, lambda lane, i: eng.submit(lane, Path.EXPRESS, dst, (i % 8) * 16 * MiB, src, (i % 8) * 16 * MiB, 16 * MiB), 16 * MiB)
    # variants of the table grid: threads per block x blocks per row, one launch per 128 rows
    k = eng._kernel
    devobj = eng._devices[0]
    lane_obj = devobj.h2d if direction is Direction.H2D else devobj.d2h
    _, drv = bindings()
    from priod.engines.cuda.engine import _host
    for threads, per_row in ((256, 1), (256, 4), (512, 2), (1024, 2), (128, 8)):
        def sub(lane, i, threads=threads, per_row=per_row):
            d_off, s_off, sizes = tabs[i % 8]
            sh, dh = _host(src), _host(dst)
            sp = sh.device_pointer if sh is not None else src.pointer
            dp = dh.device_pointer if dh is not None else dst.pointer
            t, view = k._table, k._table_view
            t[0] = sp; t[1] = dp
            for first in range(0, N, TABLE_MAX):
                rows = min(N, first + TABLE_MAX) - first
                cells = view[2: 2 + 3 * rows].reshape(rows, 3)
                cells[:, 0] = d_off[first:first + rows]; cells[:, 1] = s_off[first:first + rows]; cells[:, 2] = sizes[first:first + rows]
                check(drv.cuLaunchKernel(devobj.table_function, per_row, rows, 1, threads, 1, 1, 0, lane_obj.express_cu, k._tparams, 0))
            return eng._record(devobj, lane_obj, lane_obj.express)
        row[f"table {threads}thr x{per_row}/row"] = run("v", direction, sub, N * BLOCK)
    res[direction.value] = row
print(json.dumps(res, indent=1))
for d, row in res.items():
    raw = row["dma contiguous 16MiB"]
    for k_, v in row.items():
        print(f"{d} {k_:28s} {v:7.2f} GB/s  x raw {v/raw:.3f}")
