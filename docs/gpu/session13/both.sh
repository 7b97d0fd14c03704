#!/bin/bash
# Session 13: both directions loaded at once (bulk h2d and d2h, urgent copies each way), direct
# rows beside the anchors, with and without the GEMM co-tenant, at the default beat_block_us.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 scripts/bench_gpu.py --sets both --rows direct --count 100 --bulk-poll timer --out /tmp/both > $OUT/both.txt 2>&1
grep -v '^\[' $OUT/both.txt | grep -E "direct|anchor|phase|raw" | cut -c1-220
