#!/bin/bash
# Session 14: where the kernel-checked direct batch's time goes (the probe's stepped and
# raw_checked rows), with the PTX of checked.sh committed.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
python3 docs/gpu/session14/lean_batch_probe.py > $OUT/probe2.txt 2>&1; tail -10 $OUT/probe2.txt
