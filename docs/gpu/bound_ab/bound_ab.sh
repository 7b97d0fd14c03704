python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
for b in ${BOUNDS:-200 150 250}; do
  python3 scripts/bench_gpu.py --sets h2d,d2h --rows direct --count 100 --bulk-poll timer --set scheduler__urgent_block_us=$b --out $OUT/b$b > $OUT/b$b.txt 2>&1
  rm -f $OUT/b$b/*.png
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for b in [int(x) for x in os.environ.get("BOUNDS", "150 200 250").split()]:
    r = json.load(open(f"{out}/b{b}/results.json"))
    for sname, s in r["sets"].items():
        raw = s["inprocess"]["raw_gbps"][sname]
        anchor = {}
        for row in s["rows"]:
            if row["row"] == "anchor":
                continue
            lat = row["loaded"]
            def pc(v, q):
                v = sorted(v); return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]
            cells = " ".join(f"{k.split('/')[1] >> 10 if False else int(k.split('/')[1]) >> 10}K {pc(lat[k],50):.0f}/{pc(lat[k],99):.0f}" for k in lat if not k.startswith("_"))
            ps = " ".join(f"{list(v.values())[0] / raw:.3f}" for v in row["bulk_gbps_per_size"].values())
            print(f"b{b} {sname} {row['cotenant']['kind']:<4} whole {list(row['bulk_gbps'].values())[0] / raw:.3f} per-size {ps} alone {list(row['bulk_alone_gbps'].values())[0] / raw:.3f} | {cells}")
PY
