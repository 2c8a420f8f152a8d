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
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics

log = logging.getLogger(__name__)

DEFAULT_MODES = ("full,prefix,reuse,cacheblend@0.05,cacheblend@0.15,cacheblend@0.25,probe@0.15,"
                 "attnlink@4,attnlink@16,attnlink@32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--model", default="smollm2", help="HF id/folder, .gguf file, or 'smollm2'")
    parser.add_argument("--n", type=int, default=20, help="questions (the first N of the file)")
    parser.add_argument(
        "--modes", default=DEFAULT_MODES,
        help="comma list: full, prefix, reuse, cacheblend@R, probe@R, attnlink@K, oracle@R (recompute the R of the "
             "tokens whose stored K/V deviate most from a full prefill: the bound of a KV-deviation selector; its "
             "TTFT leaves out that prefill), full@DTYPE (full prefill with the model loaded in bfloat16/float16/"
             "float32: how far precision alone moves the answer, the floor under every agreement and ΔNLL)",
    )
    common.add_schedule_flags(parser)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-chunk-tokens", type=int, default=2048, help="passages longer than this are split")
    parser.add_argument("--warmup", type=int, default=1, help="questions answered by every mode first, not counted")
    parser.add_argument("--neighbour-context", type=int, default=None, metavar="N",
                        help="build the caches after each passage's N nearest passages (KVRag.build "
                             "neighbour_context; default 0, an existing --index keeps its own)")
    parser.add_argument("--neighbour-kv", default=None, choices=["stored", "prefill"],
                        help="how the neighbours are put before a chunk (KVRag.build neighbour_kv)")
    parser.add_argument("--neighbour-pool", default=None, metavar="FILE,...",
                        help="QA JSONL files (their passages) or corpus JSON files (a list of {title, text}) "
                             "indexed without caches before the questions' passages, so that neighbour context "
                             "chooses each passage's neighbours from a corpus, not from the benchmark's passages "
                             "alone")
    parser.add_argument("--question-tail", default="", metavar="TEXT",
                        help="a line put right after each question (KVRag.build question_tail; an existing "
                             "--index keeps its own)")
    parser.add_argument("--index", default=None, help="index directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="bench-out/quality", help="output directory")


def experiment_parser(doc: str, n: int, out: str, quality: str | None = None) -> argparse.ArgumentParser:
    """The command line of a script that answers the first questions of a QA file over an index:
    ``--data``, ``--index``, ``--n`` (default ``n``), ``--threads``, ``--out`` (default ``out``) and,
    given its help text ``quality``, ``--quality`` (a run of this benchmark to compare with; `load_run`).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--data", required=True, help="QA JSONL file")
    parser.add_argument("--index", required=True, help="index holding the questions' passages")
    if quality is not None:
        parser.add_argument("--quality", required=True, help=quality)
    parser.add_argument("--n", type=int, default=n, help="questions, from the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=out)
    return parser


def load_run(path: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The rows of a ``quality.json``, by ``(question id, mode)``."""
    return {(r["id"], r["mode"]): r for r in json.loads(Path(path).read_text())["rows"]}


def against_full(rag: Any, args: argparse.Namespace, run: dict[tuple[str, str], dict[str, Any]],
                 ) -> Iterator[tuple[dict[str, Any], list[str], dict[str, Any]]]:
    """For each of the first ``args.n`` questions of ``args.data`` (an `experiment_parser` command
    line): the item, its passages' chunk keys in ``rag`` and ``full``'s row of ``run`` (`load_run`).
    """
    for item in load_questions(Path(args.data), args.n):
        yield item, passage_keys(rag, item), run[(item["id"], "full")]


def load_questions(path: Path, n: int) -> list[dict[str, Any]]:
    """Read the first ``n`` items of a QA JSONL file, checked for the fields the benchmark uses."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            missing = {"id", "question", "answers", "ctxs"} - item.keys()
            if missing:
                raise ValueError(f"{path}:{lineno}: item lacks {sorted(missing)}")
            items.append(item)
            if len(items) == n:
                break
    if not items:
        raise ValueError(f"no questions in {path}")
    return items


def passage_text(ctx: dict[str, str]) -> str:
    title = (ctx.get("title") or "").strip()
    return f"{title}\n{ctx['text']}" if title else ctx["text"]


def passage_documents(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(f"{item['id']}/{j}", passage_text(ctx)) for item in items for j, ctx in enumerate(item["ctxs"])]


def passage_index(args: argparse.Namespace) -> None:
    """Build ``args.index`` (an `experiment_parser` command line) if it is missing: the passages of the
    first ``args.n`` questions of ``args.data``, one chunk each, embedded and indexed without caches,
    for scripts that compute the caches themselves.
    """
    if Path(args.index).exists():
        return
    from kvrag.config import SplitConfig
    from kvrag.rag import KVRag

    docs = passage_documents(load_questions(Path(args.data), args.n))
    KVRag.build(docs, args.index, model="smollm2", split=SplitConfig(mode="document", max_tokens=2048, min_tokens=0),
                caches=False, show_progress=False).close()


def pool_documents(paths: Sequence[Path], exclude: set[str]) -> list[tuple[str, str]]:
    """``(id, text)`` of the passages in ``paths`` (QA JSONL files, or JSON files holding a list of
    ``{title, text}``), each text once, leaving out the texts in ``exclude``.
    """
    seen = set(exclude)
    docs = []
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                passages = [ctx for line in fh if line.strip() for ctx in json.loads(line).get("ctxs", [])]
        else:
            passages = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(passages, list):
                raise ValueError(f"{path}: expected a JSON list of {{title, text}} passages")
        for j, ctx in enumerate(passages):
            if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
                raise ValueError(f"{path}: passage {j} has no text")
            text = passage_text(ctx)
            if text not in seen:
                seen.add(text)
                docs.append((f"pool/{path.stem}/{j}", text))
    return docs


def passage_keys(rag: Any, item: dict[str, Any]) -> list[str]:
    """Chunk keys of an item's passages in dataset order (content hash, so duplicates share keys)."""
    from kvrag.indexing.kvgen import chunk_key
    from kvrag.prompt import chunk_token_ids

    keys = []
    for ctx in item["ctxs"]:
        ids = chunk_token_ids(rag.lm.tokenizer, passage_text(ctx))
        key = chunk_key(rag.lm.fingerprint, rag.layout.prefix_ids, ids)
        if key not in rag.index:
            raise ValueError(f"passage of {item['id']!r} is not one chunk in the index; raise --max-chunk-tokens")
        keys.append(key)
    return keys


def precision_twin(rag: Any, dtype: str) -> Any:
    """A `KVRag` over the same index and prompt layout whose model is loaded in ``dtype``, for ``full``
    answers only (it reads no chunk cache: those were computed by the index's own model).
    """
    from kvrag.model import load_model
    from kvrag.rag import KVRag

    lm = load_model(rag.lm.source, dtype=dtype, device=str(rag.lm.device))
    return KVRag(rag.path, rag.index, lm, rag.embedder, rag.kvstore.codec, rag.layout, rag.batch_tokens)


def answer_row(
    rag: Any, item: dict[str, Any], keys: list[str], spec: common.ModeSpec, max_new_tokens: int,
    score_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One mode's answer; with ``score_ids`` (``full``'s answer) also their NLL under the same fusion."""
    cfg = spec.config
    selector = None
    if spec.oracle:  # chosen from a full prefill, outside the answer's timing
        from kvrag.bench.deviation import oracle_positions
        from kvrag.fusion.fuse import FixedSelector

        selector = FixedSelector(oracle_positions(rag, item, cfg.ratio))
    ans = rag.answer(
        item["question"],
        chunks=keys,
        mode=cfg.mode,
        ratio=cfg.ratio,
        fuse_config=cfg,
        max_new_tokens=max_new_tokens,
        score_ids=score_ids,
        selector=selector,
    )
    if score_ids is None:  # full's own answer: greedy decoding already saw each token's probability
        nll = -sum(ans.token_logprobs) / len(ans.token_logprobs) if ans.token_logprobs else math.nan
    else:
        nll = ans.score_nll
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
        **metrics.gold_scores(ans.text, item["answers"]),
    }


def run_question(
    rag: Any, item: dict[str, Any], specs: list[common.ModeSpec], turn: int, max_new_tokens: int,
    twins: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Answer with ``full`` first, then with every other mode (rotated per question), each fused once.

    Agreement, first-token agreement and ΔNLL compare each mode with ``full``'s answer; a mode's NLL
    of that answer is measured on the cache it answered from (`KVRag.answer` ``score_ids``).
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


def row_against_full(item: dict[str, Any], label: str, ans: Any, full: dict[str, Any]) -> dict[str, Any]:
    """An experiment script's row for one `Answer` (answered with ``score_ids=full["token_ids"]``),
    compared with ``full``'s row of a `load_run` run: agreement, first-token agreement and ΔNLL.
    """
    return {"id": item["id"], "mode": label, "answer": ans.text, "token_ids": list(ans.token_ids),
            "agreement": metrics.agreement(ans.text, full["answer"]),
            "first_token_agreement": metrics.first_token_agreement(ans.token_ids, full["token_ids"]),
            "delta_nll": ans.score_nll - full["nll_full_answer"],
            "recompute_fraction": ans.recompute_fraction, "ttft_s": ans.ttft_s}


def mean_summary(rows: list[dict[str, Any]], labels: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per mode label: mean agreement, mean |ΔNLL| and mean recomputed fraction of its rows."""
    out = {}
    for label in labels:
        mine = [r for r in rows if r["mode"] == label]
        out[label] = {"agreement": metrics.summary([r["agreement"] for r in mine])["mean"],
                      "mean_abs_delta_nll": metrics.summary([abs(r["delta_nll"]) for r in mine])["mean"],
                      "recompute_fraction": metrics.summary([r["recompute_fraction"] for r in mine])["mean"]}
    return out


def summarise(rows: list[dict[str, Any]], specs: list[common.ModeSpec]) -> list[dict[str, Any]]:
    by_mode = {s.label: [r for r in rows if r["mode"] == s.label] for s in specs}
    full_ttft = metrics.summary([r["ttft_s"] for r in by_mode["full"]])["mean"]
    out = []
    for spec in specs:
        rs = by_mode[spec.label]
        ttft = metrics.summary([r["ttft_s"] for r in rs])
        abs_delta_nll = [abs(r["delta_nll"]) for r in rs]
        mean = {
            k: metrics.summary([r[k] for r in rs])["mean"]
            for k in (
                "f1",
                "rouge_l",
                "em",
                "agreement",
                "first_token_agreement",
                "delta_nll",
                "recompute_fraction",
                "load_s",
                "fuse_s",
                "prompt_tokens",
            )
        }
        out.append(
            {
                "mode": spec.label,
                "n": len(rs),
                **mean,
                # signed ΔNLL can cancel over questions scored better and worse than by full
                "abs_delta_nll": metrics.summary(abs_delta_nll)["mean"],
                "ttft_mean_s": ttft["mean"],
                "ttft_p50_s": ttft["p50"],
                "ttft_p90_s": ttft["p90"],
                "ttft_speedup": full_ttft / ttft["mean"],
                "agreement_ci": list(metrics.bootstrap_interval([r["agreement"] for r in rs])),
                "abs_delta_nll_ci": list(metrics.bootstrap_interval(abs_delta_nll)),
            }
        )
    return out


# modes every other one is compared with question by question, where a run has them
PAIRED_BASELINES = ("reuse", "full@bfloat16")
MIN_PAIRED_QUESTIONS = 10  # fewer, and a bootstrap interval says little: no verdict


def paired(rows: list[dict[str, Any]], labels: list[str],
           baselines: Sequence[str] = PAIRED_BASELINES) -> list[dict[str, Any]]:
    """Each mode (``labels``, in the run's order) against each ``baselines`` mode of the run, on
    the questions both answered: the mean per-question difference in agreement and in |ΔNLL|, with
    95 % bootstrap intervals.

    ``separated`` says whether the agreement interval excludes 0 (the mode agrees with ``full``
    more, or less, than the baseline does beyond what the choice of questions explains); None
    below `MIN_PAIRED_QUESTIONS` questions.
    """
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["id"]] = r
    out = []
    for base in (b for b in baselines if b in by_mode):
        for label in labels:
            if label in (base, "full") or label not in by_mode:
                continue
            ids = [i for i in by_mode[label] if i in by_mode[base]]
            mode, ref = by_mode[label], by_mode[base]
            agree = [mode[i]["agreement"] - ref[i]["agreement"] for i in ids]
            closer = [abs(mode[i]["delta_nll"]) - abs(ref[i]["delta_nll"]) for i in ids]
            lo, hi = metrics.bootstrap_interval(agree)
            out.append({
                "mode": label, "baseline": base, "n": len(ids),
                "agreement_diff": metrics.summary(agree)["mean"], "agreement_diff_ci": [lo, hi],
                "abs_delta_nll_diff": metrics.summary(closer)["mean"],
                "abs_delta_nll_diff_ci": list(metrics.bootstrap_interval(closer)),
                "separated": bool(lo > 0 or hi < 0) if len(ids) >= MIN_PAIRED_QUESTIONS else None,
            })
    return out


