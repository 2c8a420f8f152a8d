"""Gold answers kept and lost by each mode of `kvrag bench quality` runs, against ``full`` on the same questions.

    python benchmarks/experiments/kept_answers.py benchmarks/quality-long-prompts/neighbours/*/quality.json

For each run and each mode: of the questions ``full`` answers right (`kvrag.bench.metrics.is_right`), how many the
mode also answers right; its mean agreement with ``full``; how many of its answers are ``full``'s text exactly; and
how many questions it answers right where ``full`` does not.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvrag.bench import metrics


def kept(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per mode other than ``full``: what it kept of ``full``'s right answers, and its agreement."""
    by_question: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_question[row["id"]].setdefault(row["mode"], row)
    right = {q: {m: metrics.is_right(r["answer"], r["golds"]) for m, r in modes.items()}
             for q, modes in by_question.items()}
    full_right = [q for q in by_question if right[q].get("full")]
    out = []
    for mode in sorted({m for modes in by_question.values() for m in modes} - {"full"}):
        asked = [q for q in by_question if mode in by_question[q] and "full" in by_question[q]]
        out.append({
            "mode": mode, "questions": len(asked), "full_right": len(full_right),
            "kept": sum(bool(right[q].get(mode)) for q in full_right),
            "agreement": sum(by_question[q][mode]["agreement"] for q in asked) / max(1, len(asked)),
            "same_text": sum(by_question[q][mode]["answer"] == by_question[q]["full"]["answer"] for q in asked),
            "right_where_full_wrong": sum(bool(right[q][mode]) and not right[q]["full"] for q in asked)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="quality.json files")
    args = parser.parse_args()
    print("| run | mode | right where `full` is right | agreement with `full` | same text | right where `full` is "
          "wrong |")
    print("|---|---|---|---|---|---|")
    for path in args.runs:
        for line in kept(json.loads(path.read_text())["rows"]):
            print(f"| {path.parent.name} | {line['mode']} | {line['kept']} of {line['full_right']} | "
                  f"{line['agreement']:.3f} | {line['same_text']} of {line['questions']} | "
                  f"{line['right_where_full_wrong']} |")


if __name__ == "__main__":
    main()
