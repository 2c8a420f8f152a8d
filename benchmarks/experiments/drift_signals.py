"""Which signals of a fused pass tell an answer that parts from the full prefill's from one that holds.

For each question: its passages fused at ``--mode`` (``probe@0.15`` by default, the gate off) and prefilled in
full, under kvrag's own prompt (``api``) or a framework's template (``langchain``: the question before the passages;
``llamaindex``: after). Both answers are decoded greedily. Per question it records the candidate signals, all read
off the fused pass or its first decoding steps, and the label: whether the fused answer's first ``--horizon``
tokens differ from the full prefill's.

Signals: ``margin`` (the fused first token's log-probability lead), ``probe_kl`` (KL divergence of the fused
first-token distribution from the probe pass's: what recomputing the selection moved), ``probe_agrees``,
``unread_share`` (the probe's attention on stale tokens it did not pick, over its attention on all stale tokens),
``lookahead_margin`` (the smallest margin over the fused answer's first ``--horizon`` steps).

    python benchmarks/experiments/drift_signals.py --data benchmarks/data/hotpotqa_ircot.jsonl --start 1 --n 10 \
        --template langchain --threads 2 --out DIR

Writes ``rows.jsonl`` to ``--out``; ``--summarise TUNE_DIR REPORT_DIR`` chooses each signal's threshold on the first
(the largest share of parting answers caught with at most a third of holding ones escalated) and reports it on the
second.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common, metrics
from kvrag.bench.qa_data import build_index, load_questions, passage_keys, passage_text
from kvrag.config import FuseConfig, GenerateConfig
from kvrag.fusion.selectors.probe import ProbeSelector
from kvrag.query.locate import chat_prompt

LANGCHAIN = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
             "to answer the question. If you don't know the answer, just say that you don't know. Use three "
             "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
LLAMAINDEX = ("Context information is below.\n---------------------\n{context}\n---------------------\nGiven the "
              "context information and not prior knowledge, answer the query.\nQuery: {question}\nAnswer: ")
SIGNALS = ("margin", "probe_kl", "unread_share", "lookahead_margin")
RISING = ("probe_kl", "unread_share")  # signals whose high values mean drift (low values, for the others)


def margins(logprobs: torch.Tensor) -> torch.Tensor:
    """Per row of ``logprobs`` ``[steps, vocab]``: the top log-probability's lead over the runner-up."""
    top = logprobs.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def fuse_both(rag: Any, item: dict[str, Any], template: str, mode: str, ratio: float) -> tuple[Any, Any, ProbeSelector]:
    """The fused and the full prompt of one question, and the probe selector that chose the fused one's tokens."""
    selector = ProbeSelector(FuseConfig(mode=mode, ratio=ratio))
    if template == "api":
        keys = passage_keys(rag, item)
        fused = rag.prepare(item["question"], chunks=keys, mode=mode, ratio=ratio, selector=selector, gate=False)
        full = rag.prepare(item["question"], chunks=keys, mode="full", gate=False)
        return fused, full, selector
    context = "\n\n".join(passage_text(c) for c in item["ctxs"])
    text = (LANGCHAIN if template == "langchain" else LLAMAINDEX).format(question=item["question"], context=context)
    prompt = chat_prompt(rag.lm.tokenizer, text)
    fused = rag.prepare_prompt(prompt, mode=mode, ratio=ratio, selector=selector, gate=False)
    full = rag.prepare_prompt(prompt, mode="full", gate=False)
    return fused, full, selector


def unread_share(selector: ProbeSelector) -> float:
    """The probe's attention on stale tokens it left stale, over its attention on every stale candidate."""
    if selector.attention is None or selector.picked is None:
        return float("nan")
    mask = torch.zeros_like(selector.attention, dtype=torch.bool)
    mask[selector.picked] = True
    candidates = selector.attention > 0
    total = float(selector.attention[candidates].sum())
    return float(selector.attention[candidates & ~mask].sum()) / total if total > 0 else float("nan")


