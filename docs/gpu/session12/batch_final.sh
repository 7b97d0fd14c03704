#!/bin/bash
# Session 12: issue 12's H200 rows on this tree, the standard command, twice.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for r in 1 2; do
  python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out $OUT/b$r > $OUT/bench_gpu_batch_$r.txt 2>&1
  echo "== run $r"; sed -n '/^256 scattered/,$p' $OUT/bench_gpu_batch_$r.txt
done
