"""Read the probe's records in DIR (react.*.json of every daemon and the client) and print the
gate's delays (records as written, or gzipped): begin -> closed, end -> opened (negative: the daemon saw the end before the
client's clock was read after it), how long each close lasted, and the gap between hold scans.

    python3 docs/gpu/session11/react/analyze.py DIR
"""

import bisect
import glob
import gzip
import json
import sys

import numpy as np


def pct(xs: list[float]) -> str:
    if not xs:
        return "none"
    p10, p50, p90, p99 = (1e6 * float(np.percentile(xs, q)) for q in (10, 50, 90, 99))
    return f"n={len(xs)} p10 {p10:.0f} p50 {p50:.0f} p90 {p90:.0f} p99 {p99:.0f} us"


def main(folder: str) -> None:
    events: list[tuple[float, str]] = []
    begins: list[float] = []
    ends: list[float] = []
    gaps: dict[int, int] = {}
    for path in glob.glob(f"{folder}/react.*.json*"):
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            rec = json.load(f)
        events += [(t, k) for t, k in rec["events"]]
        begins += rec["begins"]
        ends += rec["ends"]
        for k, v in rec["scan_gaps"].items():
            gaps[int(k)] = gaps.get(int(k), 0) + v
    events.sort()
    closes = [t for t, k in events if k == "close"]
    opens = [t for t, k in events if k == "open"]
    closed_after, opened_after, spans, missed = [], [], [], 0
    for tb, te in zip(sorted(begins), sorted(ends), strict=True):
        i = bisect.bisect_left(closes, tb)
        if i == len(closes) or closes[i] > te:
            missed += 1  # no bulk about (the idle rows): nothing to hold, no gate closed
            continue
        j = bisect.bisect_left(opens, closes[i])
        closed_after.append(closes[i] - tb)
        if j < len(opens):
            opened_after.append(opens[j] - te)
            spans.append(opens[j] - closes[i])
    print(f"copies {len(begins)}: gate closed during {len(closed_after)}, not ({missed}: no bulk about)")
    print("begin -> gate closed:", pct(closed_after))
    print("end -> gate opened:  ", pct(opened_after))
    print("gate closed for:     ", pct(spans))
    total, acc, marks = sum(gaps.values()), 0, {}
    for k in sorted(gaps):
        acc += gaps[k]
        for p in (50, 90, 99):
            if p not in marks and acc >= total * p / 100:
                marks[p] = k
    print(f"gap between hold scans (under 2 ms): {total} scans, " + ", ".join(f"p{p} {v}-{v + 5} us" for p, v in marks.items()))


if __name__ == "__main__":
    main(sys.argv[1])
