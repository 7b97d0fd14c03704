set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
date -u
python3 -m pytest -q -m gpu tests/test_gpu_batch.py tests/test_gpu_direct.py tests/test_gpu_e2e.py -p no:cacheprovider 2>&1 | tail -2
summ() {
python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1] + "/results.json"))
for k in ("priod_idle", "priod_bulk", "direct_idle", "direct_bulk"):
    if k not in r: continue
    x = r[k]
    lat = {n: (round(v["p50"]), round(v["p99"])) for n, v in x["latency_us"].items()}
    dt = {n: (round(v["p50"]), round(v["p99"])) for n, v in x.get("daemon_total_us", {}).items()}
    print(f"  {k:<12} client {lat} daemon {dt}")
PY
}
for r in 1 2; do
  echo "== new $r"; DPROBE_OUT=$OUT PYTHONPATH=/tmp/site:$PWD/.probe/dprobe:$PWD python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --skip-inprocess --out $OUT/new$r > $OUT/new$r.txt 2>&1; summ $OUT/new$r
  echo "== old $r"; (cd .probe/old && PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --skip-inprocess --out $OUT/old$r > $OUT/old$r.txt 2>&1); summ $OUT/old$r
done
grep -E "bulk copy_batch|target" $OUT/new*.txt
python3 - <<PY
import json, glob
for f in glob.glob("$OUT/dprobe_*.json"):
    d = json.load(open(f))
    for k, v in sorted(d.items()):
        if v["n"] > 5: print(f"{k:<40} n={v['n']:>6} p50 {v['p50']:8.1f} p90 {v['p90']:8.1f}")
PY
find $OUT -name results.json -delete; find $OUT -name '*.png' -delete
date -u
