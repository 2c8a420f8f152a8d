"""Passage caches taken from an earlier prompt's rows against caches prefilled alone, fused into a new prompt.

    python benchmarks/experiments/prompt_rows_quality.py --data 2wikimultihopqa_ircot.jsonl --n 20 --k 16 \
        --out bench-out/prompt-rows.jsonl

``--data`` is a QA JSONL file, one question a line: ``{id, question, answers, ctxs: [{title, text}]}``. The corpus
is every passage of the selected questions, retrieved by all-MiniLM-L6-v2 (``--k`` a question). Per question, the
target prompt is LlamaIndex's default text-QA template (``--template langchain``: the LangChain tutorial's) over the
retrieved passages and the question, as the model's chat turn. An earlier prompt holds the same passages in another
context: the next question's text over them in the reverse order (``--earlier reversed``), or half of them, the
other half from the next question's retrieval, shuffled (``mixed``). A passage cache (`kvrag.passages`) answers that
earlier prompt, which stores each passage's rows in it (`kvrag.passages.prompt_rows`). Then the target prompt is
answered by a full prefill, and fused (``probe`` at ``--ratio``, no gate) from those stored caches wherever the passages
stand now (``rows``: read past the rule that a passage's cache is read only after the passage it followed) and from
caches of the same passages prefilled alone after the prompt prefix (``alone``, as kvrag stored them before).
Printed: mean token agreement with the full prefill's answer, answers equal to it, right answers, and answers wrong
where the full prefill's is right.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import metrics
from kvrag.bench.qa_data import load_questions, passage_text

LANGCHAIN = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
             "answer the question. If you don't know the answer, just say that you don't know. Use three sentences "
             "maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--start", type=int, default=1, help="first question (1-based)")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--template", choices=("llamaindex", "langchain"), default="llamaindex")
    parser.add_argument("--earlier", choices=("reversed", "mixed"), default="reversed")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="JSONL: one row a question")
    args = parser.parse_args()

    from langchain_community.embeddings import HuggingFaceEmbeddings
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT_TMPL

    from kvrag.config import FuseConfig, GenerateConfig
    from kvrag.embedder import resolve_embedder
    from kvrag.indexing.kvgen import chunk_caches
    from kvrag.passages import PassageCache
    from kvrag.query.answer_plan import execute, plan_answer
    from kvrag.query.attempt import Attempt
    from kvrag.query.locate import chat_prompt, lay_out_prompt

    torch.set_num_threads(args.threads)
    items = load_questions(args.data, args.start + args.n - 1)[args.start - 1:]
    texts = list(dict.fromkeys(passage_text(c) for item in items for c in item["ctxs"]))
    store = FAISS.from_documents([Document(page_content=t) for t in texts],
                                 HuggingFaceEmbeddings(model_name=resolve_embedder(None)))
    rng = random.Random(0)
    generate = GenerateConfig(args.max_new_tokens)
    asked = Attempt.of(FuseConfig(mode="probe", ratio=args.ratio))

    def prompt(question: str, passages: list[str]) -> str:
        context = "\n\n".join(passages)
        text = (DEFAULT_TEXT_QA_PROMPT_TMPL.format(context_str=context, query_str=question)
                if args.template == "llamaindex" else LANGCHAIN.format(question=question, context=context))
        return chat_prompt(cache.lm.tokenizer, text)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder, open(args.out, "w") as out:
        cache = PassageCache.open(args.model, f"file://{folder}/c?max_bytes=20GB")
        ctx = cache.context
        for i, item in enumerate(items):
            question, other = item["question"], items[(i + 1) % len(items)]["question"]
            passages = [d.page_content for d in store.similarity_search(question, k=args.k)]
            if args.earlier == "reversed":
                earlier = passages[::-1]
            else:
                extra = [d.page_content for d in store.similarity_search(other, k=args.k)
                         if d.page_content not in passages]
                earlier = passages[:args.k // 2] + extra[:args.k - args.k // 2]
                rng.shuffle(earlier)
            target, before = prompt(question, passages), prompt(other, earlier)
            cache.answer_prompt(before, max_new_tokens=1)  # stores the passages' rows in it
            cache.flush()
            ctx.heads.clear_prompts()
            # the earlier prompt's caches, each keyed after its neighbour there, placed wherever the target has them
            found, _, _ = cache._lookup(before, cache.passages_in(before))
            laid = lay_out_prompt(ctx, target, found)
            read = [j for j, c in enumerate(laid.chunks) if c is not None]  # each piece read, prefilled alone
            alone = dict(chunk_caches(cache.lm, cache.prefix, [laid.piece_ids[j].tolist() for j in read]))
            caches: list[Any] = [None] * len(laid.chunks)
            for n, j in enumerate(read):
                caches[j] = alone[n]
            row = {"id": item["id"], "golds": item["answers"], "passages_read": len(read),
                   "full": cache.answer_prompt(target, "full", max_new_tokens=args.max_new_tokens).text,
                   "rows": execute(ctx, laid, plan_answer(laid, asked, None)).generate(generate).text,
                   "alone": execute(ctx, laid, plan_answer(laid, asked, None), caches).generate(generate).text}
            for run in ("full", "rows", "alone"):
                row[f"{run}_right"] = metrics.is_right(row[run], item["answers"])
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
        cache.close()
    for run in ("rows", "alone"):
        agreement = sum(metrics.agreement(r[run], r["full"]) for r in rows) / len(rows)
        print(json.dumps({"run": run, "questions": len(rows), "agreement": round(agreement, 3),
                          "same_as_full": sum(r[run] == r["full"] for r in rows),
                          "right": sum(r[f"{run}_right"] for r in rows),
                          "full_right": sum(r["full_right"] for r in rows),
                          "wrong_where_full_right": sum(r["full_right"] and not r[f"{run}_right"] for r in rows)}))


if __name__ == "__main__":
    main()
