#!/bin/bash
# Session 12: the copy kernel checks a direct batch's table itself. Build the PTX (nvcc there),
# run the GPU suite on it, then A/B against 17fcfe5 (.probe/base17: the early hold, host checks),
# three rounds, the order alternating.
# .probe/base17 holds the old tree: mkdir -p .probe/base17 && git archive 17fcfe5 priod scripts pyproject.toml | tar -x -C .probe/base17; the new tree is 17fcfe5 with kernel_check.patch applied
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
bash scripts/build_ptx.sh --check > $OUT/build_ptx.txt 2>&1 || { cat $OUT/build_ptx.txt; exit 1; }
cp priod/engines/cuda/express.ptx $OUT/express.ptx
grep -E "registers|spill|wrote" $OUT/build_ptx.txt
PYTHONPATH=/tmp/site:$ROOT timeout 240 python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -3 $OUT/pytest_gpu.txt
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do
    out=$OUT/ab_${v}_$r
    if [ $v = old ]; then
      (cd .probe/base17 && PYTHONPATH=/tmp/site:$ROOT/.probe/base17 timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 200 --bulk-s 1 --skip-inprocess --out $out > $out.log 2>&1)
    else
      PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 200 --bulk-s 1 --skip-inprocess --out $out > $out.log 2>&1
    fi
    echo "== $v $r"; grep -E "^direct" $out.log | head -6
  done
done > $OUT/ab.txt
cat $OUT/ab.txt
