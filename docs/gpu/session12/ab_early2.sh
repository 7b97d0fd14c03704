#!/bin/bash
# Session 12 A/B #2 on the H200: early hold (this tree) against 0d5203e (.probe/base12), six rounds,
# the order of the two trees alternating round by round, 200 copies a row.
# .probe/base12 holds the old tree: mkdir -p .probe/base12 && git archive 0d5203e priod scripts pyproject.toml | tar -x -C .probe/base12
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
ROOT=$PWD
for r in 1 2 3 4 5 6; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do
    out=$OUT/ab_${v}_$r
    if [ $v = old ]; then
      (cd .probe/base12 && PYTHONPATH=/tmp/site:$ROOT/.probe/base12 timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 200 --bulk-s 1 --skip-inprocess --out $out > $out.log 2>&1)
    else
      PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 200 --bulk-s 1 --skip-inprocess --out $out > $out.log 2>&1
    fi
    echo "== $v $r"; grep -E "^direct" $out.log | head -6
  done
done
