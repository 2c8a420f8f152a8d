"""What an exact repair during decoding would buy: at the first step where a fused answer's greedy lead
falls below a threshold, prefill the prompt and the answer so far in full and go on from that cache.

    python benchmarks/experiments/decode_repair.py --data QA.jsonl --n 8 --mode probe@0.15 \
        --out bench-out/decode_repair.json

For each question, `full` and the fused mode answer greedily (`KVRag.answer`, one passage = one chunk,
the passages in dataset order). The fused answer's per-step margins (the log-probability lead of each
chosen token over the runner-up) come from `FusedPrompt.teacher_logprobs` on the fused cache. The repair
is then simulated for each threshold: no step below it keeps the fused answer; a first step below it
after a prefix equal to `full`'s gives `full`'s answer (the repaired cache is a full prefill's); a first
step below it after the answers have already parted keeps the fused answer (the repair would continue
a departed answer). Its cost is `full`'s TTFT added to the fused answer's, an estimate that leaves out
the decoding steps before the repair. Agreement is token F1 against `full`'s answer, as in
`kvrag bench quality`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import build_index, load_questions, passage_keys

THRESHOLDS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def margins(rag: Any, question: str, keys: list[str], mode: str, ratio: float | None,
            token_ids: list[int]) -> list[float]:
    """The greedy lead of each of ``token_ids`` over the runner-up, on the cache ``mode`` fuses."""
    if not token_ids:
        return []
    rows = rag.prepare(question, chunks=keys, mode=mode, ratio=ratio).teacher_logprobs(token_ids)
    top2 = rows.topk(2, dim=-1).values
    return [float(v) for v in top2[:, 0] - top2[:, 1]]


def answer(rag: Any, item: dict[str, Any], keys: list[str], label: str, max_new: int) -> dict[str, Any]:
    mode, _, ratio = label.partition("@")
    r = float(ratio) if ratio else None
    ans = rag.answer(item["question"], chunks=keys, mode=mode, ratio=r, max_new_tokens=max_new)
    return {"text": ans.text, "token_ids": list(ans.token_ids), "ttft_s": ans.ttft_s,
            "prompt_tokens": ans.n_prompt_tokens,
            "margins": margins(rag, item["question"], keys, mode, r, list(ans.token_ids))}


def simulate(rows: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """Agreement, repairs and time (over `full`'s TTFT) of a repair below ``threshold``."""
    agreement, repaired, parted, seconds, full_seconds = 0.0, 0, 0, 0.0, 0.0
    for row in rows:
        full, fused = row["full"], row["fused"]
        step = next((i for i, m in enumerate(fused["margins"]) if m < threshold), None)
        seconds += fused["ttft_s"]
        full_seconds += full["ttft_s"]
        if step is None:
            agreement += fused["agreement"]
            continue
        repaired += 1
        seconds += full["ttft_s"]
        if fused["token_ids"][:step] == full["token_ids"][:step]:
            agreement += 1.0
        else:
            parted += 1
            agreement += fused["agreement"]
    n = len(rows)
    return {"threshold": threshold, "agreement": agreement / n, "repaired": repaired, "parted_before": parted,
            "questions": n, "time_over_full_ttft": seconds / full_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--start", type=int, default=1, help="first question (1-based)")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--mode", default="probe@0.15")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-chunk-tokens", type=int, default=2048)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    common.set_threads(args.threads)
    items = load_questions(Path(args.data), args.start - 1 + args.n)[args.start - 1:]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvrag-repair-") as tmp:
        rag, _ = build_index(args, items, Path(tmp) / "index")
        with rag:
            for item in items:
                t = time.perf_counter()
                keys = passage_keys(rag, item)
                full = answer(rag, item, keys, "full", args.max_new_tokens)
                fused = answer(rag, item, keys, args.mode, args.max_new_tokens)
                fused["agreement"] = metrics.agreement(fused["text"], full["text"])
                rows.append({"id": item["id"], "full": full, "fused": fused})
                payload = {**common.stamp(args), "data": args.data, "mode": args.mode,
                           "simulated": [simulate(rows, th) for th in THRESHOLDS], "rows": rows}
                common.write_json(Path(args.out), payload)
                print(f"{item['id']}: {full['prompt_tokens']} tokens, agreement {fused['agreement']:.3f}, "
                      f"lowest margin {min(fused['margins'], default=float('nan')):.3f}, "
                      f"{time.perf_counter() - t:.1f} s", flush=True)
    for s in payload["simulated"]:
        print(f"below {s['threshold']:.2f}: agreement {s['agreement']:.3f}, repaired {s['repaired']}/{s['questions']} "
              f"({s['parted_before']} parted before), time {s['time_over_full_ttft']:.2f}x full's TTFT")


if __name__ == "__main__":
    main()
