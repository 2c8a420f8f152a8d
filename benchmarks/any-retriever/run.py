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
it has never seen (``first``), the caches stored (``flush``), ``full``, and the default again (``repeat``: the same
prompt, read from the rows of the first answer's prompt, which the gate kept). Then the question reworded
(``reworded``, ``"In a few words: "`` before it, through the same retriever) beside its own full prefill
(``full_reworded``): the passages now cached, and read from the first prompt's kept rows only where that prompt
holds them (a context-first template, the same passages retrieved). Then the first prompt fused from the passages'
stored caches with the kept prompts forgotten (``fused``: decoded in the process's memory tier), and once more with
that tier emptied too (``cold``: the blobs read from disk and decoded, as in a new process); each passage's cache holds
its rows in the first prompt (`kvrag.passages.prompt_rows`), so these two read the same prompt back from the store,
in place (the gate's ``stored`` plan).
Last, ``new_prompt``: a new cache of the passages stored by another prompt (the reworded question, the retrieved
passages in the reverse order: every passage after other neighbours, at another place), then the question's prompt
fused from them. ``full`` comes before
``first`` on every other question. TTFT is wall-clock from ``chain.stream`` to the first non-blank piece.
Right: gold F1 >= 0.5 or a normalised gold answer contained in the answer (`kvrag.bench.metrics.is_right`).

``--codec`` stores the passage caches with another codec (default: a passage cache's, ``int8``).
``--framework llamaindex`` runs LlamaIndex's default instead: the user's ``VectorStoreIndex`` over
``SentenceSplitter`` nodes (the same embedding model), ``index.as_query_engine(llm=..., similarity_top_k=K,
streaming=True)`` with its default text-QA template (the context before the question). ``--bf16-reference`` adds
``full_bf16``: the same prompt prefilled in full by the same model with bfloat16 weights, a second model in the same
process. It tells a right answer that a full prefill gives robustly from one that a perturbation this small
already changes; the summary counts both.

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
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvrag.bench import metrics
from kvrag.bench.qa_data import load_questions, passage_text

RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, just say that you don't know. Use three "
              "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")


RUNS = ("full", "first", "repeat", "reworded", "full_reworded", "fused", "cold", "new_prompt")
REWORD = "In a few words: {question}"
REFERENCE = {"reworded": "full_reworded"}  # the full prefill a run's answers and TTFT compare with (else ``full``)


def format_docs(docs: Iterable[Any]) -> str:
    """The LangChain tutorial's ``format_docs``."""
    return "\n\n".join(doc.page_content for doc in docs)


def build_chain(retriever: Any, llm: Any, reverse: bool = False) -> Any:
    """The tutorial's chain; ``reverse``: the retrieved documents in the reverse order (another prompt of them)."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    prompt = PromptTemplate.from_template(RAG_PROMPT)
    docs = retriever | RunnableLambda(lambda found: found[::-1]) if reverse else retriever
    return {"context": docs | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


class LlamaIndexChain:
    """LlamaIndex's default query engine over the user's index, streaming, with ``stream`` as a LangChain chain has."""

    def __init__(self, index: Any, llm: Any, k: int, reverse: bool = False) -> None:
        from llama_index.core.postprocessor.types import BaseNodePostprocessor

        class Reversed(BaseNodePostprocessor):  # type: ignore[misc]
            def _postprocess_nodes(self, nodes: list[Any], query_bundle: Any = None) -> list[Any]:
                return nodes[::-1]

        post = [Reversed()] if reverse else []
        self.engine = index.as_query_engine(llm=llm, similarity_top_k=k, streaming=True, node_postprocessors=post)

    def stream(self, question: str) -> Iterable[str]:
        yield from self.engine.query(question).response_gen


def llamaindex_index(texts: Sequence[str]) -> Any:
    """The user's ``VectorStoreIndex``: ``SentenceSplitter`` nodes embedded by all-MiniLM-L6-v2."""
    from langchain_community.embeddings import HuggingFaceEmbeddings
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.node_parser import SentenceSplitter

    from kvrag.embedder import resolve_embedder

    model = HuggingFaceEmbeddings(model_name=resolve_embedder(None))

    class MiniLM(BaseEmbedding):  # type: ignore[misc]
        def _get_query_embedding(self, query: str) -> list[float]:
            return list(model.embed_query(query))

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return list(model.embed_documents([text])[0])

    return VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=MiniLM(),
                                           transformations=[SentenceSplitter()])


def timed(chain: Any, llm: Any, question: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft, parts = math.nan, []
    for piece in chain.stream(question):
        if math.isnan(ttft) and piece.strip():
            ttft = time.perf_counter() - t0
        parts.append(piece)
    answer = llm.last_answer
    return {"answer": "".join(parts).strip(), "ttft_s": ttft, "prompt_tokens": answer.n_prompt_tokens,
            "passages_read": len(answer.chunks), "answered_mode": answer.mode,
            "gate": answer.gate.decision if answer.gate is not None else None}


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str, run: str) -> float:
        return statistics.median(r[run][key] for r in rows)

    out: dict[str, Any] = {"questions": len(rows), "median_prompt_tokens": med("prompt_tokens", "full")}
    bf16 = bool(rows) and "full_bf16" in rows[0]
    for run in (*RUNS, "full_bf16") if bf16 else RUNS:
        ref = REFERENCE.get(run, "full")
        full_right = [r for r in rows if r[ref]["right"]]
        out[run] = {"right": sum(r[run]["right"] for r in rows),
                    "wrong_where_full_right": sum(not r[run]["right"] for r in full_right),
                    "same_answer_as_full": sum(r[run]["answer"] == r[ref]["answer"] for r in rows),
                    "median_ttft_s": med("ttft_s", run), "median_passages_read": med("passages_read", run),
                    "gate": dict(Counter(str(r[run]["gate"]) for r in rows))}
        if run != ref:
            out[run]["full_over_run"] = statistics.median(r[ref]["ttft_s"] / r[run]["ttft_s"] for r in rows)
        if bf16:
            robust = [r for r in full_right if r["full_bf16"]["right"]]
            out[run]["wrong_where_full_and_full_bf16_right"] = sum(not r[run]["right"] for r in robust)
            out[run]["same_answer_as_full_bf16"] = sum(r[run]["answer"] == r["full_bf16"]["answer"] for r in rows)
    return out


def user_pipeline(framework: str, texts: Sequence[str], k: int) -> Callable[..., Any]:
    """The user's retrieval over ``texts`` (``k`` passages a question): a function from an LLM (and ``reverse``, the
    passages in the reverse order) to its chain.
    """
    if framework == "llamaindex":
        user_index = llamaindex_index(texts)
        return lambda llm, reverse=False: LlamaIndexChain(user_index, llm, k, reverse)
    from langchain_community.embeddings import HuggingFaceEmbeddings
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from kvrag.embedder import resolve_embedder

    docs = [Document(page_content=text) for text in texts]
    chunks = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=0).split_documents(docs)
    store = FAISS.from_documents(chunks, HuggingFaceEmbeddings(model_name=resolve_embedder(None)))
    retriever = store.as_retriever(search_kwargs={"k": k})
    return lambda llm, reverse=False: build_chain(retriever, llm, reverse)


def llm_class(framework: str) -> Any:
    """kvrag's LLM for ``framework``."""
    if framework == "llamaindex":
        from kvrag.integrations.llama_index import KVCachedLLM as LlamaIndexLLM

        return LlamaIndexLLM
    from kvrag.integrations.langchain import KVCachedLLM

    return KVCachedLLM


def new_prompt(lm: Any, heads: Any, chain_of: Callable[..., Any], cache: str, question: str, reworded: str,
               max_new_tokens: int, llm_class: Any) -> dict[str, Any]:
    """The question's prompt fused from caches that another prompt stored: a new cache first answers the reworded
    question over the same retriever with the passages in the reverse order (not counted), then the question.
    """
    from kvrag.passages import PassageCache

    with PassageCache.open(lm, cache) as other:
        other.heads = heads  # before its first answer
        llm = llm_class(rag=other, max_new_tokens=max_new_tokens)
        timed(chain_of(llm, reverse=True), llm, reworded)
        other.flush()
        heads.clear_prompts()
        return timed(chain_of(llm), llm, question)


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
    parser.add_argument("--dtype", default=None, help="the model's weights (default: kvrag's for the device)")
    parser.add_argument("--codec", default=None, help="the passage caches' codec (default: a passage cache's)")
    parser.add_argument("--framework", choices=("langchain", "llamaindex"), default="langchain")
    parser.add_argument("--bf16-reference", action="store_true", help="add full_bf16 (see the module docstring)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    from kvrag.codec import make_codec
    from kvrag.passages import PassageCache, open_cache_store
    from kvrag.passages.cache import PASSAGE_CODEC

    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_questions(args.data, args.start + args.n - 1)[max(args.start - 2, 0):]
    texts = [passage_text(c) for item in items for c in item["ctxs"]]
    chain_of = user_pipeline(args.framework, texts, args.k)
    KVCachedLLM = llm_class(args.framework)  # noqa: N806
    with tempfile.TemporaryDirectory() as folder:
        bf16 = None
        if args.bf16_reference:  # a second model, bfloat16 weights, prefilling every prompt in full
            bf16 = KVCachedLLM(rag=PassageCache.open(args.model, f"file://{folder}/bf16", dtype="bfloat16"),
                               mode="full", max_new_tokens=args.max_new_tokens)
        warm_up = PassageCache.open(args.model, args.cache or f"file://{folder}/warm-up?max_bytes=20GB",
                                    dtype=args.dtype, codec=args.codec)
        llm = KVCachedLLM(rag=warm_up, max_new_tokens=args.max_new_tokens)
        full = KVCachedLLM(rag=llm.rag, mode="full", max_new_tokens=args.max_new_tokens)
        chain, full_chain = chain_of(llm), chain_of(full)
        if args.start > 1:  # warm-up: loads everything and fits the codec state
            timed(chain, llm, items[0]["question"])
            timed(full_chain, full, items[0]["question"])
            llm.rag.flush()
            items = items[1:]
        rows, info = [], {"looked_up": 0, "found": 0, "stored": 0, "stored_bytes": 0}
        warm = llm.rag
        for turn, item in enumerate(items):
            own = PassageCache(warm.lm, open_cache_store(f"file://{folder}/q{turn}?max_bytes=20GB"),
                               make_codec(args.codec or PASSAGE_CODEC))
            own.heads = warm.heads  # (before its first answer) one long-lived process: the template's head kept
            llm, full = KVCachedLLM(rag=own, max_new_tokens=args.max_new_tokens), \
                KVCachedLLM(rag=own, mode="full", max_new_tokens=args.max_new_tokens)
            chain, full_chain = chain_of(llm), chain_of(full)
            row: dict[str, Any] = {"id": item["id"], "question": item["question"], "golds": item["answers"]}
            question, reworded = item["question"], REWORD.format(question=item["question"])
            if turn % 2:
                row["full"] = timed(full_chain, full, question)
            row["first"] = timed(chain, llm, question)
            llm.rag.flush()
            if not turn % 2:
                row["full"] = timed(full_chain, full, question)
            row["repeat"] = timed(chain, llm, question)
            row["full_reworded"] = timed(full_chain, full, reworded)
            row["reworded"] = timed(chain, llm, reworded)
            llm.rag.flush()
            own.heads.clear_prompts()  # the first prompt fused from the passages' stored caches
            row["fused"] = timed(chain, llm, question)
            own.heads.clear_prompts()
            own.kvstore.decoded.clear()  # as in a new process: the passages' blobs read and decoded again
            row["cold"] = timed(chain, llm, question)
            row["new_prompt"] = new_prompt(own.lm, warm.heads, chain_of,
                                           f"file://{folder}/q{turn}-new?max_bytes=20GB&codec={own.kvstore.codec.name}",
                                           question, reworded, args.max_new_tokens, KVCachedLLM)
            if bf16 is not None:
                row["full_bf16"] = timed(chain_of(bf16), bf16, question)
            for run in row.keys() & {*RUNS, "full_bf16"}:
                row[run]["right"] = metrics.is_right(row[run]["answer"], item["answers"])
            rows.append(row)
            print(json.dumps({k: row[k] for k in row if k not in ("question", "golds")}, default=str)[:700], flush=True)
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
