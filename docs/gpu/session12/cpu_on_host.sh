#!/bin/bash
# Session 12: the CPU-only (sim engine) benchmarks on the H200 machine's host CPU.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
lscpu | grep -E "Model name|^CPU\(s\)|MHz" > $OUT/lscpu.txt
nproc >> $OUT/lscpu.txt
for i in 1 2 3; do
  python3 scripts/bench_batch.py --out $OUT/batch$i 2>&1 | tail -5 | tee -a $OUT/batch.txt
done
for i in 1 2; do
  python3 scripts/bench.py --quick --rtt-bytes 64 --out $OUT/bench$i 2>&1 | tail -40 > $OUT/bench$i.txt
done
cat $OUT/lscpu.txt
grep -h "ratio" $OUT/batch.txt
grep -h -i "echo\|round trip\|pipelined" $OUT/bench1.txt $OUT/bench2.txt | head -20
