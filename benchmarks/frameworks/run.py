"""Answer correctness and time to first token through LangChain and LlamaIndex, as a new user builds them.

Public API only. One index over the selected questions' passages (one passage = one chunk, `kvrag.bench.qa_data`),
built in a temporary folder unless ``--index`` names one. Three pipelines retrieve ``--k`` chunks from it and
answer, each at its default and with ``mode="full"`` (a full prefill of the same prompt):

- ``langchain``: the LangChain tutorial's RAG chain, ``{"context": retriever | format_docs, "question":
  RunnablePassthrough()} | prompt | llm | StrOutputParser()``, with the tutorial's own ``format_docs`` (passages
  joined by a blank line), the documented RAG prompt (the hub's ``rlm/rag-prompt``) as a `PromptTemplate`,
  ``KVRetriever(rag=rag, k=K)`` and ``KVCachedLLM(rag=rag)`` (``mode="full"`` for full).
- ``llamaindex``: ``RetrieverQueryEngine.from_args(KVRetriever(rag, k=K), llm=KVCachedLLM(rag=rag),
  streaming=True)`` with LlamaIndex's default text-QA template.
- ``api``: ``rag.stream(question, k=K)`` and ``rag.stream(question, k=K, mode="full")``, for reference.

Greedy decoding, ``--max-new-tokens`` per answer. One warm-up question (the first selected) is answered by every
pipeline and mode first and not counted; then each question is answered by all six (pipeline, mode) pairs, in an
order that rotates per question. TTFT is wall-clock time from the call to the first streamed text piece that holds
more than whitespace, measured here the same way for every pipeline (kvrag's own `Answer.ttft_s` is kept in the
metadata). Right: gold token F1 >= 0.5, or a normalised gold answer contained in the answer. Agrees: the default
answer's text equals the full answer's for the same pipeline and question.

    python benchmarks/frameworks/run.py --data benchmarks/data/single_fact.jsonl --start 1 --n 20 --k 4 \
        --threads 2 --out DIR

Writes ``rows.jsonl`` (one row per question, pipeline and mode), ``summary.json`` and ``summary.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import build_index, load_questions

PIPELINES = ("langchain", "llamaindex", "api")
MODES = ("default", "full")
# LangChain's documented RAG prompt (the hub's rlm/rag-prompt).
RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, just say that you don't know. Use three "
              "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
RIGHT_RULE = "gold F1 >= 0.5, or a normalised gold answer contained in the answer"


def format_docs(docs: Iterable[Any]) -> str:
    """The LangChain tutorial's ``format_docs``: page contents joined by a blank line."""
    return "\n\n".join(doc.page_content for doc in docs)


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON data: NaN and infinities as None, objects with ``to_json`` through it, other
    unknown objects as their ``str``.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    to_json = getattr(value, "to_json", None)
    return jsonable(to_json()) if callable(to_json) else str(value)


def answer_metadata(answer: Any) -> dict[str, Any]:
    """What a kvrag `Answer` reports besides its text (mode, TTFT, timings, chunks, gate, ...); {} for None."""
    if answer is None:
        return {}
    data = jsonable(answer)
    return {k: v for k, v in data.items() if k != "answer"} if isinstance(data, dict) else {"answer": data}


@dataclass
class Pipeline:
    """One (pipeline, mode) pair: ``pieces`` streams an answer's text; ``report`` then gives what the LLM
    exposed about that call as ``(prompt tokens or None, metadata)``.
    """

    name: str
    mode: str
    pieces: Callable[[str], Iterator[str]]
    report: Callable[[], tuple[int | None, dict[str, Any]]]


def prompt_tokens(metadata: dict[str, Any]) -> int | None:
    value = metadata.get("prompt_tokens")
    return value if isinstance(value, int) else None


def chunks_used(metadata: dict[str, Any]) -> int | None:
    """How many stored chunk caches the answer used (``chunk_ids`` or ``chunks`` in the metadata), if reported."""
    for key in ("chunk_ids", "chunks"):
        if isinstance(metadata.get(key), list):
            return len(metadata[key])
    return None


def mode_settings(mode: str) -> dict[str, Any]:
    """The LLM's (or `KVRag.stream`'s) settings for a mode label: ``default`` (none), ``full``, or ``NAME@RATIO``
    (a fixed mode at a ratio, no gate).
    """
    if mode == "default":
        return {}
    name, _, ratio = mode.partition("@")
    return {"mode": name, **({"ratio": float(ratio)} if ratio else {})}


