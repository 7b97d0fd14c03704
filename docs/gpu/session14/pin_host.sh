#!/bin/bash
# Session 14: pin_host (a daemon host region used by this process's direct copies) and the
# example's --direct reload: the direct and torch GPU tests, then the example both ways.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_direct.py tests/test_gpu_torch.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -3 $OUT/pytest_gpu.txt
for flags in "" "--direct" "--register --direct" "--dtype float8_e4m3fn --direct"; do
  echo "== kv_offload.py --backend cuda $flags"
  timeout 120 python3 examples/kv_offload.py --backend cuda $flags 2>&1 | tail -4
done > $OUT/example.txt
cat $OUT/example.txt
