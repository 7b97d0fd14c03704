#!/bin/bash
# Session 13's final tree: the GPU suite, then issue 12's batch command twice (about 2.5 minutes).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider > $OUT/gpu_suite.txt 2>&1
for i in 1 2; do
  timeout 60 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out /tmp/batch$i > $OUT/batch$i.txt 2>&1
done
echo "== gpu suite"; tail -3 $OUT/gpu_suite.txt
for i in 1 2; do echo "== batch $i"; grep -E "under (priod )?bulk|target|priod bulk copy_batch" $OUT/batch$i.txt | cut -c1-100; done
