"""Probe: can a direct batch's host work shrink? 256 scattered 64 KiB blocks h2d by the copy kernel.

The rows were added run by run (session 14; docs/gpu/session14/*probe*.txt hold each run's
columns). A direct batch (copy kernel) read ~120-170 us over a contiguous direct copy in the bench, of which
the kernel itself is ~30 (docs/gpu/batch_probe/direct_batch_out.txt): the rest is host work after
5 ms asleep, several numpy calls in `direct_table` and `ExpressKernel.launch_table`. Candidates,
each 5 ms apart, order rotating, in this process's CuPy context:
  contiguous  DirectPair.copy of the same 16 MiB
  full        DirectPair.copy_batch as it is in the tree (since session 14: the kernel checks the table)
  old         copy_batch as it was before (7d1ae8c): checks on the host, then the launch
  lean        the table copied (and cast) straight into the kernel's parameter block, then
              checked there with one across-rows max, one all, one sum; then the launch
  raw         the rows' bytes into the parameter block by a memoryview copy, a fixed geometry,
              the launch, the sum after it: no check at all (what a kernel that checks would leave)
  raw_checked raw, launching priod_copy_table_checked (the checked kernel's own cost)
  stepped     copy_batch's steps as in the tree, each timed
  parts       the launch and the wait alone, no checks, no hold (the floor)
first with a hold page of its own (no daemon), then beside an idle cuda daemon on its page.
"""

import itertools
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())

import priod
from priod.direct import DirectCopies, HoldPage, direct_table
from priod.engines.cuda._driver import check, gpu_uuid
from priod.engines.cuda.express import EXPRESS_THREADS, EXPRESS_UNROLL, TABLE_MAX
from priod.errors import InvalidRequest
from priod.holds import PAGE_BYTES
from priod.testing import daemon_process

KiB = 1 << 10
N, BLOCK = 256, 64 * KiB
COUNT = int(os.environ.get("COUNT", "100"))
PAUSE_S = float(os.environ.get("PAUSE_S", "0.005"))
LIMIT = 1 << 62


