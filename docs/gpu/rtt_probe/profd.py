"""Run priod serve under cProfile with a CPU-time timer; write the stats to argv[1]."""
import cProfile
import sys
import time
out = sys.argv[1]; sys.argv = ["priod", *sys.argv[2:]]
from priod.cli import main
pr = cProfile.Profile(time.process_time)
try:
    pr.runcall(main)
except SystemExit:
    pass
finally:
    pr.dump_stats(out)
