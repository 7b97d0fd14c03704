#!/bin/bash
# A/B on the H200: the daemon's batched calls as shipped (ctypes releases the GIL around each
# call, then waits for it back), keeping the GIL (PROBE_HOLD_GIL), and a 100-us switch interval
# (PROBE_SWITCH); bench_gpu_batch.py without the direct rows, two rounds interleaved.
set -u
ROOT=$PWD
for r in 1 2; do
  for v in shipped holdgil switch100; do
    out=$OUT/gil_${v}_$r
    case $v in
      shipped) e="";;
      holdgil) e="PROBE_HOLD_GIL=1";;
      switch100) e="PROBE_SWITCH=0.0001";;
    esac
    env $e PYTHONPATH=/tmp/site:$ROOT/docs/gpu/batch_probe:$ROOT python3 scripts/bench_gpu_batch.py --count 60 --bulk-s 3 --out $out > $out.log 2>&1
    echo "== $v $r: $(grep -E 'priod bulk copy_batch|under bulk: c|priod idle: c' $out.log | awk '{printf "%s | ", $0}')"
  done
done
