set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
date -u
bash scripts/build_ptx.sh --check 2>&1 | tail -8
cp priod/engines/cuda/express.ptx $OUT/express.ptx
grep -n "priod_copy_table_param_0\|^.version\|^.target" priod/engines/cuda/express.ptx | head
python3 -m pytest -q -m gpu tests --ignore=tests/test_deploy.py --ignore=tests/test_dashboard_png.py -p no:cacheprovider 2>&1 | tail -4
for r in 1 2 3; do
  echo "== new $r"; python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --skip-inprocess --out $OUT/new$r > $OUT/new$r.txt 2>&1; grep -E "direct|target|copy_batch|contiguous" $OUT/new$r.txt | tail -12
  echo "== old $r"; (cd .probe/old && PYTHONPATH=/tmp/site:$PWD python3 scripts/bench_gpu_batch.py --direct --count 100 --bulk-s 3 --skip-inprocess --out $OUT/old$r > $OUT/old$r.txt 2>&1); grep -E "direct under" $OUT/old$r.txt | tail -8
done
OUT=$OUT python3 docs/gpu/batch_probe/direct_batch_probe.py > $OUT/probe.txt 2>&1; tail -12 $OUT/probe.txt
find $OUT -name '*.png' -delete; find $OUT -name 'results.json' -delete
date -u
