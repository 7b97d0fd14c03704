"""Daemon-side timestamps for round_trip_probe.py (PROBE_TIMES=<file>, `priod serve` only): for
every copy of a session, when its frame's socket turned readable, when it was taken (arrival),
its first chunk submitted, its last seen done, copy_finished called, and its reply sent; all
time.perf_counter(), CLOCK_MONOTONIC, the same clock as the client's."""
import os, sys
if os.environ.get("PROBE_TIMES") and "serve" in sys.argv:
    import atexit, json, time
    import priod.copies as _copies
    import priod.session as _session
    import priod.transport as _transport
    _pc = time.perf_counter
    _last = [0.0]
    _taken = {}
    _recs = []
    _orig_readable = _transport.FramedSocket._on_readable
    def _on_readable(self):
        _last[0] = _pc()
        return _orig_readable(self)
    _transport.FramedSocket._on_readable = _on_readable
    for _name in ("take_copy", "take_batch"):
        _orig = getattr(_copies, _name)
        def _wrap(session, req_id, req, _orig=_orig, _batch=_name == "take_batch"):
            _taken[(session.id, req_id)] = (_last[0], _batch)
            return _orig(session, req_id, req)
        setattr(_copies, _name, _wrap)
        setattr(_session, _name, _wrap)
    _orig_finished = _session.Session.copy_finished
    def _copy_finished(self, f, p):
        t = _pc()
        _orig_finished(self, f, p)
        sent = _pc()
        req = f.request
        readable, batch = _taken.pop((self.id, p.client_id), (0.0, False))
        _recs.append({"conn": self.id, "nbytes": req.nbytes, "batch": batch, "readable": readable, "arrival": req.arrival,
                      "first": req.first_submit, "last": req.last_done, "finished": t, "sent": sent, "path": str(req.path)})
    _session.Session.copy_finished = _copy_finished
    def _dump():
        with open(os.environ["PROBE_TIMES"], "w") as fp:
            json.dump(_recs, fp)
    atexit.register(_dump)
