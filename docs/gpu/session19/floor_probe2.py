"""floor_probe.py again, with the leanest launch a Python server can make, and a daemon that never
looks at the path it did not choose (Session 19, run G onwards).

Besides floor_probe.py's rows: ``bare-min``, the same bare server launching with no engine call
(the kernel's parameters filled from the request and ``cuLaunchKernel``, then an event: no
bounds, no peaks, no lane lookup); and ``nolook``, a second daemon with ``[scheduler]
explore_every`` at 10**9, so an urgent copy never goes the slower way to look at it. Each priod
sample's path is kept.

floor_probe.py's description, for the rest:

Two servers on one GPU, each asked for the same two things, interleaved, by clients of this
process that spin for their reply up to 2 ms (as the bench's SyncClient, ``spin_us=2000``) and
sleep 5 ms after it (as ``bench_gpu_batch.py``'s ``--gap sleep``):
  bare   a minimal Python server (uvloop, a Unix socket, 6 bytes of header and the raw table):
         it takes the request, launches priod's copy kernel through priod's own engine
         (`CudaEngine.submit` / `submit_segments`, express path), polls the completion on every
         loop turn and answers one byte. No decoding, no checks, no scheduler, no books: the
         floor of a Python process round trip around the same launch.
  priod  the daemon (defaults), a SyncClient's urgent ``copy`` and ``copy_batch``.
Forms: 256 scattered 64 KiB blocks (16 MiB) as one batch, and the same bytes as one contiguous
copy. Nothing computing, no bulk. Prints p50 / p99 per server and form and the batch's excess
over contiguous; full numbers in $OUT/floor_probe.json.

    DIRECTION=h2d COUNT=300 python3 docs/gpu/session19/floor_probe2.py
    BACKEND=sim COUNT=10 .venv/bin/python docs/gpu/session19/floor_probe2.py   # a dry run, no GPU
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

KiB = 1 << 10
BLOCKS, BLOCK = 256, 64 * KiB
SIZE = 2 * BLOCKS * BLOCK
BACKEND = os.environ.get("BACKEND", "cuda")
HEADER = struct.Struct("<ccI")  # op (c: contiguous, b: batch), direction (h, d), table bytes
STAMPS = struct.Struct("<4d")  # the bare server's reply after b"k": data in, launch begun, launch returned, seen done


def table() -> np.ndarray:
    from bench_gpu_batch import scattered

    return scattered(BLOCKS, BLOCK, seed=4)


# -- the bare server -----------------------------------------------------------------------------
def serve(path: str) -> None:
    import uvloop

    from priod.batch import ROW
    from priod.engines.base import Direction, LaneKey, Path
    if BACKEND == "sim":  # a dry run of the probe itself, on any machine
        from priod.engines.sim import SimEngine

        eng: Any = SimEngine()
    else:
        from priod.engines.cuda import CudaEngine
        from priod.engines.cuda._driver import check

        eng = CudaEngine(devices=[0], calibrate_bytes=64 << 20)
    timings: list[tuple[str, float]] = []
    if os.environ.get("STEPS"):  # time the engine's steps of a launch (each wrapper adds ~1 us)
        import priod.engines.cuda.engine as engine_module

        def timed(name: str, fn: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timings.append((name, (time.perf_counter() - t) * 1e6))

            return wrapper

        engine_module.column_peaks = timed("column_peaks", engine_module.column_peaks)
        eng._kernel.launch_table = timed("launch_table", eng._kernel.launch_table)
        eng._kernel.launch = timed("launch", eng._kernel.launch)
        eng._kernel._cu_launch = timed("cuLaunchKernel", eng._kernel._cu_launch)
        eng._record = timed("record", eng._record)
        eng._ends = timed("ends", eng._ends)
    steps_log = open(os.path.join(os.environ.get("OUT", "."), f"bare_steps_{os.environ.get('DIRECTION', 'h2d')}.jsonl"), "a")
    fd = os.memfd_create("floor")
    os.ftruncate(fd, SIZE)
    host, dev = eng.map_host(fd, SIZE), eng.alloc_device(SIZE, 0)
    lanes = {b"h": (LaneKey(0, Direction.H2D), dev, host), b"d": (LaneKey(0, Direction.D2H), host, dev)}

    if BACKEND != "sim":
        kern = eng._kernel
        ends = {k: eng._ends(lane, dst, src) for k, (lane, dst, src) in lanes.items()}
        pointers = {}
        for k, (dev_, info, s_host, d_host) in ends.items():
            _, dst_m, src_m = lanes[k]
            sp = s_host.device_pointer if s_host is not None else src_m.pointer
            dp = d_host.device_pointer if d_host is not None else dst_m.pointer
            pointers[k] = (dev_, info, sp, dp)

    def minimal(op: bytes, d: bytes, raw: bytes) -> Any:
        """The launch with nothing around it: what any server must do to start the copy."""
        dev_, info, sp, dp = pointers[d]
        if op == b"C":
            kern.launch(dev_, dp, sp, BLOCKS * BLOCK, info.express_cu)
        else:
            kern._table[0] = sp
            kern._table[1] = dp
            kern._table_rows[:BLOCKS] = np.frombuffer(raw, dtype=ROW)
            check(kern._cu_launch(dev_.table_function, 1, BLOCKS, 1, 1024, 1, 1, 0, info.express_cu, kern._tparams, 0))
        return eng._record(dev_, info, info.express)

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport
            self.buf = b""
            self.loop = asyncio.get_running_loop()

        def data_received(self, data: bytes) -> None:
            if not self.buf:
                self.t_in = time.perf_counter()
            self.buf += data
            if len(self.buf) < HEADER.size:
                return
            op, d, n = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + n:
                return
            raw, self.buf = self.buf[HEADER.size : HEADER.size + n], b""
            lane, dst, src = lanes[d]
            t_go = time.perf_counter()
            if op in b"CB" and BACKEND != "sim":
                comp = minimal(op, d, raw)
            elif op in b"cC":
                comp = eng.submit(lane, Path.EXPRESS, dst, 0, src, 0, BLOCKS * BLOCK, strict=True)
            else:
                comp = eng.submit_segments(lane, Path.EXPRESS, dst, src, np.frombuffer(raw, dtype=ROW), strict=True)
            self.loop.call_soon(self.poll, comp, (self.t_in, t_go, time.perf_counter()))

        def poll(self, comp: Any, stamps: tuple[float, float, float]) -> None:
            if comp.done():
                comp.release()
                self.t.write(b"k" + STAMPS.pack(*stamps, time.perf_counter()))  # type: ignore[attr-defined]
                if timings:
                    steps_log.write(json.dumps(timings) + "\n")
                    steps_log.flush()
                    timings.clear()
            else:
                self.loop.call_soon(self.poll, comp, stamps)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Conn, path)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


class BareClient:
    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(path)

    def ask(self, op: bytes, direction: bytes, raw: bytes) -> tuple[float, ...]:
        self.s.sendall(HEADER.pack(op, direction, len(raw)) + raw)
        self.s.setblocking(False)
        until = time.perf_counter() + 0.002
        got = b""
        while time.perf_counter() < until:
            try:
                got = self.s.recv(64)
                break
            except BlockingIOError:
                pass
        self.s.setblocking(True)
        if not got:
            got = self.s.recv(64)
        while len(got) < 1 + STAMPS.size:
            got += self.s.recv(64)
        assert got[:1] == b"k", got
        return STAMPS.unpack(got[1:])


def pct(v: list[float], q: float) -> float:
    return float(np.percentile(np.array(v), q))


def main() -> None:
    import priod
    from priod.testing import daemon_process

    direction = os.environ.get("DIRECTION", "h2d")
    count = int(os.environ.get("COUNT", "200"))
    out = os.environ.get("OUT", "out/floor_probe")
    os.makedirs(out, exist_ok=True)
    segs = table()
    raw = segs.astype("<u8").tobytes()
    d = direction[0].encode()
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "bare.sock")
    bare = subprocess.Popen([sys.executable, __file__, "serve", path], stdout=subprocess.PIPE, text=True)
    try:
        assert bare.stdout is not None and bare.stdout.readline().strip() == "ready"
        env = {"PRIOD_LOG__LEVEL": '"warning"'}
        with (
            daemon_process(env, backend=BACKEND, start_timeout=180) as dm,
            daemon_process({**env, "PRIOD_SCHEDULER__EXPLORE_EVERY": "1000000000"}, backend=BACKEND, start_timeout=180) as dn,
            priod.SyncClient(dm.socket_path, name="floor", spin_us=2000) as c,
            priod.SyncClient(dn.socket_path, name="floor", spin_us=2000) as cn,
        ):
            clients = {"priod": c, "nolook": cn}
            ends = {}
            for who, cl in clients.items():
                h, g = cl.alloc_host(SIZE), cl.alloc_device(SIZE)
                ends[who] = (g, h) if direction == "h2d" else (h, g)
            bc = BareClient(path)
            names = [f"{who} {form}" for who in ("bare", "bare-min", "priod", "nolook") for form in ("contiguous", "batch")]
            lat: dict[str, list[float]] = {k: [] for k in names}
            paths: dict[str, list[str]] = {k: [] for k in names if k.startswith(("priod", "nolook"))}
            daemon_total: dict[str, list[float]] = {k: [] for k in paths}
            steps: dict[str, list[list[float]]] = {k: [] for k in names if k.startswith("bare")}
            for i in range(10 + count):
                order = list(lat) if i % 2 == 0 else list(reversed(lat))
                for name in order:
                    t0 = time.perf_counter()
                    r = None
                    stamps: tuple[float, ...] = ()
                    who, form = name.split()
                    if who in ("bare", "bare-min"):
                        op = {"bare": b"c", "bare-min": b"C"}[who] if form == "contiguous" else {"bare": b"b", "bare-min": b"B"}[who]
                        stamps = bc.ask(op, d, b"" if form == "contiguous" else raw)
                    else:
                        cl, (dst, src) = clients[who], ends[who]
                        if form == "contiguous":
                            r = cl.copy(dst, src, BLOCKS * BLOCK, priority="urgent", timeout=30)
                        else:
                            r = cl.copy_batch(dst, src, segs, priority="urgent", timeout=30)
                    t1 = time.perf_counter()
                    took = (t1 - t0) * 1e6
                    if i >= 10:
                        lat[name].append(took)
                        if stamps:  # to the server, reading, launching, to seen done, to the client
                            marks = (t0, *stamps, t1)
                            steps[name].append([(b - a) * 1e6 for a, b in zip(marks, marks[1:])])
                        if r is not None:
                            paths[name].append(r.path)
                            daemon_total[name].append(r.total_us)
                    time.sleep(0.005)
    finally:
        bare.terminate()
        bare.wait(10)
    res = {
        "direction": direction,
        "count": count,
        "latency_us": lat,
        "priod_paths": paths,
        "priod_daemon_total_us": daemon_total,
        "bare_steps_us": steps,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    with open(os.path.join(out, f"floor_probe2_{direction}.json"), "w") as f:
        json.dump(res, f)
    looks = {k: {p: v.count(p) for p in sorted(set(v))} for k, v in paths.items()}
    print(f"\n{direction}, 256 x 64 KiB, nothing computing, no bulk, {count} each, us; paths taken {looks}")
    print(f"{'row':<20} {'p50':>7} {'p90':>7} {'p99':>7}")
    for k, v in lat.items():
        print(f"{k:<20} {pct(v, 50):7.0f} {pct(v, 90):7.0f} {pct(v, 99):7.0f}")
    for who in ("bare", "bare-min", "priod", "nolook"):
        b, cc = lat[f"{who} batch"], lat[f"{who} contiguous"]
        print(f"{who:>8}: batch over contiguous  p50 {pct(b, 50) - pct(cc, 50):+6.0f}  p99 {pct(b, 99) - pct(cc, 99):+6.0f}")
    print("bare server's steps, p50 us: send->read, read->launch, launch, launched->seen done, done->client")
    for k, v in steps.items():
        print(f"  {k:<20}", " ".join(f"{x:7.0f}" for x in np.median(np.array(v), axis=0)))
    for k, v in daemon_total.items():
        print(f"{k} daemon total_us p50 {pct(v, 50):.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        main()
