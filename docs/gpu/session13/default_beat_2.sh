#!/bin/bash
# Session 13, run 5: the default beat again. KV-cache batches (issue 12's command) twice, then
# issue 10's standard command, in one command (about 3 minutes).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for i in 1 2; do
  timeout 90 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out /tmp/batch$i > $OUT/batch$i.txt 2>&1
done
timeout 220 python3 scripts/bench_gpu.py --sets h2d,d2h --rows direct --count 100 --bulk-poll timer --out /tmp/std > $OUT/std2.txt 2>&1
for i in 1 2; do echo "== batch $i"; grep -E "copy_batch|contiguous|target|x raw|blocks " $OUT/batch$i.txt | grep -v "^\[" | cut -c1-120; done
echo "== standard"; grep -v '^\[' $OUT/std2.txt | grep -E "direct|anchor |phase" | cut -c1-200