def langchain_pipeline(rag: Any, k: int, mode: str, max_new_tokens: int) -> Pipeline:
    """The LangChain tutorial chain; its LLM's ``generation_info`` is caught by a callback's ``on_llm_end``."""
    from kvrag.integrations.langchain import KVCachedLLM, KVRetriever
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    class GenerationInfo(BaseCallbackHandler):
        """Keeps the ``generation_info`` of the last LLM call's first generation."""

        def __init__(self) -> None:
            self.info: dict[str, Any] = {}

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            generations = getattr(response, "generations", None) or [[]]
            first = generations[0][0] if generations[0] else None
            self.info = dict(getattr(first, "generation_info", None) or {})

    options = mode_settings(mode)
    retriever = KVRetriever(rag=rag, k=k)
    llm = KVCachedLLM(rag=rag, max_new_tokens=max_new_tokens, **options)
    prompt = PromptTemplate.from_template(RAG_PROMPT)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    handler = GenerationInfo()

    def pieces(question: str) -> Iterator[str]:
        handler.info = {}
        return iter(chain.stream(question, config={"callbacks": [handler]}))

    def report() -> tuple[int | None, dict[str, Any]]:
        info = jsonable(handler.info)
        return prompt_tokens(info), info

    return Pipeline("langchain", mode, pieces, report)


def llamaindex_pipeline(rag: Any, k: int, mode: str, max_new_tokens: int) -> Pipeline:
    """``RetrieverQueryEngine.from_args`` over kvrag's retriever and LLM, streaming; the metadata is the
    LLM's ``last_answer`` (the kvrag `Answer` of the call).
    """
    from kvrag.integrations.llama_index import KVCachedLLM, KVRetriever
    from llama_index.core.base.response.schema import StreamingResponse
    from llama_index.core.query_engine import RetrieverQueryEngine

    options = mode_settings(mode)
    llm = KVCachedLLM(rag=rag, max_new_tokens=max_new_tokens, **options)
    engine = RetrieverQueryEngine.from_args(KVRetriever(rag, k=k), llm=llm, streaming=True)

    def pieces(question: str) -> Iterator[str]:
        llm.last_answer = None
        response = engine.query(question)
        if not isinstance(response, StreamingResponse):
            raise TypeError(f"a streaming query engine returned {type(response).__name__}")
        return iter(response.response_gen)

    def report() -> tuple[int | None, dict[str, Any]]:
        info = answer_metadata(llm.last_answer)
        return prompt_tokens(info), info

    return Pipeline("llamaindex", mode, pieces, report)


def api_pipeline(rag: Any, k: int, mode: str, max_new_tokens: int) -> Pipeline:
    """``rag.stream`` (``mode="full"`` for full); the metadata is ``rag.last_answer``."""
    options = mode_settings(mode)

    def pieces(question: str) -> Iterator[str]:
        rag.last_answer = None
        return rag.stream(question, k=k, max_new_tokens=max_new_tokens, **options)

    def report() -> tuple[int | None, dict[str, Any]]:
        info = answer_metadata(rag.last_answer)
        return prompt_tokens(info), info

    return Pipeline("api", mode, pieces, report)


BUILDERS = {"langchain": langchain_pipeline, "llamaindex": llamaindex_pipeline, "api": api_pipeline}


def timed_answer(pipeline: Pipeline, question: str) -> dict[str, Any]:
    """Stream one answer: its text (pieces joined, trimmed), TTFT to the first piece that holds more than
    whitespace, total time, and what the LLM reported.
    """
    t0 = time.perf_counter()
    ttft, parts = float("nan"), []
    for piece in pipeline.pieces(question):
        if math.isnan(ttft) and piece.strip():
            ttft = time.perf_counter() - t0
        parts.append(piece)
    total = time.perf_counter() - t0
    tokens, info = pipeline.report()
    return {"answer": "".join(parts).strip(), "ttft_s": ttft, "total_s": total, "prompt_tokens": tokens,
            "chunks_used": chunks_used(info), "answered_mode": info.get("mode"), "metadata": info}


