"""Probe (session 11): how soon after a client announces a direct copy (`HoldPage.begin`) does
the daemon close its lane's gate, and after its `end` open it again?

Put this folder first on PYTHONPATH with REACT_OUT set: in the daemon (``priod serve``) it
records each change of the closed gates and the gap between successive hold scans; in a
client it records every begin and end. Timestamps are perf_counter (CLOCK_MONOTONIC), one clock
for every process of the host. Each process writes ``react.<pid>.json`` to REACT_OUT at exit.
"""

import atexit
import json
import os
import sys
import time

_OUT = os.environ.get("REACT_OUT")
if _OUT:
    _rec: dict = {"pid": os.getpid(), "argv": sys.argv[:3], "events": [], "begins": [], "ends": [], "scan_gaps": {}}

    def _dump() -> None:
        if _rec["events"] or _rec["begins"]:
            with open(os.path.join(str(_OUT), f"react.{os.getpid()}.json"), "w") as f:
                json.dump(_rec, f)

    atexit.register(_dump)
    if "serve" in sys.argv:
        import priod.pump as _pump

        _scan = _pump.Pump.scan_holds
        _last = [0.0]

        def scan_holds(self: _pump.Pump) -> None:
            t = time.perf_counter()
            gap, _last[0] = t - _last[0], t
            if gap < 0.002:
                key = str(int(gap * 1e6) // 5 * 5)
                _rec["scan_gaps"][key] = _rec["scan_gaps"].get(key, 0) + 1
            before = self._gates_closed
            _scan(self)
            if self._gates_closed != before:
                _rec["events"].append((t, "close" if self._gates_closed else "open"))

        _pump.Pump.scan_holds = scan_holds  # type: ignore[method-assign]
    else:
        import priod.direct as _direct

        _begin, _end = _direct.HoldPage.begin, _direct.HoldPage.end

        def begin(self: _direct.HoldPage, slot: int) -> None:
            _rec["begins"].append(time.perf_counter())
            _begin(self, slot)

        def end(self: _direct.HoldPage, slot: int) -> None:
            _end(self, slot)
            _rec["ends"].append(time.perf_counter())

        _direct.HoldPage.begin, _direct.HoldPage.end = begin, end  # type: ignore[method-assign]
