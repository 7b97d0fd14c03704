set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
date -u
for r in 1 2; do for g in sleep busy; do
  echo "== $g $r"; python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --skip-inprocess --gap $g --out $OUT/$g$r > $OUT/$g$r.txt 2>&1
  grep -E "(priod|direct) (under|idle)|target" $OUT/$g$r.txt
done; done
find $OUT -name results.json -delete; find $OUT -name '*.png' -delete
date -u
