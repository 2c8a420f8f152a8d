"""Where each mode's greedy answer departs from ``full``'s in `kvrag bench quality` runs, and how
near ``full`` itself was to choosing the other token there.

    python benchmarks/experiments/departures.py --quality bench-out/quality/quality.json \
        --index /tmp/nc-stored-idx --out bench-out/departures.json

``full``'s answer to every question with a departure is fed back through a full prefill
(`KVRag.teacher_logprobs`). At the first token where a mode's answer differs, the margin is
``full``'s log-probability of its own token minus that of the mode's token. A margin near zero is a
near tie: ``full`` itself almost chose the mode's token, and any small change to the computation
(bfloat16 instead of float32, for one) can flip it. The index must hold the runs' passages, built
with the runs' model (``full`` reads no cache, so any such index does). The questions are read
from the QA JSONL file that each run's JSON names, or from ``--data PATH`` (one question a line:
``{id, question, answers, ctxs: [{title, text}]}``) where the file lies elsewhere. Each mode's mean
|ΔNLL| (the run's ΔNLL per question, taken absolute so that questions scored better and worse than
by ``full`` do not cancel) comes with it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import load_questions, passage_keys

THRESHOLDS = (0.1, 0.5)  # nats


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run and mode: answers, departures, median departure step and ``full``'s median margin there."""
    out = []
    for run, mode in dict.fromkeys((r["run"], r["mode"]) for r in rows):
        rs = [r for r in rows if r["run"] == run and r["mode"] == mode]
        gone = [r for r in rs if r["step"] is not None]
        margins = [r["margin"] for r in gone if not math.isnan(r["margin"])]
        out.append({
            "run": run,
            "mode": mode,
            "answers": len(rs),
            "departures": len(gone),
            "median_step": statistics.median(r["step"] for r in gone) if gone else None,
            "median_margin": statistics.median(margins) if margins else None,
            **{f"margin_below_{t}": sum(m < t for m in margins) for t in THRESHOLDS},
            "mean_abs_delta_nll": statistics.fmean(abs(r["delta_nll"]) for r in rs),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quality", required=True, nargs="+",
                        help="quality.json of one or more `kvrag bench quality` runs of the same model")
    parser.add_argument("--index", required=True, help="an index holding those runs' passages")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="the QA JSONL file the runs answered (default: the path each run recorded)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench-out/departures.json")
    args = parser.parse_args()
    from kvrag import KVRag

    common.set_threads(args.threads)
    rows: list[dict[str, Any]] = []
    full_logprobs: dict[tuple[str, tuple[int, ...]], Any] = {}  # full's answers recur across runs: fed once
    with KVRag.open(args.index) as rag:
        for path in args.quality:
            run = json.loads(Path(path).read_text())
            by_id: dict[str, dict[str, dict[str, Any]]] = {}
            for row in run["rows"]:
                by_id.setdefault(row["id"], {})[row["mode"]] = row
            items = {item["id"]: item for item in load_questions(Path(args.data or run["data"]), run["n_planned"])}
            for qid, modes in by_id.items():
                full = modes["full"]["token_ids"]
                steps = {mode: metrics.departure(row["token_ids"], full)
                         for mode, row in modes.items() if mode != "full"}
                key = (qid, tuple(full))
                if key not in full_logprobs and full and any(s is not None for s in steps.values()):
                    item = items[qid]
                    full_logprobs[key] = rag.teacher_logprobs(item["question"], full, passage_keys(rag, item))
                for mode, step in steps.items():
                    margin = math.nan
                    if step is not None and key in full_logprobs:
                        margin = metrics.reference_margin(full_logprobs[key], modes[mode]["token_ids"], full, step)
                    rows.append({"run": path, "id": qid, "mode": mode, "step": step, "margin": margin,
                                 "delta_nll": modes[mode].get("delta_nll", math.nan)})
                print(path, qid, steps, flush=True)
    summary = summarise(rows)
    out, stamp = Path(args.out), common.stamp(args)
    common.write_json(out, {**stamp, "index": args.index, "summary": summary, "rows": rows})
    headers = ["run", "mode", "answers", "departures", "median step", "full's median margin (nats)",
               *[f"margin < {t}" for t in THRESHOLDS], "mean \\|ΔNLL\\|"]
    table = common.markdown_table(headers, [
        [s["run"], s["mode"], s["answers"], s["departures"], "–" if s["median_step"] is None else s["median_step"],
         math.nan if s["median_margin"] is None else s["median_margin"],
         *[s[f"margin_below_{t}"] for t in THRESHOLDS], s["mean_abs_delta_nll"]] for s in summary])
    out.with_suffix(".md").write_text(f"`{stamp['command']}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
