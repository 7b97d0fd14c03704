#!/bin/bash
# A/B on the H200: the pusher's bulk batched calls of 64 segments (shipped) against 208 (docs/gpu/batch_probe/sitecustomize.py, PROBE_BULK_CALL), two rounds interleaved.
set -u
for r in 1 2; do
  for v in 64 208; do
    out=$OUT/call_${v}_$r
    if [ $v = 208 ]; then export PROBE_BULK_CALL=208; else unset PROBE_BULK_CALL; fi
    PYTHONPATH=/tmp/site:$PWD/docs/gpu/batch_probe:$PWD python3 scripts/bench_gpu_batch.py --count 60 --bulk-s 3 --out $out > $out.log 2>&1
    echo "== calls of $v, round $r: $(grep -E 'priod bulk copy_batch|under bulk: c|idle: c' $out.log | awk '{printf "%s | ", $0}')"
  done
done
