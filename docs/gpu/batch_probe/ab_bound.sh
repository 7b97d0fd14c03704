#!/bin/bash
# A/B on the H200: the bulk batch's rate against the quiet in-flight bound (max_block_us) and the
# segments per batched call of bulk chunks (PROBE_BULK_CALL); bench_gpu_batch.py without the
# direct rows, two rounds interleaved. Prints the bulk rows of each run.
set -u
ROOT=$PWD
for r in 1 2; do
  for mb in 1000 2000 4000; do
    for calls in 64 256; do
      out=$OUT/bound_${mb}_calls${calls}_$r
      PROBE_BULK_CALL=$calls PYTHONPATH=/tmp/site:$ROOT/docs/gpu/batch_probe:$ROOT python3 scripts/bench_gpu_batch.py --count 30 --bulk-s 3 --set scheduler__max_block_us=$mb --out $out > $out.log 2>&1
      echo "== bound $mb us, calls of $calls, round $r: $(grep -E 'priod bulk copy_batch|priod under bulk: contiguous|priod bulk contiguous' $out.log | awk '{printf "%s | ", $0}')"
      rm -f $out/*.png
    done
  done
done
