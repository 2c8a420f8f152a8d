"""Two arms of a traffic run compared: warm TTFT ratios with bootstrap intervals, and speed-ups by stretch.

    python benchmarks/traffic/compare.py benchmarks/traffic/report-llamaindex-240-bounded/rows.jsonl \
        fuse-passages@400MB fuse-passages

Reads a run's ``rows.jsonl`` (`run.py`). Over the warm questions (outside the cold and from-disk windows) it prints
each arm's mean and median TTFT, mean share read from cache, largest store and how its answers were made; the ratio
of summed TTFTs of ``full`` over each of the two arms and of the second arm over the first (how many times sooner),
each with a 95 % percentile-bootstrap interval over questions (seeded); then, by stretch of the stream
(``--stretches``, 1-based inclusive bounds), each arm's speed-up over ``full`` and mean read share; and, over the
whole stream, the right answers each arm kept of ``full``'s (`kvrag.bench.metrics.is_right`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from kvrag.bench.metrics import is_right

Rows = dict[int, dict[str, Any]]  # one arm's rows by stream position


def ratio_interval(over: list[float], under: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of ``sum(over) / sum(under)``, questions resampled with replacement."""
    rng, n = random.Random(seed), len(over)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(over[i] for i in picks) / sum(under[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples)]


def sooner(by: dict[str, Rows], slow: str, fast: str, positions: list[int]) -> float:
    """How many times sooner ``fast`` answered than ``slow`` over ``positions`` (ratio of summed TTFTs)."""
    return sum(by[slow][p]["ttft_s"] for p in positions) / sum(by[fast][p]["ttft_s"] for p in positions)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", type=Path)
    p.add_argument("first", help="an arm, e.g. fuse-passages")
    p.add_argument("second", help="the arm it is compared with")
    p.add_argument("--stretches", default="21-60,61-120,121-140,141-180,181-240")
    args = p.parse_args(argv)
    by: dict[str, Rows] = {}
    for line in args.rows.read_text().splitlines():
        row = json.loads(line)
        by.setdefault(row["arm"], {})[row["position"]] = row
    warm = sorted(pos for pos, row in by["full"].items() if row["phase"] == "warm")
    for arm, rows in by.items():
        ttft = [rows[pos]["ttft_s"] for pos in warm]
        disk = max((row["held"]["disk"] or 0) for row in rows.values())
        modes = Counter(rows[pos].get("answered_mode") for pos in warm)
        print(f"{arm}: warm {len(ttft)}, TTFT mean {statistics.mean(ttft):.3f} s, p50 {statistics.median(ttft):.3f} s, "
              f"read {statistics.mean(rows[pos]['read_share'] for pos in warm):.3f}, store at most "
              f"{disk / 1e6:.0f} MB, answered {dict(modes)}")
    for slow, fast in (("full", args.first), ("full", args.second), (args.second, args.first)):
        lo, hi = ratio_interval([by[slow][pos]["ttft_s"] for pos in warm], [by[fast][pos]["ttft_s"] for pos in warm])
        print(f"{fast} sooner than {slow}, warm: {sooner(by, slow, fast, warm):.3f}x [{lo:.3f}, {hi:.3f}]")
    for stretch in args.stretches.split(","):
        a, b = (int(x) for x in stretch.split("-"))
        positions = [pos for pos in range(a - 1, b) if pos in by["full"]]
        parts = [f"{arm} {sooner(by, 'full', arm, positions):.2f}x full, read "
                 f"{statistics.mean(by[arm][pos]['read_share'] for pos in positions):.2f}"
                 for arm in (args.first, args.second)]
        print(f"questions {stretch}: " + "; ".join(parts) + f"; {args.first} "
              f"{sooner(by, args.second, args.first, positions):.2f}x {args.second}")
    for arm in (args.first, args.second):
        rows = by[arm]
        right = [(is_right(by["full"][pos]["answer"], row["golds"]), is_right(row["answer"], row["golds"]))
                 for pos, row in rows.items()]
        print(f"{arm}: right where full is right {sum(f and a for f, a in right)} of {sum(f for f, _ in right)}, "
              f"same text as full on {sum(rows[pos]['answer'] == by['full'][pos]['answer'] for pos in warm)} warm")


if __name__ == "__main__":
    main()
