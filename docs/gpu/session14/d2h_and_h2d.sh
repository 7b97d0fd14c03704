#!/bin/bash
# Session 14: issue 12's batch command device to host (the batch's table checked by the kernel
# as for h2d), then once more host to device.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for dir in d2h h2d; do
  timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --direction $dir --out /tmp/b_$dir > $OUT/batch_$dir.txt 2>&1
  echo "== $dir"; grep -E "^direct under|^priod under|^target|priod bulk copy_batch|^raw" $OUT/batch_$dir.txt
done
