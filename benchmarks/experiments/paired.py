"""Question-by-question comparisons of `kvrag bench quality` runs with a baseline mode, from their
``quality.json`` files: the table the bench writes itself (`kvrag.bench.quality.paired`), for runs
made before it did, or for several runs on the same questions pooled.

    python benchmarks/experiments/paired.py benchmarks/quality-musique-precision/quality.json \
        benchmarks/quality-hotpotqa-precision/quality.json

Each file is compared on its own; ``--pool`` pools the rows of every file first (runs over
different questions of one data set, e.g. questions 1–10 and 11–20). A mode answered twice for one
question (in two pooled runs) keeps its first answer. Before the comparisons, a table of every mode
on its own: agreement with ``full`` and mean |ΔNLL|, each with its 95 % bootstrap interval.

``--across`` compares two runs of the same questions with each other instead (e.g. the same modes
over two indexes): each mode of both runs, the second run minus the first, question by question.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics
from kvrag.bench.quality_report import PAIRED_BASELINES, interval_text, paired, paired_markdown


def first_answers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[tuple[str, str]] = set()
    out = []
    for r in rows:
        if (r["id"], r["mode"]) not in seen:
            seen.add((r["id"], r["mode"]))
            out.append(r)
    return out


def modes_markdown(rows: list[dict[str, Any]]) -> str:
    """Per mode, in the rows' order: questions, agreement and mean |ΔNLL| with 95 % bootstrap intervals."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    table = []
    for mode, rs in by_mode.items():
        agree = [r["agreement"] for r in rs]
        closeness = [abs(r["delta_nll"]) for r in rs]
        table.append([mode, len(rs), f"{metrics.summary(agree)['mean']:.3f}",
                      interval_text(metrics.bootstrap_interval(agree)),
                      f"{metrics.summary(closeness)['mean']:.4f}",
                      interval_text(metrics.bootstrap_interval(closeness), ".4f")])
    return common.markdown_table(
        ["mode", "questions", "agreement", "95 % interval", "mean \\|ΔNLL\\|", "95 % interval"], table)


def across(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[list[Any]]:
    """Rows of the ``--across`` table: per mode answered in both runs (not ``full``), the questions
    both answered and the mean change in agreement and in |ΔNLL| (``after`` minus ``before``) with
    95 % bootstrap intervals, and on how many questions the answer changed.
    """
    first = {(r["id"], r["mode"]): r for r in first_answers(before)}
    by_mode: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r in first_answers(after):
        if r["mode"] != "full" and (r["id"], r["mode"]) in first:
            by_mode.setdefault(r["mode"], []).append((first[(r["id"], r["mode"])], r))
    table = []
    for mode, pairs in by_mode.items():
        agree = [b["agreement"] - a["agreement"] for a, b in pairs]
        closer = [abs(b["delta_nll"]) - abs(a["delta_nll"]) for a, b in pairs]
        table.append([mode, len(pairs), f"{metrics.summary(agree)['mean']:+.3f}",
                      interval_text(metrics.bootstrap_interval(agree), "+.3f"),
                      f"{metrics.summary(closer)['mean']:+.4f}",
                      interval_text(metrics.bootstrap_interval(closer), "+.4f"),
                      sum(a["answer"] != b["answer"] for a, b in pairs)])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("quality", nargs="+", type=Path, help="quality.json files of `kvrag bench quality` runs")
    parser.add_argument("--pool", action="store_true", help="pool every file's rows into one comparison")
    parser.add_argument("--across", action="store_true",
                        help="two files: each mode of the second run against the same mode of the first")
    parser.add_argument("--baseline", action="append", default=None, metavar="MODE",
                        help="compare every mode with this one (repeatable; default: "
                             + ", ".join(PAIRED_BASELINES) + ")")
    args = parser.parse_args()
    runs = [(path, json.loads(path.read_text())["rows"]) for path in args.quality]
    if args.across:
        if len(runs) != 2 or args.pool:
            parser.error("--across takes exactly two files and no --pool")
        print(f"## {runs[1][0]} against {runs[0][0]}\n")
        print(common.markdown_table(
            ["mode", "questions", "agreement change", "95 % interval", "\\|ΔNLL\\| change", "95 % interval",
             "answers changed"], across(runs[0][1], runs[1][1])))
        return
    if args.pool:
        runs = [(Path(" + ".join(str(p) for p, _ in runs)), first_answers([r for _, rows in runs for r in rows]))]
    for path, rows in runs:
        pairs = paired(rows, list(dict.fromkeys(r["mode"] for r in rows)), args.baseline or PAIRED_BASELINES)
        print(f"## {path}\n")
        print(modes_markdown(rows), end="\n\n")
        print(paired_markdown(pairs) if pairs else "(no baseline mode in this run)", end="\n\n")


if __name__ == "__main__":
    main()
