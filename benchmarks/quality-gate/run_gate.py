"""Answer quality and TTFT of the correctness gate under given settings, against full prefill and fixed modes.

Public API only (`kvrag`, `kvrag.bench.*`), with the definitions of `kvrag bench quality`: one index over the
selected questions' passages (one passage = one chunk), each question answered over exactly its own passages
in dataset order, greedy decoding, modes interleaved per question (the start rotates), one warm-up question
answered by every mode first and not counted. Agreement and first-token agreement are against `full` on the
same question in the same run.

    python benchmarks/quality-gate/run_gate.py --data FILE --start 41 --n 12 --out DIR \
        --full-below-tokens 512 --min-margin 0 --probe-must-agree 1 --sure-margin inf --ladder "" --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import build_index, load_questions, passage_keys
from kvrag.config import GateConfig

FIXED = {"probe@0.15": ("probe", 0.15), "cacheblend@0.15": ("cacheblend", 0.15), "prefix": ("prefix", None)}


def answer_row(rag: Any, item: dict[str, Any], keys: list[str], label: str, gate: GateConfig,
               max_new_tokens: int) -> dict[str, Any]:
    if label == "full":
        ans = rag.answer(item["question"], chunks=keys, mode="full", max_new_tokens=max_new_tokens)
    elif label == "gate":
        ans = rag.answer(item["question"], chunks=keys, gate=gate, max_new_tokens=max_new_tokens)
    else:
        mode, ratio = FIXED[label]
        ans = rag.answer(item["question"], chunks=keys, mode=mode, ratio=ratio, max_new_tokens=max_new_tokens)
    return {"id": item["id"], "mode": label, "answer": ans.text, "token_ids": list(ans.token_ids),
            "golds": list(item["answers"]), "ttft_s": ans.ttft_s, "prompt_tokens": ans.n_prompt_tokens,
            "recompute_fraction": ans.recompute_fraction, "answered_mode": ans.mode,
            **({"gate": ans.gate.to_json()} if ans.gate is not None else {}),
            **metrics.gold_scores(ans.text, item["answers"]), "right": metrics.is_right(ans.text, item["answers"])}


def run_question(rag: Any, item: dict[str, Any], labels: list[str], turn: int, gate: GateConfig,
                 max_new_tokens: int) -> list[dict[str, Any]]:
    keys = passage_keys(rag, item)
    rows = {"full": answer_row(rag, item, keys, "full", gate, max_new_tokens)}
    others = labels[1:]
    for label in others[turn % len(others):] + others[: turn % len(others)]:
        rows[label] = answer_row(rag, item, keys, label, gate, max_new_tokens)
    full = rows["full"]
    for row in rows.values():
        row["agreement"] = metrics.agreement(row["answer"], full["answer"])
        row["first_token_agreement"] = metrics.first_token_agreement(row["token_ids"], full["token_ids"])
    return [rows[label] for label in labels]


def summarise(rows: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    full_ttft = [r["ttft_s"] for r in rows if r["mode"] == "full"]
    out = []
    for label in labels:
        rs = [r for r in rows if r["mode"] == label]
        agree = [r["agreement"] for r in rs]
        lo, hi = metrics.bootstrap_interval(agree)
        ttft = sum(r["ttft_s"] for r in rs) / len(rs)
        s = {"mode": label, "n": len(rs), "agreement": sum(agree) / len(rs), "agreement_ci": [lo, hi],
             "first_token": sum(r["first_token_agreement"] for r in rs) / len(rs),
             "f1": sum(r["f1"] for r in rs) / len(rs), "em": sum(r["em"] for r in rs) / len(rs),
             "right": sum(r["right"] for r in rs), "ttft_s": ttft,
             "speedup": (sum(full_ttft) / len(full_ttft)) / ttft,
             "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs)}
        gates = [r["gate"] for r in rs if "gate" in r]
        if gates:
            s["gate_escalation_rate"] = sum(g["decision"] == "escalated" for g in gates) / len(gates)
            s["gate_full_rate"] = sum(g["attempts"][-1]["mode"] == "full" for g in gates) / len(gates)
            s["gate_short_rate"] = sum(g["decision"] in ("short", "full") for g in gates) / len(gates)
        out.append(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--start", type=int, default=1, help="first question (1-based)")
    p.add_argument("--n", type=int, required=True, help="questions from --start on")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-chunk-tokens", type=int, default=2048)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="probe@0.15,cacheblend@0.15,gate")
    p.add_argument("--full-below-tokens", type=int, required=True)
    p.add_argument("--min-margin", type=float, required=True)
    p.add_argument("--probe-must-agree", type=int, choices=[0, 1], required=True)
    p.add_argument("--sure-margin", type=float, required=True)
    p.add_argument("--ladder", default="", help="comma list of ratios")
    p.add_argument("--neighbour-context", type=int, default=None,
                   help="KVRag.build neighbour_context (default: kvrag's)")
    p.add_argument("--neighbour-kv", default=None, help="KVRag.build neighbour_kv (default: kvrag's)")
    p.add_argument("--question-tail", default="", help="KVRag.build question_tail (default none)")
    p.add_argument("--short-mode", default=GateConfig.short_mode, help="GateConfig.short_mode (default: kvrag's)")
    p.add_argument("--codec", default="raw",
                   help="the caches' codec (default raw: lossless, so that only fusion moves the answers)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    common.set_threads(args.threads)
    gate = GateConfig(full_below_tokens=args.full_below_tokens, min_margin=args.min_margin,
                      probe_must_agree=bool(args.probe_must_agree), sure_margin=args.sure_margin,
                      ladder=tuple(float(r) for r in args.ladder.split(",") if r), short_mode=args.short_mode)
    labels = ["full", *[m for m in args.modes.split(",") if m and m != "full"]]
    items = load_questions(Path(args.data), args.start - 1 + args.n)[args.start - 1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvrag-gate-") as tmp:
        rag, build_s = build_index(args, items, Path(tmp) / "index", args.neighbour_context, args.neighbour_kv,
                                   question_tail=args.question_tail, codec=args.codec)
        with rag:
            for item in items[: args.warmup]:
                run_question(rag, item, labels, 0, gate, args.max_new_tokens)
            rows: list[dict[str, Any]] = []
            for turn, item in enumerate(items):
                t = time.perf_counter()
                rows += run_question(rag, item, labels, turn, gate, args.max_new_tokens)
                payload = {**common.stamp(args), "codec": args.codec,
                           "data": args.data, "questions": f"{args.start}-{args.start + args.n - 1}",
                           "n_questions": turn + 1, "n_planned": len(items), "index_build_s": build_s,
                           "gate_config": {**vars(gate), "sure_margin": None if math.isinf(gate.sure_margin)
                                           else gate.sure_margin, "ladder": list(gate.ladder)},
                           "right_rule": "gold F1 >= 0.5, or a normalised gold answer contained in the answer",
                           "summary": summarise(rows, labels), "rows": rows}
                common.write_json(out / "gate.json", payload)
                print(f"question {turn + 1}/{len(items)} {time.perf_counter() - t:.1f}s", flush=True)
    for s in payload["summary"]:
        print(json.dumps(s))


if __name__ == "__main__":
    main()
