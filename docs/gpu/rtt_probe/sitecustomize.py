"""Probe, loaded into the daemon through PYTHONPATH: perf_counter stamps at each step of a copy."""
import atexit
import json
import os
import time
if os.environ.get("PRIOD_PROBE_OUT"):
    STAMPS = []
    pc = time.perf_counter
    def wrap(cls, name, tag, after=False):
        orig = getattr(cls, name)
        def w(*a, **k):
            if not after:
                STAMPS.append((tag, pc()))
            r = orig(*a, **k)
            if after:
                STAMPS.append((tag, pc()))
            return r
        setattr(cls, name, w)
    import priod.transport as T
    import priod.session as S
    import priod.pump as P
    wrap(T.FramedSocket, "_on_readable", "read")
    wrap(S, "take_copy", "arrival")  # the session calls copies.take_copy through its own module name
    wrap(P.Pump, "_submit", "submitted", after=True)
    wrap(S.Session, "copy_finished", "finish")
    orig_send = T.FramedSocket.send
    def send(self, msg, fds=()):
        r = orig_send(self, msg, fds); STAMPS.append(("sent", pc())); return r
    T.FramedSocket.send = send
    @atexit.register
    def dump():
        with open(os.environ["PRIOD_PROBE_OUT"], "w") as fp:
            json.dump(STAMPS, fp)
