"""kvrag's LLM swapped into a user's own LangChain RAG chain, no kvrag index: TTFT and answers beside a full prefill.

What a user with a pipeline already has does: their documents, their splitter (``RecursiveCharacterTextSplitter``),
their vector store (``FAISS`` from langchain-community over ``HuggingFaceEmbeddings`` of all-MiniLM-L6-v2), the
LangChain tutorial's chain ``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
| StrOutputParser()`` with its ``format_docs`` and the documented RAG prompt, and only the LLM swapped:
``KVCachedLLM(model=..., cache="file://...")``. The full prefill is ``KVCachedLLM(rag=llm.rag, mode="full")``, the
same model and prompt.

The corpus is every passage of the selected questions. The first selected question warms up (loads, fits the codec
state) and is not counted. Then, per question, over a passage cache of its own (a new folder; the model's codec
state and the template heads kept in memory are shared, as in one long-lived process): the default LLM on passages
it has never seen (``first``), the caches stored (``flush``), ``full`` and the default again (``repeat``, the same
passages now cached: stored after the first answer, and kept decoded in the process's memory tier), then once more
with that tier emptied (``cold``: the passages' blobs read from disk and decoded, as in a new process); ``full``
comes before ``first`` on every other question. TTFT is wall-clock from ``chain.stream`` to the first non-blank
piece.
Right: gold F1 >= 0.5 or a normalised gold answer contained in the answer (`kvrag.bench.metrics.is_right`).

    python benchmarks/any-retriever/run.py --data benchmarks/data/musique_hipporag100.jsonl --start 51 --n 12 \
        --k 20 --threads 2 --out benchmarks/any-retriever/musique-report
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvrag.bench import metrics
from kvrag.bench.qa_data import load_questions, passage_text

RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, just say that you don't know. Use three "
              "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")


RUNS = ("full", "first", "repeat", "cold")


def format_docs(docs: Iterable[Any]) -> str:
    """The LangChain tutorial's ``format_docs``."""
    return "\n\n".join(doc.page_content for doc in docs)


def build_chain(retriever: Any, llm: Any) -> Any:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = PromptTemplate.from_template(RAG_PROMPT)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


def timed(chain: Any, llm: Any, question: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft, parts = math.nan, []
    for piece in chain.stream(question):
        if math.isnan(ttft) and piece.strip():
            ttft = time.perf_counter() - t0
        parts.append(piece)
    answer = llm.last_answer
    return {"answer": "".join(parts).strip(), "ttft_s": ttft, "prompt_tokens": answer.n_prompt_tokens,
            "passages_read": len(answer.chunks), "answered_mode": answer.mode}


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str, run: str) -> float:
        return statistics.median(r[run][key] for r in rows)

    full_right = [r for r in rows if r["full"]["right"]]
    out: dict[str, Any] = {"questions": len(rows), "median_prompt_tokens": med("prompt_tokens", "full")}
    for run in RUNS:
        out[run] = {"right": sum(r[run]["right"] for r in rows),
                    "wrong_where_full_right": sum(not r[run]["right"] for r in full_right),
                    "median_ttft_s": med("ttft_s", run), "median_passages_read": med("passages_read", run)}
    out["first_over_full"] = statistics.median(r["first"]["ttft_s"] / r["full"]["ttft_s"] for r in rows)
    out["full_over_repeat"] = statistics.median(r["full"]["ttft_s"] / r["repeat"]["ttft_s"] for r in rows)
    out["full_over_cold"] = statistics.median(r["full"]["ttft_s"] / r["cold"]["ttft_s"] for r in rows)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--start", type=int, default=1, help="first question (1-based); the one before warms up")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--cache", default=None, help="cache URL (default: a temporary folder)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    from kvrag.integrations.langchain import KVCachedLLM
    from langchain_community.embeddings import HuggingFaceEmbeddings
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from kvrag.embedder import resolve_embedder
    from kvrag.passages import PassageCache, open_cache_store

    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_questions(args.data, args.start + args.n - 1)[max(args.start - 2, 0):]
    docs = [Document(page_content=passage_text(c)) for item in items for c in item["ctxs"]]
    chunks = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=0).split_documents(docs)
    store = FAISS.from_documents(chunks, HuggingFaceEmbeddings(model_name=resolve_embedder(None)))
    retriever = store.as_retriever(search_kwargs={"k": args.k})
    with tempfile.TemporaryDirectory() as folder:
        llm = KVCachedLLM(model=args.model, cache=args.cache or f"file://{folder}/warm-up?max_bytes=20GB",
                          max_new_tokens=args.max_new_tokens)
        full = KVCachedLLM(rag=llm.rag, mode="full", max_new_tokens=args.max_new_tokens)
        chain, full_chain = build_chain(retriever, llm), build_chain(retriever, full)
        if args.start > 1:  # warm-up: loads everything and fits the codec state
            timed(chain, llm, items[0]["question"])
            timed(full_chain, full, items[0]["question"])
            llm.rag.flush()
            items = items[1:]
        rows, info = [], {"looked_up": 0, "found": 0, "stored": 0, "stored_bytes": 0}
        warm = llm.rag
        for turn, item in enumerate(items):
            own = PassageCache(warm.lm, open_cache_store(f"file://{folder}/q{turn}?max_bytes=20GB"))
            own.context.heads = warm.context.heads  # one long-lived process: the template's head kept, as in use
            llm, full = KVCachedLLM(rag=own, max_new_tokens=args.max_new_tokens), \
                KVCachedLLM(rag=own, mode="full", max_new_tokens=args.max_new_tokens)
            chain, full_chain = build_chain(retriever, llm), build_chain(retriever, full)
            row: dict[str, Any] = {"id": item["id"], "question": item["question"], "golds": item["answers"]}
            if turn % 2:
                row["full"] = timed(full_chain, full, item["question"])
            row["first"] = timed(chain, llm, item["question"])
            llm.rag.flush()
            if not turn % 2:
                row["full"] = timed(full_chain, full, item["question"])
            row["repeat"] = timed(chain, llm, item["question"])
            own.kvstore.decoded.clear()  # as in a new process: the passages' blobs read and decoded again
            row["cold"] = timed(chain, llm, item["question"])
            for run in RUNS:
                row[run]["right"] = metrics.is_right(row[run]["answer"], item["answers"])
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("id", *RUNS)}, default=str)[:500], flush=True)
            for key, value in own.info().items():
                if key in info:
                    info[key] += value
            own.close()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "rows.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    info["hit_rate"] = info["found"] / info["looked_up"] if info["looked_up"] else None
    summary = {"run": {k: str(v) for k, v in vars(args).items()}, "cache": info, **summarise(rows)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
