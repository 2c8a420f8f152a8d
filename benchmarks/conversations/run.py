"""Multi-turn conversations over QA data: time to first token per turn with and without the history cache.

Each conversation asks ``--turns`` questions of the data set in a row (one conversation after another,
disjoint questions), retrieving ``--k`` passages per turn from one index over all their passages; each
answer is fed back as the assistant's message. At every turn the same messages are answered twice, in
alternating order: with the history cache (the conversation's kept KV reused) and without it (the
history recomputed: each earlier turn's passages retrieved and fused again, each answer prefilled), so the
two are measured side by side on the same machine state. Keeping a turn's KV runs in the background after
its answer; each timed request starts once no keep is running, and the keeps' seconds are reported apart.
Greedy decoding; the answers of the two are compared token for token.

    python benchmarks/conversations/run.py --data $QA/hotpotqa_ircot.jsonl --conversations 3 --turns 8 \
        --out benchmarks/conversations/hotpotqa

Writes ``rows.jsonl`` (one row per turn and setting), ``summary.json`` and ``ttft_per_turn.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvrag import KVRag, SessionConfig, SplitConfig
from kvrag.bench.qa_data import load_questions, passage_documents

SYSTEM = "Answer the user's question using the passages. Answer in one or two sentences."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="QA JSONL (id, question, answers, ctxs)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def ask(rag: KVRag, messages: list[dict[str, str]], args: argparse.Namespace, history_cache: bool) -> dict[str, Any]:
    rag.sessions.wait()  # the previous turn's keep, done in the background, is not timed here (see keep_s)
    t0 = time.perf_counter()
    answer = rag.chat(messages, k=args.k, max_new_tokens=args.max_new_tokens, history_cache=history_cache)
    return {"history_cache": history_cache, "ttft_s": answer.ttft_s, "total_s": time.perf_counter() - t0,
            "text": answer.text, "token_ids": answer.token_ids, "prompt_tokens": answer.n_prompt_tokens,
            "mode": answer.mode, "history": answer.history.to_json(), "timings": answer.timings,
            "chunks": [c.key for c in answer.chunks]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    items = load_questions(args.data, args.conversations * args.turns)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rag = KVRag.build(passage_documents(items), Path(tmp) / "idx", model=args.model,
                          split=SplitConfig(mode="document", min_tokens=0), show_progress=False)
        build_s = time.perf_counter() - t0
        rag.configure_sessions(SessionConfig())
        # warm-up (not counted): one turn each way
        warm = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": items[0]["question"]}]
        ask(rag, warm, args, False)
        rag.configure_sessions(SessionConfig())
        for c in range(args.conversations):
            messages = [{"role": "system", "content": SYSTEM}]
            for t in range(args.turns):
                item = items[c * args.turns + t]
                messages.append({"role": "user", "content": item["question"]})
                order = [True, False] if (c + t) % 2 == 0 else [False, True]
                got = {flag: ask(rag, list(messages), args, flag) for flag in order}
                for flag in (True, False):
                    rows.append({"conversation": c, "turn": t + 1, "id": item["id"], **got[flag],
                                 "same_answer": got[True]["token_ids"] == got[False]["token_ids"]})
                on, off = got[True], got[False]
                print(f"conv {c} turn {t + 1}: prompt {on['prompt_tokens']} tok, reused "
                      f"{on['history']['reused_tokens']}, ttft on {on['ttft_s']:.3f}s off {off['ttft_s']:.3f}s "
                      f"({off['ttft_s'] / on['ttft_s']:.2f}x), same={on['token_ids'] == off['token_ids']}",
                      flush=True)
                messages.append({"role": "assistant", "content": on["text"]})
        rag.sessions.wait()
        stats = rag.sessions.stats()
        rag.close()
    (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise(rows, stats, build_s, args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["per_turn"], indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_turn"}, indent=1))
    plot(summary, args.out / "ttft_per_turn.png")


def summarise(rows: list[dict[str, Any]], stats: dict[str, Any], build_s: float,
              args: argparse.Namespace) -> dict[str, Any]:
    per_turn = []
    for turn in range(1, args.turns + 1):
        on = [r for r in rows if r["turn"] == turn and r["history_cache"]]
        off = [r for r in rows if r["turn"] == turn and not r["history_cache"]]
        per_turn.append({
            "turn": turn,
            "ttft_on_s": statistics.mean(r["ttft_s"] for r in on),
            "ttft_off_s": statistics.mean(r["ttft_s"] for r in off),
            "ratio_of_means": statistics.mean(r["ttft_s"] for r in off) / statistics.mean(r["ttft_s"] for r in on),
            "ratios": [b["ttft_s"] / a["ttft_s"] for a, b in zip(on, off)],
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in on),
            "history_tokens_reused": statistics.mean(r["history"]["reused_tokens"] for r in on),
            "history_tokens_prefilled_off": statistics.mean(r["history"]["prefilled_tokens"] for r in off),
            "same_answers": sum(r["same_answer"] for r in on), "n": len(on),
        })
    on_rows = [r for r in rows if r["history_cache"]]
    return {
        "data": args.data.name, "conversations": args.conversations, "turns": args.turns, "k": args.k,
        "max_new_tokens": args.max_new_tokens, "threads": args.threads, "build_s": build_s,
        "load_average_at_end": os.getloadavg(),
        "prefill_tokens_saved": sum(r["history"]["reused_tokens"] for r in on_rows),
        "same_answers": f"{sum(r['same_answer'] for r in on_rows)}/{len(on_rows)}",
        "sessions": stats, "keep_s_per_turn": stats["save_s"] / max(1, stats["saves"]),
        "per_turn": per_turn,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in summary["per_turn"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(turns, [r["ttft_off_s"] for r in summary["per_turn"]], "o-", label="history cache off")
    ax.plot(turns, [r["ttft_on_s"] for r in summary["per_turn"]], "s-", label="history cache on")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s, mean)")
    ax.set_title(f"{summary['data']}: {summary['conversations']} conversations, k={summary['k']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
