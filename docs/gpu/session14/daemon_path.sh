#!/bin/bash
# Session 14: the daemon's batch path with fewer numpy calls (batch.py's decode and checks, the
# engine's bound check, the express table's rows by memoryview): the batch GPU tests, then
# dprobe.sh (the daemon's steps timed, issue 12's rows through the daemon).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_batch.py tests/test_gpu_direct.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
tail -2 $OUT/pytest_gpu.txt
bash docs/gpu/session14/dprobe.sh