def run_question(pipelines: Sequence[Pipeline], item: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """Answer ``item`` with every pipeline, starting at ``pipelines[turn % len]``; rows in ``pipelines``' order."""
    start = turn % len(pipelines)
    order = list(pipelines[start:]) + list(pipelines[:start])
    rows = {}
    for position, p in enumerate(order):
        rows[(p.name, p.mode)] = {"id": item["id"], "pipeline": p.name, "mode": p.mode, "position": position,
                                  **timed_answer(p, item["question"])}
    for row in rows.values():
        full = rows[(row["pipeline"], "full")]["answer"]
        row["right"] = metrics.is_right(row["answer"], item["answers"])
        row["agrees_with_full"] = row["answer"] == full
        row["agreement_f1"] = metrics.agreement(row["answer"], full)
        row["golds"] = list(item["answers"])
    return [rows[(p.name, p.mode)] for p in pipelines]


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pipeline and mode other than full: right answers beside full's, wrong where full is right, agreement
    with full, TTFT.
    """
    out = []
    modes = list(dict.fromkeys(r["mode"] for r in rows if r["mode"] != "full"))
    for name, mode in ((n, m) for n in PIPELINES for m in modes):
        default = {r["id"]: r for r in rows if r["pipeline"] == name and r["mode"] == mode}
        full = {r["id"]: r for r in rows if r["pipeline"] == name and r["mode"] == "full"}
        if not default:
            continue
        ttft_d = [r["ttft_s"] for r in default.values() if not math.isnan(r["ttft_s"])]
        ttft_f = [r["ttft_s"] for r in full.values() if not math.isnan(r["ttft_s"])]
        tokens = [r["prompt_tokens"] for r in default.values() if r["prompt_tokens"] is not None]
        used = [r["chunks_used"] for r in default.values() if r["chunks_used"] is not None]
        out.append({
            "pipeline": name, "mode": mode, "n": len(default),
            "right_default": sum(r["right"] for r in default.values()),
            "right_full": sum(r["right"] for r in full.values()),
            "default_wrong_full_right": sum(not r["right"] and full[i]["right"] for i, r in default.items()),
            "agreement": sum(r["agrees_with_full"] for r in default.values()) / len(default),
            "agreement_f1": _mean([metrics.agreement(r["answer"], full[i]["answer"]) for i, r in default.items()]),
            "ttft_mean_default_s": _mean(ttft_d), "ttft_mean_full_s": _mean(ttft_f),
            "ttft_median_default_s": _median(ttft_d), "ttft_median_full_s": _median(ttft_f),
            "speedup_mean": _mean(ttft_f) / _mean(ttft_d) if ttft_d else float("nan"),
            "speedup_median": _median(ttft_f) / _median(ttft_d) if ttft_d else float("nan"),
            "total_mean_default_s": _mean([r["total_s"] for r in default.values()]),
            "total_mean_full_s": _mean([r["total_s"] for r in full.values()]),
            "prompt_tokens_mean": _mean(tokens), "chunks_used_mean_default": _mean(used),
            "default_answered_full": sum(r["answered_mode"] == "full" for r in default.values()),
        })
    return out


def _count(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "–"


def summary_markdown(summary: Sequence[dict[str, Any]], run: dict[str, Any]) -> str:
    """The summary as a Markdown table (one line per pipeline) under the run's settings and machine."""
    headers = ["pipeline", "mode", "n", "right", "right full", "wrong where full is right", "same text as full",
               "agreement (token F1)", "TTFT mean (s)", "TTFT mean full (s)", "TTFT median (s)",
               "TTFT median full (s)", "speedup full÷mode (mean)", "speedup (median)", "prompt tokens",
               "caches used", "answered by full prefill"]
    table = common.markdown_table(headers, [
        [s["pipeline"], s.get("mode", "default"), s["n"], s["right_default"], s["right_full"],
         s["default_wrong_full_right"], f"{s['agreement']:.0%}", f"{s['agreement_f1']:.3f}",
         s["ttft_mean_default_s"], s["ttft_mean_full_s"], s["ttft_median_default_s"], s["ttft_median_full_s"],
         f"{s['speedup_mean']:.2f}×", f"{s['speedup_median']:.2f}×", _count(s["prompt_tokens_mean"], 0),
         _count(s["chunks_used_mean_default"], 1), s["default_answered_full"]]
        for s in summary])
    hw = run["hardware"]
    return (f"# Frameworks: {run['data']} questions {run['questions']}, k={run['k']}\n\n"
            f"Machine: {hw['platform']}, {hw['cpu']}, {hw['cpu_count']} CPUs, torch threads {hw['torch_threads']} "
            f"(--threads {run['threads']}). Max new tokens {run['max_new_tokens']}, index built in "
            f"{run['index_build_s']:.1f} s. Right: {RIGHT_RULE}.\n\n{table}\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="benchmarks/data/single_fact.jsonl", help="QA JSONL file")
    p.add_argument("--start", type=int, default=1, help="first question (1-based)")
    p.add_argument("--n", type=int, default=20, help="questions from --start on")
    p.add_argument("--k", type=int, default=4, help="chunks each pipeline retrieves")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-chunk-tokens", type=int, default=2048, help="a passage over this is split")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--codec", default=None, help="the caches' codec (default: kvrag's, as a user's index)")
    p.add_argument("--index", default=None, help="build the index here (default: a temporary folder)")
    p.add_argument("--pipelines", default=",".join(PIPELINES), help="a comma list of " + ", ".join(PIPELINES))
    p.add_argument("--variants", default="", help="more modes to run beside default and full, a comma list of "
                   "NAME@RATIO (a fixed mode, no gate), e.g. probe@0.3,cacheblend@0.15")
    p.add_argument("--out", required=True)
    p.add_argument("--summarise", action="store_true", help="only recompute --out's summaries from its rows.jsonl")
    args = p.parse_args(argv)
    if args.start < 1 or args.n < 1 or args.k < 1:
        p.error("--start, --n and --k must be >= 1")
    unknown = set(args.pipelines.split(",")) - set(PIPELINES)
    if unknown:
        p.error(f"--pipelines: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(PIPELINES)}")
    return args


def run(args: argparse.Namespace, index_dir: Path) -> dict[str, Any]:
    """Build the index, answer the warm-up and every selected question, and write the rows and summaries."""
    from kvrag.config import CodecConfig

    common.set_threads(args.threads)
    items = load_questions(Path(args.data), args.start - 1 + args.n)[args.start - 1:]
    if not items:
        raise SystemExit(f"{args.data} has fewer than {args.start} questions")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rag, build_s = build_index(args, items, index_dir, codec=args.codec or CodecConfig().name)
    with rag:
        names = [n for n in args.pipelines.split(",") if n]
        modes = [*MODES, *(v for v in args.variants.split(",") if v)]
        pipelines = [BUILDERS[name](rag, args.k, mode, args.max_new_tokens) for name in names for mode in modes]
        run_question(pipelines, items[0], 0)  # warm-up, not counted
        rows: list[dict[str, Any]] = []
        for turn, item in enumerate(items):
            t = time.perf_counter()
            rows += run_question(pipelines, item, turn)
            print(f"question {turn + 1}/{len(items)} {time.perf_counter() - t:.1f}s", flush=True)
    summary = summarise(rows)
    payload = {**common.stamp(args), "data": args.data, "questions": f"{args.start}-{args.start + len(items) - 1}",
               "k": args.k, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "index_build_s": build_s, "right_rule": RIGHT_RULE, "summary": summary}
    with open(out / "rows.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
    common.write_json(out / "summary.json", payload)
    (out / "summary.md").write_text(summary_markdown(summary, payload), encoding="utf-8")
    return payload


def resummarise(out: Path) -> dict[str, Any]:
    """Recompute ``summary.json`` and ``summary.md`` in ``out`` from its ``rows.jsonl`` (no model run)."""
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]
    payload = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    payload["summary"] = summarise(rows)
    common.write_json(out / "summary.json", payload)
    (out / "summary.md").write_text(summary_markdown(payload["summary"], payload), encoding="utf-8")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarise:
        payload = resummarise(Path(args.out))
        print(summary_markdown(payload["summary"], payload))
        return
    if args.index:
        payload = run(args, Path(args.index))
    else:
        with tempfile.TemporaryDirectory(prefix="kvrag-frameworks-") as tmp:
            payload = run(args, Path(tmp) / "index")
    print(summary_markdown(payload["summary"], payload))


if __name__ == "__main__":
    main()