def paired_markdown(pairs: list[dict[str, Any]]) -> str:
    headers = ["mode", "against", "questions", "agreement diff", "95 % interval", "\\|ΔNLL\\| diff", "95 % interval",
               "agreement separated"]
    rows = [
        [p["mode"], p["baseline"], p["n"], f"{p['agreement_diff']:+.3f}", interval_text(p["agreement_diff_ci"], "+.3f"),
         f"{p['abs_delta_nll_diff']:+.4f}", interval_text(p["abs_delta_nll_diff_ci"], "+.4f"),
         {True: "yes", False: "no", None: "too few questions"}[p["separated"]]]
        for p in pairs
    ]
    return common.markdown_table(headers, rows)


def interval_text(ci: Sequence[float], fmt: str = ".3f") -> str:
    """``[lo, hi]`` of an interval, each bound in ``fmt``."""
    return f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def summary_markdown(summary: list[dict[str, Any]]) -> str:
    headers = [
        "mode",
        "gold F1",
        "Rouge-L",
        "EM",
        "agreement",
        "agreement 95 % interval",
        "first-token",
        "ΔNLL",
        "mean \\|ΔNLL\\|",
        "TTFT mean ms",
        "p50 ms",
        "p90 ms",
        "speedup vs full",
        "recomputed",
    ]
    rows = [
        [
            s["mode"],
            s["f1"],
            s["rouge_l"],
            s["em"],
            s["agreement"],
            interval_text(s["agreement_ci"]),
            s["first_token_agreement"],
            s["delta_nll"],
            s["abs_delta_nll"],
            s["ttft_mean_s"] * 1e3,
            s["ttft_p50_s"] * 1e3,
            s["ttft_p90_s"] * 1e3,
            f"{s['ttft_speedup']:.2f}×",
            s["recompute_fraction"],
        ]
        for s in summary
    ]
    return common.markdown_table(headers, rows)


