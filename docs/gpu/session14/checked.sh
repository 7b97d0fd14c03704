#!/bin/bash
# Session 14: the copy kernel checks a direct batch's table. Build the PTX (nvcc there), run the
# direct and batch GPU tests on it, the probe (new copy_batch against the old path, interleaved),
# (run 2, checked2: after the launch path lost its sum and its import; the PTX as committed)
# then issue 12's batch command twice.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
[ "${BUILD:-1}" = 1 ] && { bash scripts/build_ptx.sh --check > $OUT/build_ptx.txt 2>&1 || { cat $OUT/build_ptx.txt; exit 1; }; }
[ "${BUILD:-1}" = 1 ] && cp priod/engines/cuda/express.ptx $OUT/express.ptx
[ "${BUILD:-1}" = 1 ] && grep -E "registers|spill|wrote" $OUT/build_ptx.txt
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_direct.py tests/test_gpu_batch.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -3 $OUT/pytest_gpu.txt
python3 docs/gpu/session14/lean_batch_probe.py > $OUT/probe.txt 2>&1; tail -6 $OUT/probe.txt
for r in 1 2; do
  timeout 150 python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --out /tmp/b$r > $OUT/batch$r.txt 2>&1
  grep -E "^direct|^in-process|^priod (idle|under)|^target" $OUT/batch$r.txt
done
