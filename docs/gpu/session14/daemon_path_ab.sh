#!/bin/bash
# Session 14: A/B in one command, the daemon's batch path before (4209cdd, in .probe/base14:
# git archive 4209cdd priod scripts docs/gpu/session14/dprobe docs/gpu/session14/dprobe.sh) and after
# the numpy calls were cut; dprobe.sh each, old first.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
for v in old new; do
  mkdir -p $OUT/$v
  if [ $v = old ]; then cd $ROOT/.probe/base14; else cd $ROOT; fi
  OUT=$OUT/$v bash docs/gpu/session14/dprobe.sh > /dev/null 2>&1
  echo "== $v"; grep -E "daemon_queued|latency_us|take_batch|decode|check_regions|launch_table|submit_segments:express" $OUT/$v/dprobe_summary.txt
done
