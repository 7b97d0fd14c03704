import os
if os.environ.get("PROBE_SEGCOST"):
    import priod.batch
    priod.batch.SEGMENT_COST_S = float(os.environ["PROBE_SEGCOST"])
if os.environ.get("PROBE_PROFILE"):
    import atexit, cProfile, pstats, sys
    if "serve" in sys.argv:
        _prof = cProfile.Profile()
        _prof.enable()
        def _dump() -> None:
            _prof.disable()
            with open(os.environ["PROBE_PROFILE"], "w") as f:
                st = pstats.Stats(_prof, stream=f)
                st.sort_stats("tottime").print_stats(45)
                st.sort_stats("cumulative").print_stats(45)
        atexit.register(_dump)
if os.environ.get("PROBE_NO_PUSHER"):
    # the bulk batch chunk enqueued inline on the loop, as before the pusher
    import priod.engines.cuda.engine as _eng
    def _inline(self, dev, info, dp, sp, d, s, z, stream):
        self._bulk_batched.copy(dp, sp, d, s, z, info.kind, stream)
        return self._record(dev, info, stream)
    _eng.CudaEngine._push_batch = _inline
if os.environ.get("PROBE_PUSHER_TIMES"):
    # (pushed, started, ended) of every pusher job, dumped at exit
    import atexit, json, time as _t
    import priod.engines.cuda.pusher as _pm
    _times = []
    _orig_push = _pm.Pusher.push
    def _push(self, job):
        t0 = _t.perf_counter()
        rec = [t0, 0.0, 0.0]
        _times.append(rec)
        def timed():
            rec[1] = _t.perf_counter()
            try:
                job()
            finally:
                rec[2] = _t.perf_counter()
        return _orig_push(self, timed)
    _pm.Pusher.push = _push
    def _dump():
        if "serve" in sys.argv:
            with open(os.environ["PROBE_PUSHER_TIMES"], "w") as f:
                json.dump(_times, f)
    import sys
    atexit.register(_dump)