def pareto_plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs, ys = [s["ttft_speedup"] for s in summary], [s["agreement"] for s in summary]
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    for s, x, y in zip(summary, xs, ys, strict=True):
        ax.annotate(s["mode"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front, best = [], -1.0
    for x, y in sorted(
        zip(xs, ys, strict=True), key=lambda p: -p[0]
    ):  # fastest first: keep points better than all faster ones
        if y > best:
            front.append((x, y))
            best = y
    ax.plot(*zip(*sorted(front), strict=True), color="tab:orange", linestyle="--", label="Pareto front", zorder=2)
    ax.set_xlabel("TTFT speedup vs full (same run)")
    ax.set_ylabel("agreement with full (token F1)")
    ax.set_ylim(-0.02, 1.05)
    common.save_plot(plt, fig, ax, path, title)


def build_index(args: argparse.Namespace, items: list[dict[str, Any]], index_dir: Path,
                neighbour_context: int | None = None, neighbour_kv: str | None = None,
                pool: Sequence[Path] = (), question_tail: str = "") -> tuple[Any, float]:
    """The index over the questions' passages (with caches), after the ``pool`` passages (without)."""
    from kvrag.config import SplitConfig
    from kvrag.rag import KVRag

    t0 = time.perf_counter()
    split = SplitConfig(mode="document", max_tokens=args.max_chunk_tokens, min_tokens=0)
    docs = passage_documents(items)
    first = pool_documents(pool, {text for _, text in docs}) if pool else docs
    rag = KVRag.build(first, index_dir, model=args.model, split=split, device=args.device,
                      neighbour_context=neighbour_context, neighbour_kv=neighbour_kv, show_progress=False,
                      caches=not pool, question_tail=question_tail)
    if pool:
        rag.add(docs, show_progress=False)
    return rag, time.perf_counter() - t0


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
    from tqdm.auto import tqdm

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
