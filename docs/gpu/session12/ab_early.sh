#!/bin/bash
# Session 12 A/B on the H200: a direct batch announced before its table is checked (this tree)
# against HEAD 0d5203e (.probe/base12), interleaved; then the GPU batch/direct tests on this tree.
# .probe/base12 holds the old tree: mkdir -p .probe/base12 && git archive 0d5203e priod scripts pyproject.toml | tar -x -C .probe/base12
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
ROOT=$PWD
for r in 1 2 3 4; do
  for v in old new; do
    out=$OUT/ab_${v}_$r
    if [ $v = old ]; then
      (cd .probe/base12 && PYTHONPATH=/tmp/site:$ROOT/.probe/base12 timeout 120 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 2 --skip-inprocess --out $out > $out.log 2>&1)
    else
      PYTHONPATH=/tmp/site:$ROOT timeout 120 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 2 --skip-inprocess --out $out > $out.log 2>&1
    fi
    echo "== $v $r"; grep -E "under bulk|direct" $out.log | grep -v "^target" | head -8
  done
done > $OUT/ab_summary.txt
PYTHONPATH=/tmp/site:$ROOT timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_batch.py tests/test_gpu_direct.py 2>&1 | tail -3 > $OUT/pytest.txt
cat $OUT/ab_summary.txt; cat $OUT/pytest.txt
