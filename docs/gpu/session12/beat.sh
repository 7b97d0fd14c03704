#!/bin/bash
# Session 12: bulk chunks that grow between the bursts of a steady urgent beat, in the daemon.
# Issue 10's direct rows, h2d, no co-tenant: beat_block_us=0 (as shipped) then 600, one command.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for b in 0 600; do
  timeout 80 python3 scripts/bench_gpu.py --sets h2d --rows direct --cotenant none --count 100 --bulk-poll timer --set scheduler__beat_block_us=$b --out $OUT/beat$b > $OUT/beat$b.txt 2>&1
  echo "== beat_block_us=$b"; grep -E "direct|bulk|anchor" $OUT/beat$b.txt | grep -v "^\[" | head -20
done
