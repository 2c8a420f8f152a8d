r"""What a chunk's cache is computed after, and what AttnLink's boundary recompute then buys.

kvrag computes each chunk's cache after the prompt's prefix (chat-template head, instruction,
"Passages:"), so every chunk is stored as the model sees it with a beginning of sequence and a
system prompt before it. Epic and CacheBlend compute each chunk on its own instead, its first token
standing at position 0. This script answers the same questions over the same chunks with caches
computed three ways and fused by each ``--modes`` mode:

- ``prefix``: after kvrag's prefix (what an index stores; the first chunk's cache is then exact);
- ``start``: after the prefix's first token alone (``<|im_start|>`` for SmolLM2's chat template);
- ``none``: the chunk alone, from position 0 (Epic's and CacheBlend's setting);
- ``none-first``: as ``none``, except the first chunk, computed after the prefix as in ``prefix``.
  Against ``none`` it shows what an exact first chunk is worth; against ``prefix``, what the prefix
  is worth to the other chunks.

For ``start`` and ``none`` the first chunk's cache is stale too, and the selectors may recompute
it. The index only has to hold the passages for retrieval: the caches are computed here.

    python scripts/chunk_context.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/cc-idx --quality benchmarks/quality-musique-probe/quality.json --n 20 \
        --out bench-out/chunk-context/quality.json

``--quality`` is a run over plain caches of the same questions with ``full`` in it: its answers are
the reference. A missing ``--index`` is built (passages embedded, no caches). The output holds one
row per question and ``variant/mode`` in the ``quality.json`` row format (``full``'s rows copied),
so `scripts/paired.py` reads it; the paired table is printed at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common
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
from kvrag.indexing.kvgen import KV, PrefixCache, chunk_cache_after, prefix_cache
from kvrag.model.loading import LoadedModel, rope_at, unapply_rope
from kvrag.prompt import chunk_token_ids

VARIANTS = ("prefix", "start", "none", "none-first")
DEFAULT_VARIANTS = VARIANTS[:3]


def alone(lm: LoadedModel, ids: list[int]) -> KV:
    """A chunk prefilled with nothing before it (positions ``0 … n-1``): keys pre-RoPE, ``[L, H, n, D]``."""
    kv = prefix_cache(lm, ids).kv
    keys = torch.stack([k[0] for k, _ in kv])
    cos, sin = rope_at(lm.model, torch.arange(len(ids), device=lm.device), keys)
    return unapply_rope(keys, cos, sin).contiguous(), torch.stack([v[0] for _, v in kv]).contiguous()


def context_before(rag: Any, variant: str) -> PrefixCache | None:
    """What ``variant``'s chunk caches are computed after (None: nothing)."""
    if variant.startswith("none"):
        return None
    return rag.prefix if variant == "prefix" else prefix_cache(rag.lm, rag.layout.prefix_ids[:1])


def comparisons(rows: list[dict[str, Any]], variants: list[str], modes: list[str]) -> list[dict[str, Any]]:
    """Question by question (`paired`): each mode against ``reuse`` over the same caches, then each
    mode over each variant's caches against the same mode over every variant's listed before it.
    """
    out = [p for v in variants for p in paired(rows, [f"{v}/{m}" for m in modes], [f"{v}/reuse"])]
    return out + [p for i, v in enumerate(variants) for before in variants[:i] for m in modes
                  for p in paired(rows, [f"{v}/{m}"], [f"{before}/{m}"])]


def main() -> None:
    parser = experiment_parser(__doc__, 20, "bench-out/chunk-context/quality.json",
                               "quality.json of a run over plain caches with full in it")
    parser.add_argument("--modes", default="reuse,attnlink@16,cacheblend@0.15,probe@0.15")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    specs = [common.parse_mode(m) for m in args.modes.split(",")]
    run = load_run(args.quality)
    passage_index(args)
    rows: list[dict[str, Any]] = []
    labels = [f"{v}/{s.label}" for v in variants for s in specs]
    with KVRag.open(args.index) as rag:
        before = {variant: context_before(rag, variant) for variant in variants}
        for item, keys, full in against_full(rag, args, run):
            rows.append({**full, "mode": "full"})
            chunk_ids = [chunk_token_ids(rag.lm.tokenizer, passage_text(ctx)) for ctx in item["ctxs"]]
            for variant in variants:
                contexts = [rag.prefix if variant == "none-first" and i == 0 else before[variant]
                            for i in range(len(chunk_ids))]
                caches = [alone(rag.lm, ids) if context is None else chunk_cache_after(rag.lm, context, ids)
                          for context, ids in zip(contexts, chunk_ids)]
                for spec in specs:
                    ans = rag.answer(item["question"], chunks=keys, caches=caches,
                                     first_exact=variant in ("prefix", "none-first"),
                                     fuse_config=spec.config, max_new_tokens=args.max_new_tokens,
                                     score_ids=full["token_ids"])
                    stored = run.get((item["id"], spec.label))
                    row = {**row_against_full(item, f"{variant}/{spec.label}", ans, full),
                           "same_as_stored_run": (ans.text == stored["answer"]
                                                  if variant == "prefix" and stored else None)}
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("id", "mode", "agreement", "delta_nll",
                                                          "same_as_stored_run")}), flush=True)
    summary = mean_summary(rows, labels)
    pairs = comparisons(rows, variants, [s.label for s in specs])
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "paired": pairs, "rows": rows})
    print(json.dumps(summary, indent=1))
    print(paired_markdown(pairs))


if __name__ == "__main__":
    main()
