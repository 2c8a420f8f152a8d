"""kvrag's LangChain chat model over a passage cache (no index): TTFT and answers beside a full prefill.

A user's chain that puts the retrieved passages into a system message (joined by blank lines, as a stuff step
joins them) and the question into a human message, with ``ChatKVRag(model=..., cache=...)`` as its chat model. Per
question: ``full`` (``mode="full"``, the same messages), ``first`` (passages never seen: a prefill, their rows stored
after the answer), ``store`` (the same messages with the kept prompts forgotten: the passages' stored rows read in
place, decoded in the process's memory tier) and ``disk`` (that tier emptied too, as in a new process). The first
selected question warms up and is not counted. TTFT is the answer's own (`kvrag.Answer.ttft_s`).

    python benchmarks/any-retriever/chat_models.py --data benchmarks/data/hotpotqa_ircot.jsonl --start 11 --n 10 \
        --threads 2 --out benchmarks/any-retriever/chat-hotpotqa-report
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.bench.qa_data import load_questions, passage_text

RUNS = ("first", "store", "disk")


def messages(item: dict[str, Any], k: int) -> list[Any]:
    """The system message with the item's first ``k`` passages, then the question."""
    from langchain_core.messages import HumanMessage, SystemMessage

    context = "\n\n".join(passage_text(c) for c in item["ctxs"][:k])
    return [SystemMessage(content="Answer from the context.\n\n" + context), HumanMessage(content=item["question"])]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--start", type=int, default=2, help="first question (1-based); the one before warms up")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--k", type=int, default=16, help="passages per question (at most the item's)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    from kvrag.integrations.langchain_chat import ChatKVRag

    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_questions(args.data, args.start + args.n - 1)[max(args.start - 2, 0):]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        chat = ChatKVRag(model=args.model, cache=f"file://{folder}/cache?max_bytes=20GB",
                         max_new_tokens=args.max_new_tokens)
        full = ChatKVRag(rag=chat.rag, mode="full", max_new_tokens=args.max_new_tokens)
        if args.start > 1:  # warm-up: loads everything
            chat.invoke(messages(items[0], args.k))
            full.invoke(messages(items[0], args.k))
            chat.rag.flush()
            items = items[1:]
        for item in items:
            said = messages(item, args.k)
            reference = full.invoke(said).content
            row: dict[str, Any] = {"id": item["id"], "prompt_tokens": full.last_answer.n_prompt_tokens,
                                   "full": {"answer": reference, "ttft_s": full.last_answer.ttft_s}}
            for run in RUNS:
                if run == "store":
                    chat.rag.flush()
                    chat.rag.heads.clear_prompts()
                elif run == "disk":
                    chat.rag.heads.clear_prompts()
                    chat.rag.kvstore.decoded.clear()
                text = chat.invoke(said).content
                answer = chat.last_answer
                row[run] = {"answer": text, "ttft_s": answer.ttft_s, "passages_read": len(answer.chunks),
                            "gate": answer.gate.decision if answer.gate is not None else None,
                            "same_as_full": text == reference}
            rows.append(row)
            print(json.dumps(row)[:400], flush=True)
    summary: dict[str, Any] = {"run": {k: str(v) for k, v in vars(args).items()}, "questions": len(rows),
                               "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
                               "full_median_ttft_s": statistics.median(r["full"]["ttft_s"] for r in rows)}
    for run in RUNS:
        summary[run] = {"full_over_run": statistics.median(r["full"]["ttft_s"] / r[run]["ttft_s"] for r in rows),
                        "median_ttft_s": statistics.median(r[run]["ttft_s"] for r in rows),
                        "same_answer_as_full": sum(r[run]["same_as_full"] for r in rows),
                        "gate": {g: sum(r[run]["gate"] == g for r in rows) for g in {r[run]["gate"] for r in rows}}}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "rows.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
