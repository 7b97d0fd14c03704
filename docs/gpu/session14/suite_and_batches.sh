#!/bin/bash
# Session 14: the GPU suite on the tree with the kernel-checked direct batch, then issue 12's
# batch command three times.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -3 $OUT/pytest_gpu.txt
for r in 1 2 3; do
  timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out /tmp/b$r > $OUT/batch$r.txt 2>&1
  grep -E "^direct under|^priod under|^target|priod bulk copy_batch" $OUT/batch$r.txt
done