def main() -> None:
    import cupy as cp

    size = 2 * N * BLOCK
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    host[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dev = cp.zeros(size, dtype=cp.uint8)
    rng = np.random.default_rng(6)
    segs = np.stack([rng.choice(2 * N, N, replace=False) * BLOCK, rng.choice(2 * N, N, replace=False) * BLOCK, np.full(N, BLOCK)], axis=1)
    cells = np.ascontiguousarray(segs.astype(np.uint64))

    def measure(page: HoldPage) -> dict[str, Any]:
        direct = DirectCopies(page)
        pair = direct.pair(dev, host)
        pair.copy_batch(segs)  # loads the kernel, makes the streams
        stream = direct._streams[0]
        kernel = direct._kernels[0]
        assert kernel is not None
        ek = kernel._express
        rows_all = np.ctypeslib.as_array(ek._table)[2:].reshape(TABLE_MAX, 3)
        wave = kernel.sm_count * ek.blocks_per_sm
        main_cu = kernel._cu(stream)
        on_dst, on_src = pair.on_device
        slot = pair._slot

        def lean() -> None:
            table = np.asarray(segs)
            if table.ndim != 2 or table.shape[1] != 3 or table.dtype.kind not in "iu":
                raise InvalidRequest("shape")
            n = table.shape[0]
            if not 0 < n <= TABLE_MAX:
                raise InvalidRequest("rows")
            page.begin(slot)
            try:
                with kernel._launching:
                    rows = rows_all[:n]
                    np.copyto(rows, table, casting="unsafe")  # a negative int64 becomes >= 2**63
                    d_max, s_max, largest = rows.max(axis=0).tolist()
                    if d_max >= LIMIT or s_max >= LIMIT or largest >= LIMIT or not rows[:, 2].all():
                        raise InvalidRequest("values")
                    if d_max + largest > pair.dst_bytes or s_max + largest > pair.src_bytes:
                        raise InvalidRequest("bounds")  # (the real code would look at each row's end)
                    total = int(rows[:, 2].sum())
                    assert total
                    ek._table[0] = on_src
                    ek._table[1] = on_dst
                    wanted = max(1, -(-(largest // 16) // EXPRESS_UNROLL))
                    threads = min(EXPRESS_THREADS, max(32, -(-wanted // 32) * 32))
                    per_row = max(1, min(-(-wanted // threads), wave // n))
                    check(ek._cu_launch(kernel.table_function, per_row, n, 1, threads, 1, 1, 0, main_cu, ek._tparams, 0))
                direct._wait(stream)
            finally:
                page.end(slot)

        tbytes = memoryview(ek._table).cast("B")

        def raw() -> None:
            """The floor of a kernel-checked path: the rows' bytes into the parameter block by a
            memoryview copy (no numpy call), a fixed geometry, the launch; unchecked here."""
            table = np.asarray(segs)
            if table.ndim != 2 or table.shape[1] != 3 or table.dtype.itemsize != 8 or not table.flags.c_contiguous:
                raise InvalidRequest("shape")
            n = table.shape[0]
            page.begin(slot)
            try:
                with kernel._launching:
                    tbytes[16 : 16 + 24 * n] = memoryview(table).cast("B")
                    ek._table[0] = on_src
                    ek._table[1] = on_dst
                    check(ek._cu_launch(kernel.table_function, max(1, wave // n), n, 1, EXPRESS_THREADS, 1, 1, 0, main_cu, ek._tparams, 0))
                total = int(table[:, 2].sum())  # after the launch: overlapped with the copy
                assert total
                direct._wait(stream)
            finally:
                page.end(slot)

        def raw_checked() -> None:
            """`raw`, launching the kernel that checks the table (priod_copy_table_checked) with
            its header: the checked kernel's own cost beside `raw`."""
            table = np.asarray(segs)
            if table.ndim != 2 or table.shape[1] != 3 or table.dtype.itemsize != 8 or not table.flags.c_contiguous:
                raise InvalidRequest("shape")
            n = table.shape[0]
            page.begin(slot)
            try:
                with kernel._launching:
                    word = kernel._free_faults.pop()
                    kernel._faults[word] = 0
                    head = kernel._checked_head
                    head[0], head[1], head[2], head[3], head[4] = on_src, on_dst, pair.src_bytes, pair.dst_bytes, kernel._faults_on_gpu + 8 * word
                    kernel._checked_bytes[40 : 40 + 24 * n] = table.data.cast("B")
                    check(ek._cu_launch(kernel.checked_function, max(1, wave // n), n, 1, EXPRESS_THREADS, 1, 1, 0, main_cu, kernel._checked_params, 0))
                total = int(table[:, 2].sum())
                assert total
                direct._wait(stream)
                assert kernel.fault(word) == 0
            finally:
                page.end(slot)

        steps: list[list[float]] = []

        def stepped() -> None:
            """copy_batch as in the tree, timed step by step: rows, kernel, launch, sum, wait, fault."""
            from priod.direct import KERNEL_BLOCK_MAX, direct_rows

            t = [time.perf_counter()]
            page.begin(slot)
            rows = direct_rows(segs)
            t.append(time.perf_counter())
            k = direct._kernel(0) if rows[0, 2] < KERNEL_BLOCK_MAX else None
            st = direct._streams.get(0)
            assert k is not None
            t.append(time.perf_counter())
            word = k.launch_checked(on_dst, on_src, rows, pair.dst_bytes, pair.src_bytes, st)
            t.append(time.perf_counter())
            total = int(np.asarray(rows)[:, 2].sum())
            assert total
            t.append(time.perf_counter())
            direct._wait(st)
            t.append(time.perf_counter())
            assert word is not None and k.fault(word) == 0
            page.end(slot)
            t.append(time.perf_counter())
            steps.append([(b - a) * 1e6 for a, b in itertools.pairwise(t)])

        def old() -> None:
            """copy_batch before the kernel checked its table (7d1ae8c): the hold, `direct_table`'s
            checks on the host, `_BatchKernel.launch`, the wait."""
            page.begin(slot)
            try:
                cells_, _total, largest = direct_table(segs, pair.dst_bytes, pair.src_bytes)
                kernel.launch(on_dst, on_src, cells_, largest, stream)
                direct._wait(stream)
            finally:
                page.end(slot)

        def parts() -> None:
            kernel.launch(on_dst, on_src, cells, BLOCK, stream)
            direct._wait(stream)

        ways: dict[str, Any] = {
            "contiguous": lambda: pair.copy(N * BLOCK),
            "full": lambda: pair.copy_batch(segs),
            "old": old,
            "lean": lean,
            "raw": raw,
            "raw_checked": raw_checked,
            "stepped": stepped,
            "parts": parts,
        }
        names = list(ways)
        lat: dict[str, list[float]] = {k: [] for k in ways}
        for i in range(COUNT):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                ways[name]()
                lat[name].append((time.perf_counter() - t0) * 1e6)
        for name in ("full", "old", "lean", "raw", "raw_checked"):
            dev.fill(0)
            ways[name]()
            got = cp.asnumpy(dev)
            for d, s_, n in segs.tolist():
                assert np.array_equal(got[d : d + n], host[s_ : s_ + n]), f"{name}: a block differs"
        direct.close()
        out = {k: {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)), "raw": v} for k, v in lat.items()}
        names = ("rows", "kernel", "launch", "sum", "wait", "fault+end")
        out["steps_p50"] = {nm: float(np.percentile([x[i] for x in steps], 50)) for i, nm in enumerate(names)}
        return out

    res: dict[str, Any] = {}
    fd = os.memfd_create("probe-page")
    os.ftruncate(fd, PAGE_BYTES)
    own = HoldPage(fd, [{"device": 0, "device_uuid": gpu_uuid(0), "direction": "h2d"}, {"device": 0, "device_uuid": gpu_uuid(0), "direction": "d2h"}])
    for rnd in (1, 2):
        res[f"own page, no daemon #{rnd}"] = measure(own)
    env = {"PRIOD_LOG__LEVEL": '"warning"'}
    with daemon_process(env, backend="cuda", start_timeout=180) as d, priod.SyncClient(d.socket_path, name="probe") as c:
        page = c.hold_page()
        for rnd in (1, 2):
            res[f"daemon idle, its page #{rnd}"] = measure(page)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "lean_batch.json"), "w") as f:
        json.dump(res, f)
    ways = ("contiguous", "full", "old", "lean", "raw", "raw_checked", "stepped", "parts")
    print(f"{'condition (p50 / p90 / p99 us)':<30}" + "".join(f"{w:>22}" for w in ways))
    for cond, r in res.items():
        print(f"{cond:<30}" + "".join(f"{r[w]['p50']:>8.0f}/{r[w]['p90']:>6.0f}/{r[w]['p99']:>6.0f}" for w in ways))
        print(f"{'':<30}stepped p50 us: " + ", ".join(f"{k} {v:.1f}" for k, v in r["steps_p50"].items()))


if __name__ == "__main__":
    main()
