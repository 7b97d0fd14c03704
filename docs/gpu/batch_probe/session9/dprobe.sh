set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
date -u
DPROBE_OUT=$OUT PYTHONPATH=/tmp/site:$PWD/.probe/dprobe:$PWD python3 scripts/bench_gpu_batch.py --count 100 --bulk-s 3 --skip-inprocess --out $OUT/b > $OUT/b.txt 2>&1
grep -E "priod (idle|under)" $OUT/b.txt
python3 - <<PY
import json, glob
r = json.load(open("$OUT/b/results.json"))
for k in ("priod_idle", "priod_bulk"):
    x = r[k]
    print(k, "client", {n: (round(v["p50"]), round(v["p99"])) for n, v in x["latency_us"].items()}, "daemon total", {n: (round(v["p50"]), round(v["p99"])) for n, v in x["daemon_total_us"].items()}, x["paths"])
for f in glob.glob("$OUT/dprobe_*.json"):
    d = json.load(open(f))
    for k, v in sorted(d.items()):
        print(f"{k:<40} n={v['n']:>6} p50 {v['p50']:8.1f} p90 {v['p90']:8.1f}")
PY
rm -f $OUT/b/results.json
date -u
