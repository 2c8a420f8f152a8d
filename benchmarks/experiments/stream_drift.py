"""The gate's own signals as a detector of fused answers that part from the full prefill's, on a traffic stream.

    python benchmarks/experiments/stream_drift.py TUNE_REPORT_DIR REPORT_DIR [--horizon 8] [--model smollm2]

Each directory is a `benchmarks/traffic/run.py` output (``rows.jsonl``) with a ``full`` arm and a fusing arm
(``fuse-passages`` or ``fuse-index``) whose rows record the gate's attempts. For every prompt the fusing arm fused,
the label is whether its answer's first ``--horizon`` tokens differ from ``full``'s answer to the same question,
and the signals are those the gate reads off the first fused pass before decoding: the first token's margin (its
log-probability lead) and whether the probe pass predicted the same first token. The margin's threshold is chosen
on the first directory (`drift_signals.threshold_for`: the most parting answers caught with at most a third of the
holding ones escalated) and reported on the second, with the probe's disagreement and either of the two.

Escalating a fused prompt prefills it in full after the fused pass (the gate's last attempt): its TTFT is taken as
the fused TTFT plus ``full``'s on the same question, measured in the same run. Printed per directory: the fused
prompts, how many part, and per rule the share of parting answers caught, the share of holding ones escalated, the
right answers (`kvrag.bench.metrics.is_right`) the fused prompts lose against ``full`` with and without it, and the
mean TTFT over the fused prompts against ``full``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # drift_signals.py, beside this script

from drift_signals import threshold_for  # noqa: E402

from kvrag.bench import metrics  # noqa: E402
from kvrag.model import load_model  # noqa: E402

FUSING_ARMS = ("fuse-passages", "fuse-index")
Rule = Callable[[dict[str, Any]], bool]


def fused_rows(folder: Path, encode: Callable[[str], list[int]], horizon: int) -> list[dict[str, Any]]:
    """One row per prompt a fusing arm fused: its signals, its label and what both arms answered."""
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]
    full = {(r["framework"], r["position"]): r for r in rows if r["arm"] == "full"}
    out = []
    for r in rows:
        if r["arm"] not in FUSING_ARMS or r.get("gate") != "fused" or not r.get("gate_attempts"):
            continue
        ref = full.get((r["framework"], r["position"]))
        if ref is None:
            continue
        signals = r["gate_attempts"][0]["signals"]
        out.append({"margin": signals["margin"], "probe_agrees": signals["probe_agrees"],
                    "parts": encode(r["answer"])[:horizon] != encode(ref["answer"])[:horizon],
                    "fused_right": metrics.is_right(r["answer"], r["golds"]),
                    "full_right": metrics.is_right(ref["answer"], ref["golds"]),
                    "fused_ttft": r["ttft_s"], "full_ttft": ref["ttft_s"]})
    return out


def rule_rates(rows: list[dict[str, Any]], escalate: Rule) -> dict[str, float]:
    """What escalating by ``escalate`` does over ``rows``."""
    parting, holding = [r for r in rows if r["parts"]], [r for r in rows if not r["parts"]]
    kept = [r["full_right"] if escalate(r) else r["fused_right"] for r in rows]
    ttft = [r["fused_ttft"] + (r["full_ttft"] if escalate(r) else 0.0) for r in rows]
    return {"caught": sum(map(escalate, parting)) / max(1, len(parting)),
            "needless": sum(map(escalate, holding)) / max(1, len(holding)),
            "escalated": sum(map(escalate, rows)),
            "lost": sum(r["full_right"] and not k for r, k in zip(rows, kept)),
            "ttft_x_full": statistics.mean(r["full_ttft"] for r in rows) / statistics.mean(ttft)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tune", type=Path)
    p.add_argument("report", type=Path)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()
    tokenizer = load_model(args.model).tokenizer

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    tune, report = (fused_rows(d, encode, args.horizon) for d in (args.tune, args.report))
    threshold = threshold_for(tune, "margin", 1 / 3)
    rules: dict[str, Rule] = {
        "none": lambda r: False,
        f"margin <= {threshold:.3f}": lambda r: r["margin"] <= threshold,
        "probe disagrees": lambda r: r["probe_agrees"] is False,
        "either": lambda r: r["margin"] <= threshold or r["probe_agrees"] is False}
    for name, rows in (("tune", tune), ("report", report)):
        print(f"{name}: {len(rows)} fused prompts, {sum(r['parts'] for r in rows)} part from full in the first "
              f"{args.horizon} tokens; full right on {sum(r['full_right'] for r in rows)}")
        for rule, escalate in rules.items():
            s = rule_rates(rows, escalate)
            print(f"  {rule:>20}: caught {s['caught']:.2f}, needless {s['needless']:.2f}, escalated "
                  f"{s['escalated']}, right answers lost {s['lost']}, TTFT {s['ttft_x_full']:.2f}x sooner than full")


if __name__ == "__main__":
    main()
