#!/bin/bash
# A/B on the H200: a direct batch's copy-kernel launches on the urgent stream and a side stream
# (shipped) against one after the other (PROBE_NO_SIDE); bench_gpu_batch.py --direct, two rounds.
# (Run at 18:01 UTC with the launch of that time; PROBE_NO_SIDE now patches the current one.)
set -u
ROOT=$PWD
for r in 1 2; do
  for v in side noside; do
    out=$OUT/${v}_$r
    case $v in side) e="";; noside) e="PROBE_NO_SIDE=1";; esac
    env $e PYTHONPATH=/tmp/site:$ROOT/docs/gpu/batch_probe:$ROOT python3 scripts/bench_gpu_batch.py --direct --count 60 --bulk-s 1 --out $out > $out.log 2>&1
    echo "== $v $r: $(grep -E '^direct' $out.log | awk '{printf "%s | ", $0}')"
    rm -f $out/*.png
  done
done
