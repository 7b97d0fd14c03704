#!/bin/bash
# Session 13: h2d direct rows beside their anchors, with and without the GEMM co-tenant, for
# beat_block_us 0 (off), 600 and 1000, in one command (about 3 minutes).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for b in ${BEATS:-0 600 1000}; do
  timeout 170 python3 scripts/bench_gpu.py --sets ${SETS:-h2d} --rows direct --count 100 --bulk-poll timer --set scheduler__beat_block_us=$b --out $OUT/beat$b > $OUT/beat$b.txt 2>&1
  echo "== beat_block_us=$b"; grep -v '^\[' $OUT/beat$b.txt | grep -E "direct |anchor |phase" | cut -c1-200
done
