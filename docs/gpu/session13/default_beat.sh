#!/bin/bash
# Session 13: beat_block_us = 600 as the default. Issue 10's standard command (direct rows, h2d
# and d2h, with and without the GEMM co-tenant, beside the anchors), the growth run, then the GPU
# suite, in one command (about 5 minutes).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 220 python3 scripts/bench_gpu.py --sets h2d,d2h --rows direct --count 100 --bulk-poll timer --out /tmp/std > $OUT/std.txt 2>&1
cp /tmp/std/results.json $OUT/std_results.json 2>/dev/null
timeout 100 python3 scripts/bench_growth.py --backend cuda --direct --out /tmp/growth > $OUT/growth.txt 2>&1
timeout 200 python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider > $OUT/gpu_suite.txt 2>&1
echo "== growth"; tail -8 $OUT/growth.txt | cut -c1-160
echo "== gpu suite"; tail -3 $OUT/gpu_suite.txt
echo "== standard"; grep -v '^\[' $OUT/std.txt | grep -E "direct |anchor |phase" | cut -c1-200
