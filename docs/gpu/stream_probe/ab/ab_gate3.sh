#!/bin/bash
# A/B on the H200 after the hold-page fix (d14cc37): gate off (150 us bound), gate on (150, as shipped), gate on with the 300 us bound; h2d, direct rows, no co-tenant; two rounds interleaved.
set -u
for r in 1 2; do
  for v in off150 on150 on300; do
    out=$OUT/ab_${v}_$r
    case $v in
      off150) s="--set scheduler__gate_bulk=false";;
      on150) s="--set scheduler__gate_bulk=true";;
      on300) s="--set scheduler__gate_bulk=true --set scheduler__urgent_block_us=300";;
    esac
    python3 scripts/bench_gpu.py --sets h2d --cotenant none --rows direct --count 100 --bulk-poll timer $s --out $out > $out.log 2>&1
    rm -f $out/latency.png
    echo "== $v $r $(grep -E ' direct  ' $out.log | head -1 | awk '{print "bulk GB/s",$(NF-2)}') raw $(grep 'raw cudaMemcpyAsync' $out.log | grep -o 'h2d [0-9.]*$')"
    grep -E ' direct  ' $out.log | grep -E 'KiB|MiB' | awk '{print $3,$4,"p50",$7,"p99",$9}'
  done
done
