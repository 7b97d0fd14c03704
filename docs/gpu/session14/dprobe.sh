#!/bin/bash
# Session 14: where the daemon's urgent batch goes (timed wrappers, dprobe/sitecustomize.py),
# issue 12's rows through the daemon only, with the daemon's own queued/transfer figures.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
DPROBE_OUT=$OUT PYTHONPATH=/tmp/site:$PWD/docs/gpu/session14/dprobe:$PWD timeout 200 python3 scripts/bench_gpu_batch.py --count 100 --bulk-s 3 --skip-inprocess --out /tmp/b > $OUT/dprobe_bench.txt 2>&1
grep -E "priod (idle|under)" $OUT/dprobe_bench.txt
cp /tmp/b/results.json $OUT/dprobe_results.json
python3 - <<PY > $OUT/dprobe_summary.txt
import json, glob
r = json.load(open("$OUT/dprobe_results.json"))
for k in ("priod_idle", "priod_bulk"):
    x = r.get(k)
    if not x:
        continue
    for f in ("latency_us", "daemon_total_us", "daemon_queued_us", "daemon_transfer_us"):
        print(k, f, {n: (round(v["p50"]), round(v["p99"])) for n, v in x[f].items()})
    print(k, "paths", x["paths"])
for f in glob.glob("$OUT/dprobe_*.json"):
    if "results" in f:
        continue
    d = json.load(open(f))
    for k, v in sorted(d.items()):
        print(f"{k:<40} n={v['n']:>6} p50 {v['p50']:8.1f} p90 {v['p90']:8.1f}")
PY
cat $OUT/dprobe_summary.txt
