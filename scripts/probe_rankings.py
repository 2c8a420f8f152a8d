r"""How `probe` should rank the stale chunk tokens: three rankings of the same size, side by side.

`probe` runs the question over the stored caches and recomputes, through every layer, the chunk
tokens it attends to most (summed over the layers from ``probe_from`` up). Each ranking below picks
the same number of tokens and recomputes them the same way over the same stored caches:

- ``stale`` (``probe@R``): the question's attention over the stored caches — `probe` itself;
- ``exact`` (``full-attention@R``): the question's attention in a full prefill, the same probe pass
  run over the exact caches of the fused prompt. An oracle: it needs the full prefill;
- ``value`` (``value-weighted@R``): ``stale`` with each head's weight on a token multiplied by the
  norm of the token's value row in that head (`kvrag.fusion.fuse.question_attention`'s ``weigh_values``):
  the size of what the token adds to the head's output, not only how much the head looks at it.

    python scripts/probe_rankings.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/cc-idx --quality benchmarks/quality-musique-probe/quality.json --n 20 \
        --out bench-out/probe-rankings/quality.json

``--quality`` is a run over plain caches of the same questions with ``full`` and ``probe@0.15`` in
it: its ``full`` answers are the reference. The caches are computed here after the index's prefix,
as an index stores them, so the index need only hold the passages (a missing one is built without
caches, as `scripts/chunk_context.py` does). The output is in the ``quality.json`` row format, with
each ranking's overlap with `probe`'s choice and the paired comparison against `probe`.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvrag.fusion import fuse as fuse_mod
from kvrag.bench import common, metrics
from kvrag.bench.deviation import full_chunk_rows
from kvrag.bench.quality import (
    against_full,
    experiment_parser,
    load_run,
    mean_summary,
    paired,
    paired_markdown,
    passage_index,
    passage_text,
    row_against_full,
)
from kvrag.config import FuseConfig
from kvrag.fusion.fuse import FixedSelector, ProbeSelector, Selector
from kvrag.indexing.kvgen import chunk_cache_after
from kvrag.prompt import chunk_token_ids

RANKINGS = {"stale": "probe", "exact": "full-attention", "value": "value-weighted"}


@contextlib.contextmanager
def values_weighed(on: bool) -> Iterator[None]:
    """Within the block, the probe pass weighs each head's attention by the value rows' norms."""
    original = fuse_mod.question_attention
    if on:
        fuse_mod.question_attention = functools.partial(original, weigh_values=True)
    try:
        yield
    finally:
        fuse_mod.question_attention = original


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the positions of ``a`` also in ``b``."""
    return float(torch.isin(a, b).float().mean()) if a.numel() else 1.0


def main() -> None:
    parser = experiment_parser(__doc__, 20, "bench-out/probe-rankings/quality.json",
                               "quality.json of a run over plain caches with full and probe@0.15 in it")
    parser.add_argument("--rankings", default=",".join(RANKINGS), help=f"from {', '.join(RANKINGS)}")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    from kvrag.rag import KVRag

    rankings = args.rankings.split(",")
    if unknown := set(rankings) - set(RANKINGS):
        parser.error(f"unknown rankings {sorted(unknown)}; choose from {', '.join(RANKINGS)}")
    common.set_threads(args.threads)
    run = load_run(args.quality)
    passage_index(args)
    config = FuseConfig(mode="probe", ratio=args.ratio)
    labels = {r: f"{RANKINGS[r]}@{args.ratio:g}" for r in rankings}
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        for item, keys, full in against_full(rag, args, run):
            rows.append({**full, "mode": "full"})
            chunk_ids = [chunk_token_ids(rag.lm.tokenizer, passage_text(ctx)) for ctx in item["ctxs"]]
            stored = [chunk_cache_after(rag.lm, rag.prefix, ids) for ids in chunk_ids]
            picked: dict[str, torch.Tensor] = {}
            for ranking in rankings:
                selector: Selector
                if ranking == "exact":
                    seen = ProbeSelector(config)  # the question's reading of the exact caches
                    rag.answer(item["question"], chunks=keys, caches=full_chunk_rows(rag.lm, rag.prefix, chunk_ids),
                               fuse_config=config, max_new_tokens=1, selector=seen)
                    assert seen.picked is not None
                    picked[ranking], selector = seen.picked, FixedSelector(seen.picked)
                else:
                    selector = ProbeSelector(config)
                with values_weighed(ranking == "value"):
                    ans = rag.answer(item["question"], chunks=keys, caches=stored, fuse_config=config,
                                     max_new_tokens=args.max_new_tokens, score_ids=full["token_ids"], selector=selector)
                if isinstance(selector, ProbeSelector):
                    assert selector.picked is not None
                    picked[ranking] = selector.picked
                previous = run.get((item["id"], labels[ranking]))
                row = {**row_against_full(item, labels[ranking], ans, full),
                       "same_as_stored_run": ans.text == previous["answer"] if previous else None}
                if "stale" in picked and ranking != "stale":
                    row["overlap_with_probe"] = overlap(picked[ranking], picked["stale"])
                rows.append(row)
                print(json.dumps({k: row.get(k) for k in ("id", "mode", "agreement", "delta_nll", "same_as_stored_run",
                                                          "overlap_with_probe")}), flush=True)
    summary: dict[str, dict[str, float]] = mean_summary(rows, list(labels.values()))
    for label in labels.values():
        overlaps = [r.get("overlap_with_probe") for r in rows if r["mode"] == label]
        if all(o is not None for o in overlaps):
            summary[label]["overlap_with_probe"] = metrics.summary(overlaps)["mean"]
    base = labels.get("stale")
    pairs = paired(rows, [lab for lab in labels.values() if lab != base], [base]) if base else []
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "paired": pairs, "rows": rows})
    print(json.dumps(summary, indent=1))
    if pairs:
        print(paired_markdown(pairs))


if __name__ == "__main__":
    main()
