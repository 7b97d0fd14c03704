# The reaction probe as it ran (H200, 2026-12-01 22:54-22:57 UTC): issue 10's direct rows, h2d,
# at the default short bound and at 300 us, the daemon and the client timed by sitecustomize.py.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for b in 150 300; do
  mkdir -p $OUT/b$b
  REACT_OUT=$OUT/b$b PYTHONPATH=/tmp/site:$PWD/docs/gpu/session11/react:$PWD python3 scripts/bench_gpu.py --sets h2d --rows direct --count 100 \
    --bulk-poll timer --set scheduler__urgent_block_us=$b --out $OUT/b$b/bg > $OUT/b$b/bench.txt 2>&1
  python3 docs/gpu/session11/react/analyze.py $OUT/b$b
done
