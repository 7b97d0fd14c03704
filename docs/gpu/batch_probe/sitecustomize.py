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
if os.environ.get("PROBE_SWITCH"):
    import sys as _sys
    if "serve" in _sys.argv:
        _sys.setswitchinterval(float(os.environ["PROBE_SWITCH"]))
if os.environ.get("PROBE_BULK_CALL"):
    # segments per batched call for bulk chunks (the pusher's BatchedDma)
    import priod.engines.cuda.engine as _eng2
    _orig_init = _eng2.CudaEngine.__init__
    def _init(self, *a, **k):
        _orig_init(self, *a, **k)
        if getattr(self, "_bulk_batched", None) is not None:
            self._bulk_batched.call_segments = int(os.environ["PROBE_BULK_CALL"])
    _eng2.CudaEngine.__init__ = _init
if os.environ.get("PROBE_POLL_LOG"):
    # (time, found a completion, chunks in flight) of every poll, dumped at exit
    import atexit as _ax, json as _js, sys as _sy, time as _tm
    import priod.pump as _pp
    _polls = []
    _orig_poll = _pp.Pump._poll_once
    def _poll_once(self):
        n = len(self._inflight)
        r = _orig_poll(self)
        _polls.append((_tm.perf_counter(), bool(r), n))
        return r
    _pp.Pump._poll_once = _poll_once
    def _dump_polls():
        if "serve" in _sy.argv:
            with open(os.environ["PROBE_POLL_LOG"], "w") as f:
                import threading as _thr
                _js.dump({"pump": _pp.__file__, "polls": _polls, "threads": {t.native_id: t.name for t in _thr.enumerate()}}, f)
    _ax.register(_dump_polls)
if os.environ.get("PROBE_POLL_FORMULA") == "later":
    # a lane's bulk chunks polled when the work behind the oldest, counted from when the oldest
    # should end (not from now), is the margin from running out
    import math as _m
    import priod.pump as _pp2
    def _later(inflight, bandwidth, now):
        soonest = _m.inf; oldest = {}; queued = {}
        for entry in inflight:
            chunk = entry.chunk; lane = chunk.request.lane
            if chunk.path is not _pp2.Path.DMA or chunk.offset + chunk.nbytes == chunk.request.nbytes:
                soonest = min(soonest, entry.due)
            if chunk.path is _pp2.Path.DMA:
                if lane in oldest: queued[lane] += chunk.nbytes / bandwidth.get(lane, 1e9)
                else: oldest[lane], queued[lane] = entry.due, 0.0
        for lane, due in oldest.items():
            soonest = min(soonest, max(due, max(due, now) + queued[lane] - _pp2.BULK_POLL_MARGIN_S))
        return soonest
    _pp2.next_poll_at = _later
if os.environ.get("PROBE_BATCH_TIMELINE"):
    # GPU-side start and end of every chunk the pusher enqueues (timing events around its
    # batched calls), with the host times of the calls; dumped at exit
    import atexit as _ax3, json as _js3, sys as _sy3, threading as _th3, time as _tm3
    import priod.engines.cuda.batched as _bm
    from priod.engines.cuda._driver import bindings as _bd3, check as _ck3
    _orig_copy = _bm.BatchedDma.copy
    _pending3, _out3, _ref3 = [], [], []
    def _copy(self, dst, src, d, s, z, kind, stream):
        if _th3.current_thread().name != "priod-cuda-pusher":
            return _orig_copy(self, dst, src, d, s, z, kind, stream)
        rt, _ = _bd3()
        e0 = _ck3(rt.cudaEventCreate()); e1 = _ck3(rt.cudaEventCreate())
        _ck3(rt.cudaEventRecord(e0, stream)); t0 = _tm3.perf_counter()
        _orig_copy(self, dst, src, d, s, z, kind, stream)
        t1 = _tm3.perf_counter(); _ck3(rt.cudaEventRecord(e1, stream))
        _pending3.append((e0, e1, t0, t1, int(z.sum()), len(z)))
        ok = rt.cudaError_t.cudaSuccess
        while len(_pending3) > 4 and rt.cudaEventQuery(_pending3[0][1])[0] == ok:
            a, b, ta, tb, nb, ns = _pending3.pop(0)
            if not _ref3:
                _ref3.append(a)
            st = _ck3(rt.cudaEventElapsedTime(_ref3[0], a)); en = _ck3(rt.cudaEventElapsedTime(_ref3[0], b))
            _out3.append((float(st), float(en), ta, tb, nb, ns))
    _bm.BatchedDma.copy = _copy
    def _dump3():
        if "serve" in _sy3.argv:
            with open(os.environ["PROBE_BATCH_TIMELINE"], "w") as f:
                _js3.dump(_out3, f)
    _ax3.register(_dump3)
if os.environ.get("PROBE_FAULTHANDLER"):
    # every Python thread's stack on SIGUSR1
    import faulthandler as _fh, signal as _sg, sys as _sy5
    if "serve" in _sy5.argv:
        _fh_file = open(os.environ["PROBE_FAULTHANDLER"], "w")
        _fh.register(_sg.SIGUSR1, file=_fh_file, all_threads=True)
if os.environ.get("PROBE_EXECUTOR_LOG"):
    # who submits work to thread pools, counted by call site and function, dumped at exit
    import atexit as _ax6, collections as _co6, concurrent.futures.thread as _cft, json as _js6, sys as _sy6, traceback as _tb6
    _subs = _co6.Counter()
    _orig_submit = _cft.ThreadPoolExecutor.submit
    def _submit(self, fn, /, *args, **kwargs):
        frames = _tb6.extract_stack(limit=8)[:-1]
        _subs[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[::-1][:5]) + f" fn={getattr(fn, '__qualname__', fn)!r}"] += 1
        return _orig_submit(self, fn, *args, **kwargs)
    _cft.ThreadPoolExecutor.submit = _submit
    def _dump6():
        if "serve" in _sy6.argv:
            with open(os.environ["PROBE_EXECUTOR_LOG"], "w") as f:
                _js6.dump(_subs.most_common(20), f, indent=1)
    _ax6.register(_dump6)
if os.environ.get("PROBE_HOLD_GIL"):
    # the daemon's batched calls keep the GIL (ctypes.PYFUNCTYPE): no wait for it after each call
    import sys as _sys3
    if "serve" in _sys3.argv:
        import ctypes as _ct
        import priod.engines.cuda.batched as _bm
        _orig_bd_init = _bm.BatchedDma.__init__
        def _bd_init(self, *a, **k):
            _orig_bd_init(self, *a, **k)
            if self._batch is not None:
                address = _ct.cast(self._batch, _ct.c_void_p).value
                p, n = _ct.c_void_p, _ct.c_size_t
                self._batch = _ct.PYFUNCTYPE(_ct.c_int, p, p, p, n, p, p, n, p, p)(address)
        _bm.BatchedDma.__init__ = _bd_init
if os.environ.get("PROBE_NO_SIDE"):
    # a direct batch's copy-kernel launches one after the other on the urgent stream (no side stream)
    import priod.direct as _dr
    def _one_stream(self, dst, src, cells, stream):
        from typing import Any as _Any, cast as _cast
        with self._launching:
            self._express.launch_table(_cast(_Any, self), dst, src, cells, self._stream_type(int(stream)))
    _dr._BatchKernel.launch = _one_stream
