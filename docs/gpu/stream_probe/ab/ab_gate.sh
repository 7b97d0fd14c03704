#!/bin/bash
# A/B on the H200 (.probe/base11: `git archive 11294e3 priod scripts`): the tree before the gate (11294e3), this tree with gate_bulk off, and on; h2d, direct rows, no co-tenant; two rounds interleaved.
set -u
ROOT=$PWD
for r in 1 2; do
  for v in old off on; do
    out=$OUT/ab_${v}_$r
    if [ $v = old ]; then
      (cd .probe/base11 && PYTHONPATH=/tmp/site:$ROOT/.probe/base11 python3 scripts/bench_gpu.py --sets h2d --cotenant none --rows direct --count 100 --bulk-poll timer --out $out > $out.log 2>&1)
    else
      g=$([ $v = on ] && echo true || echo false)
      PYTHONPATH=/tmp/site:$ROOT python3 scripts/bench_gpu.py --sets h2d --cotenant none --rows direct --count 100 --bulk-poll timer --set scheduler__gate_bulk=$g --out $out > $out.log 2>&1
    fi
    echo "== round $r $v"; grep -E " direct " $out.log | grep -E "KiB|MiB" | cut -c1-60,140-175
  done
done
