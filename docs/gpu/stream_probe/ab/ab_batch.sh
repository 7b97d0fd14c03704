#!/bin/bash
# A/B on the H200: batch bulk (and urgent batch rows) at 11294e3 (.probe/base11) against this tree, two rounds interleaved.
set -u
ROOT=$PWD
for r in 1 2; do
  for v in old new; do
    out=$OUT/bb_${v}_$r
    if [ $v = old ]; then
      (cd .probe/base11 && PYTHONPATH=/tmp/site:$ROOT/.probe/base11 python3 scripts/bench_gpu_batch.py --count 60 --bulk-s 3 --out $out > $out.log 2>&1)
    else
      PYTHONPATH=/tmp/site:$ROOT python3 scripts/bench_gpu_batch.py --count 60 --bulk-s 3 --out $out > $out.log 2>&1
    fi
    echo "== $v $r: $(grep -E 'priod bulk copy_batch|under bulk: c' $out.log | awk '{printf "%s ", $0}')"
  done
done
