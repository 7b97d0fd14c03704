#!/bin/bash
# Session 14: the GPU suite on the final tree, then issue 12's batch command once more.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 400 python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -3 $OUT/pytest_gpu.txt
timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out /tmp/bf > $OUT/batch.txt 2>&1
grep -E "^direct under|^priod under|^target|priod bulk copy_batch" $OUT/batch.txt
