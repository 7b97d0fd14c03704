# Lab probe (session 14): where a daemon's urgent batch spends its time, by timed wrappers around
# the steps of its path, dumped at exit. Put this folder first on PYTHONPATH, set DPROBE_OUT.
# Based on session 9's (docs/gpu/batch_probe/session9/dprobe.sh), for the current names.
import atexit
import json
import os
import sys
import time

_out = os.environ.get("DPROBE_OUT")
if _out and "serve" in sys.argv:
    import statistics

    from priod import batch as pb
    from priod import copies, session
    from priod.engines.cuda import engine as ce
    from priod.engines.cuda import express as ex

    rec: dict = {}

    def timed(name, fn, extra=None):
        def w(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter_ns()
                key = name if extra is None else f"{name}:{extra(*a, **k)}"
                rec.setdefault(key, []).append((t1 - t0) / 1e3)

        return w

    session.take_batch = timed("take_batch", copies.take_batch, lambda s, i, r: len(r.segments) // 24)
    session.take_copy = timed("take_copy", copies.take_copy, lambda s, i, r: r.priority)
    pb.Segments.decode = classmethod(timed("decode", pb.Segments.decode.__func__, lambda cls, raw: len(raw) // 24))
    pb.Segments.check_regions = timed("check_regions", pb.Segments.check_regions, lambda self, *a: len(self.size))
    pb.Segments.segments_done = timed("segments_done", pb.Segments.segments_done)
    ce.CudaEngine.submit_segments = timed(
        "submit_segments", ce.CudaEngine.submit_segments, lambda self, lane, path, *a, **k: f"{path.value}:{len(a[-1])}:{'strict' if k.get('strict') else 'bulk'}"
    )
    ce.CudaEngine.submit = timed("submit", ce.CudaEngine.submit, lambda self, lane, path, *a, **k: f"{path.value}:{'strict' if k.get('strict') else 'bulk'}")
    ex.ExpressKernel.launch_table = timed("launch_table", ex.ExpressKernel.launch_table)
    session.Session.copy_finished = timed("copy_finished", session.Session.copy_finished, lambda self, f, p: "batch" if p.segments is not None else "copy")

    def dump():
        s = {k: {"n": len(v), "p50": statistics.median(v), "p90": sorted(v)[int(0.9 * (len(v) - 1))]} for k, v in rec.items()}
        with open(os.path.join(_out, f"dprobe_{os.getpid()}.json"), "w") as f:
            json.dump(s, f, indent=1)

    atexit.register(dump)
