# Probe: where a daemon's urgent batch spends its CPU (timed wrappers, dumped at exit).
import atexit, json, os, sys, time
_out = os.environ.get("DPROBE_OUT")
if _out and "serve" in sys.argv:
    import statistics
    from priod import copies, session
    from priod.engines.cuda import engine as ce, express as ex
    rec = {}
    last = {}
    def timed(name, fn, extra=None):
        def w(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter_ns()
                key = name if extra is None else f"{name}:{extra(*a, **k)}"
                rec.setdefault(key, []).append((t1 - t0) / 1e3)
                last[name] = t1
        return w
    session.take_batch = timed("take_batch", copies.take_batch, lambda s, i, r: len(r.segments) // 24)
    from priod import batch as pb
    pb.Segments.decode = classmethod(timed("decode", pb.Segments.decode.__func__, lambda cls, raw: len(raw) // 24))
    pb.Segments.check_regions = timed("check_regions", pb.Segments.check_regions, lambda self, *a: len(self.size))
    pb.Segments.piece = timed("piece", pb.Segments.piece)
    pb.Segments.cut = timed("cut", pb.Segments.cut)
    import numpy as np
    ce.np = type("np_probe", (), {"__getattr__": lambda self, k: getattr(np, k)})()
    _stack = np.stack
    ce.np.stack = timed("np.stack", _stack)
    session.take_copy = timed("take_copy", copies.take_copy, lambda s, i, r: r.priority)
    ce.CudaEngine.submit_segments = timed("submit_segments", ce.CudaEngine.submit_segments, lambda self, lane, path, *a, **k: f"{path.value}:{len(a[-1])}:{'strict' if k.get('strict') else 'bulk'}")
    ce.CudaEngine.submit = timed("submit", ce.CudaEngine.submit, lambda self, lane, path, *a, **k: f"{path.value}:{'strict' if k.get('strict') else 'bulk'}")
    ex.ExpressKernel.launch_table = timed("launch_table", ex.ExpressKernel.launch_table)
    def dump():
        s = {k: {"n": len(v), "p50": statistics.median(v), "p90": sorted(v)[int(0.9 * (len(v) - 1))]} for k, v in rec.items()}
        with open(os.path.join(_out, f"dprobe_{os.getpid()}.json"), "w") as f:
            json.dump(s, f, indent=1)
    atexit.register(dump)
