"""Urgent 64 KiB copies through the daemon while another client streams bulk batches of 64 KiB
blocks, with the pusher's bulk calls of 64 segments (as shipped) or of 208 (PROBE_BULK_CALL, in
sitecustomize.py beside this file): does a longer driver call on the pusher's thread delay the
loop's urgent submissions? pusher_probe.py's measurement, other variants."""
import os, sys, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pusher_probe

if __name__ == "__main__":
    out = {}
    for name, calls in (("calls of 64", None), ("calls of 208", "208"), ("calls of 64 again", None), ("calls of 208 again", "208")):
        os.environ.pop("PROBE_BULK_CALL", None)
        if calls:
            os.environ["PROBE_BULK_CALL"] = calls
        out[name] = pusher_probe.run(False)
        print(name, json.dumps(out[name]), flush=True)
