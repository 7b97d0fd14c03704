"""For batch_bulk_probe.py runs: the daemon (`priod serve` only) with the interpreter's GIL
switch interval set to SWITCH_S seconds (Python's default is 0.005)."""
import os, sys
if os.environ.get("SWITCH_S") and "serve" in sys.argv:
    sys.setswitchinterval(float(os.environ["SWITCH_S"]))