def one_row(rag: Any, item: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Signals, answers and the label for one question."""
    t0 = time.perf_counter()
    fused, full, selector = fuse_both(rag, item, args.template, args.mode, args.ratio)
    t1 = time.perf_counter()
    result = fused.fused
    logp = torch.log_softmax(result.logits.float(), -1)
    kl = float("nan")
    if result.probe_logits is not None:
        probe = torch.log_softmax(result.probe_logits.float(), -1)
        kl = float((logp.exp() * (logp - probe)).sum())
    fused_answer = fused.generate(GenerateConfig(max_new_tokens=args.max_new_tokens))
    full_answer = full.generate(GenerateConfig(max_new_tokens=args.max_new_tokens))
    own = fused.teacher_logprobs(fused_answer.token_ids)
    h = min(args.horizon, len(fused_answer.token_ids))
    parts = fused_answer.token_ids[:args.horizon] != full_answer.token_ids[:args.horizon]
    return {"id": item["id"], "template": args.template, "prompt_tokens": result.n_tokens,
            "recompute": result.recompute_fraction, "fuse_s": t1 - t0,
            "margin": float(margins(logp[None])[0]), "probe_kl": kl,
            "probe_agrees": None if result.probe_logits is None
            else int(result.probe_logits.argmax()) == int(result.logits.argmax()),
            "unread_share": unread_share(selector),
            "lookahead_margin": float(margins(own[:h]).min()) if h else float("nan"),
            "parts": parts, "agreement": metrics.agreement(fused_answer.text, full_answer.text),
            "fused": fused_answer.text, "full": full_answer.text, "golds": item["answers"]}


def threshold_for(rows: list[dict[str, Any]], signal: str, max_needless: float) -> float:
    """The threshold (escalate when the signal is below it, or above it for ``probe_kl``/``unread_share``) that
    catches the most parting answers while escalating at most ``max_needless`` of the holding ones.
    """
    sign = 1.0 if signal in RISING else -1.0
    values = sorted({sign * r[signal] for r in rows if not math.isnan(r[signal])})
    best, best_caught = math.inf, -1
    for v in values:
        caught, needless = rates(rows, signal, sign * v)
        if needless <= max_needless and caught > best_caught:
            best, best_caught = sign * v, caught
    return best


def escalates(row: dict[str, Any], signal: str, threshold: float) -> bool:
    value = row[signal]
    if math.isnan(value):
        return False
    return value >= threshold if signal in RISING else value <= threshold


def rates(rows: list[dict[str, Any]], signal: str, threshold: float) -> tuple[float, float]:
    """Share of parting answers caught, share of holding answers escalated."""
    parting = [r for r in rows if r["parts"]]
    holding = [r for r in rows if not r["parts"]]
    caught = sum(escalates(r, signal, threshold) for r in parting) / max(1, len(parting))
    needless = sum(escalates(r, signal, threshold) for r in holding) / max(1, len(holding))
    return caught, needless


def summarise(tune: Path, report: Path) -> None:
    read = [[json.loads(line) for line in open(d / "rows.jsonl")] for d in (tune, report)]
    for name, rows in zip(("tune", "report"), read):
        print(f"{name}: {len(rows)} questions, {sum(r['parts'] for r in rows)} parting in the horizon, "
              f"agreement {sum(r['agreement'] for r in rows) / len(rows):.3f}")
    for signal in SIGNALS:
        t = threshold_for(read[0], signal, 1 / 3)
        (tc, tn), (rc, rn) = rates(read[0], signal, t), rates(read[1], signal, t)
        print(f"{signal}: threshold {t:.4g}; tune caught {tc:.2f}, needless {tn:.2f}; "
              f"report caught {rc:.2f}, needless {rn:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data")
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--template", choices=("api", "langchain", "llamaindex"), default="api")
    p.add_argument("--mode", default="probe")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-chunk-tokens", type=int, default=2048)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--index", default=None)
    p.add_argument("--out")
    p.add_argument("--summarise", nargs=2, metavar=("TUNE", "REPORT"))
    args = p.parse_args()
    if args.summarise:
        summarise(Path(args.summarise[0]), Path(args.summarise[1]))
        return
    common.set_threads(args.threads)
    items = load_questions(Path(args.data), args.start + args.n - 1)[args.start - 1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index_dir = Path(args.index) if args.index else Path(tempfile.mkdtemp()) / "idx"
    rag, _ = build_index(args, items, index_dir)
    with open(out / "rows.jsonl", "w") as f:
        for item in items:
            row = one_row(rag, item, args)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(item["id"], row["prompt_tokens"], f"parts={row['parts']} agr={row['agreement']:.2f}", flush=True)


if __name__ == "__main__":
    main()
