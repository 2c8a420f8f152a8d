"""Answer quality and TTFT of every fusion mode against full prefill, on a QA JSONL data set.

One index is built over the passages of the selected questions (one passage = one chunk); each
question is then answered by every mode over exactly its own passages, in dataset order, with greedy
decoding. Modes are interleaved per question (the start rotates) so that machine drift hits all of
them alike; every ratio is against ``full`` measured in the same run (DESIGN decision 8).

Outputs in ``--out``: ``quality.json`` (per-question rows, per-mode summary, hardware, versions,
command), ``quality.md`` (the summary table) and ``quality_pareto.png`` (agreement vs speedup).
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import build_index, load_questions, passage_keys
from kvrag.bench.quality_report import (
    paired,
    paired_markdown,
    pareto_plot,
    summarise,
    summary_markdown,
)
from kvrag.config import GenerateConfig
from kvrag.model import load_model
from kvrag.query.gate import read_signals
from kvrag.rag import KVRag

log = logging.getLogger(__name__)


def precision_twin(rag: Any, dtype: str) -> Any:
    """A `KVRag` over the same index and prompt layout whose model is loaded in ``dtype``, for ``full``
    answers only (it reads no chunk cache: those were computed by the index's own model).
    """
    lm = load_model(rag.lm.source, dtype=dtype, device=str(rag.lm.device))
    return KVRag(rag.path, rag.index, lm, rag.embedder, rag.kvstore.codec, rag.layout, rag.batch_tokens)


def answer_row(
    rag: Any, item: dict[str, Any], keys: list[str], spec: common.ModeSpec, max_new_tokens: int,
    score_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One mode's answer; with ``score_ids`` (``full``'s answer) also their NLL under the same fusion."""
    cfg = spec.config
    selector = None
    if spec.selector_for is not None:  # chosen per question, outside the answer's timing
        selector = spec.selector_for(rag, item, cfg)
    fused = rag.prepare(item["question"], chunks=keys, fuse_config=cfg, selector=selector, gate=spec.gate)
    ans = fused.generate(GenerateConfig(max_new_tokens=max_new_tokens))
    gate = ans.gate.to_json() if ans.gate is not None else None
    # the gate's signals of this fused pass, kept for every mode so that gate settings can be compared afterwards
    signals = gate["attempts"][0]["signals"] if gate else read_signals(fused.fused).to_json()
    if score_ids is None:  # full's own answer: greedy decoding already saw each token's probability
        nll = -sum(ans.token_logprobs) / len(ans.token_logprobs) if ans.token_logprobs else math.nan
    else:  # full's answer scored on the very cache this mode answered from
        nll = fused.nll(score_ids)
    return {
        "id": item["id"],
        "mode": spec.label,
        "answer": ans.text,
        "token_ids": list(ans.token_ids),
        "golds": list(item["answers"]),
        "ttft_s": ans.ttft_s,
        "load_s": ans.timings["load_s"],
        "fuse_s": ans.timings["fuse_s"],
        "recompute_fraction": ans.recompute_fraction,
        "prompt_tokens": ans.n_prompt_tokens,
        "nll_full_answer": nll,
        "signals": signals,
        **({"gate": gate} if gate else {}),
        **metrics.gold_scores(ans.text, item["answers"]),
    }


def run_question(
    rag: Any, item: dict[str, Any], specs: list[common.ModeSpec], turn: int, max_new_tokens: int,
    twins: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Answer with ``full`` first, then with every other mode (rotated per question), each fused once.

    Agreement, first-token agreement and ΔNLL compare each mode with ``full``'s answer; a mode's NLL
    of that answer is measured on the cache it answered from (`FusedPrompt.nll`).
    ``twins`` maps a ``full@DTYPE`` mode's dtype to its `precision_twin`.
    """
    twins = twins or {}
    keys = passage_keys(rag, item)
    full = answer_row(rag, item, keys, specs[0], max_new_tokens)
    others = specs[1:]
    order = others[turn % len(others) :] + others[: turn % len(others)] if others else []
    rows = {specs[0].label: full}
    for spec in order:
        rows[spec.label] = answer_row(twins.get(spec.dtype or "", rag), item, keys, spec, max_new_tokens,
                                      full["token_ids"] or None)
    for spec in specs:
        row = rows[spec.label]
        row["agreement"] = metrics.agreement(row["answer"], full["answer"])
        row["first_token_agreement"] = metrics.first_token_agreement(row["token_ids"], full["token_ids"])
        row["delta_nll"] = row["nll_full_answer"] - full["nll_full_answer"] if spec is not specs[0] else 0.0
    return [rows[s.label] for s in specs]


# modes every other one is compared with question by question, where a run has them


def write_outputs(args: argparse.Namespace, items: list[dict[str, Any]], specs: list[common.ModeSpec],
                  rows: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    """Write ``quality.json``, ``quality.md`` and the Pareto plot for the rows so far; the table."""
    out = Path(args.out)
    summary = summarise(rows, specs)
    pairs = paired(rows, [s.label for s in specs])
    done = len({r["id"] for r in rows})
    payload = {
        **common.stamp(args),
        "data": args.data,
        "model": args.model,
        "n_questions": done,
        "n_planned": len(items),
        "max_new_tokens": args.max_new_tokens,
        "warmup": args.warmup,
        **extra,
        "summary": summary,
        "paired": pairs,
        "rows": rows,
    }
    common.write_json(out / "quality.json", payload)
    table = summary_markdown(summary)
    partial = "" if done == len(items) else f" (partial: {done} of {len(items)} questions so far)"
    context = extra.get("neighbour_context") or 0
    placed = " (their stored caches placed)" if extra.get("neighbour_kv") == "stored" else ""
    among = (f" among {extra['index_chunks']} indexed passages" if extra.get("neighbour_pool") else "")
    caches = (f"; chunk caches computed after each passage's {context} nearest passages{among}{placed}" if context
              else "; chunk caches computed after the prompt prefix")
    if extra.get("question_tail"):
        caches += f"; after each question: {extra['question_tail']!r}"
    (out / "quality.md").write_text(
        f"# kvrag bench quality\n\n`{payload['command']}`\n\n{done} questions from "
        f"`{Path(args.data).name}`{partial}, model `{args.model}`, mean prompt {summary[0]['prompt_tokens']:.0f} "
        f"tokens{caches}; CPU {payload['hardware']['cpu']} ({payload['hardware']['cpus_usable']} usable cores)."
        f"\n\n{table}\n"
        + (f"\nQuestion by question against a baseline mode (95 % bootstrap intervals of the mean difference; "
           f"\\|ΔNLL\\| below 0 is closer to `full`):\n\n{paired_markdown(pairs)}\n" if pairs else "")
    )
    pareto_plot(summary, out / "quality_pareto.png", f"{Path(args.data).name}, {done} q, {args.model}")
    return table


def run(args: argparse.Namespace) -> int:
    common.set_threads(args.threads)
    specs = common.with_fuse_settings(common.parse_modes(args.modes, quality=True), args.check_layers,
                                     first_ratio_scale=args.first_ratio_scale)
    items = load_questions(Path(args.data), args.n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-") as tmp:
        pool = [Path(p) for p in args.neighbour_pool.split(",") if p] if args.neighbour_pool else []
        rag, build_s = build_index(args, items, Path(args.index) if args.index else Path(tmp) / "index",
                                   args.neighbour_context, args.neighbour_kv, pool, args.question_tail)
        extra = {"index_chunks": len(rag.index), "index_build_s": build_s, "question_tail": rag.layout.question_tail,
                 "neighbour_pool": [str(p) for p in pool],
                 "neighbour_context": rag.neighbour_context,
                 "neighbour_kv": rag.neighbour_kv if rag.neighbour_context else None}
        twins = {s.dtype: precision_twin(rag, s.dtype) for s in specs if s.dtype}  # each model loaded once
        with rag:
            for item in items[: args.warmup]:
                run_question(rag, item, specs, 0, args.max_new_tokens, twins)
            rows: list[dict[str, Any]] = []
            table = ""
            for turn, item in enumerate(tqdm(items, desc="questions", unit="q", disable=None)):
                rows += run_question(rag, item, specs, turn, args.max_new_tokens, twins)
                table = write_outputs(args, items, specs, rows, extra)  # partial results survive an interruption
                log.info("question %d/%d done", turn + 1, len(items))
    print(table)
    return 0
