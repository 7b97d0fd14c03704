#!/bin/bash
# Session 12 (not yet run: the session's device time ran out): long bulk chunks between the
# bursts of a steady urgent beat, through the daemon. Issue 10's direct rows beside their
# anchors (in-process, "no daemon, bulk in another process"), h2d and d2h, with and without the
# GEMM co-tenant: beat_block_us=0 (as shipped) then 600, in one command (about 4 minutes).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for b in 0 600; do
  timeout 280 python3 scripts/bench_gpu.py --sets h2d,d2h --rows direct --count 100 --bulk-poll timer --set scheduler__beat_block_us=$b --out $OUT/beat$b > $OUT/beat$b.txt 2>&1
  echo "== beat_block_us=$b"; grep -v '^\[' $OUT/beat$b.txt | tail -40
done
