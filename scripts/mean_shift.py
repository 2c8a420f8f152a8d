r"""Correct stale cache rows by the mean shift of a few known ones, and measure error and answers.

A stored chunk cache deviates from what a full prefill of the fused prompt gives its tokens. If a
random ``--fit`` fraction of each stale chunk's rows were known exactly, the mean of their
``full - stored`` difference (per layer and head, per chunk) could be added to the chunk's other
rows. This script measures, for the oracle version of that fit (the true rows come from a full
prefill of the chunk run):

1. the deviation energy left on the rows outside the fit, relative to no correction, for the mean
   shift over all chunks, per chunk, and a ridge-regularised affine map of the stored row;
2. what the corrected caches do to answers: agreement with ``full``'s answer and ``|ΔNLL|`` of it, for
   ``reuse`` and ``probe`` over caches shifted in K and V, in V only, in K only, and (as the
   reference a real selector could at best reach) with the fit rows set to their true values.

    python scripts/mean_shift.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/nc-stored-idx --n 8 --out bench-out/mean-shift.json

``--index`` is a neighbour-context index: the first passage uses its plain cache (stored under
`lead_key`), the others the caches the index serves.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common, metrics
from kvrag.bench.deviation import stored_and_full
from kvrag.bench.quality import experiment_parser, load_questions, passage_keys
from kvrag.config import FuseConfig
from kvrag.indexing.kvgen import lead_key

KV = tuple[torch.Tensor, torch.Tensor]
FITS = ("none", "global_mean", "chunk_mean", "ridge_affine")
VARIANTS = ("none", "kv_mean", "v_mean", "k_mean", "true_rows")


def fit_rows(pairs: list[tuple[KV, KV]], fraction: float, gen: torch.Generator) -> list[torch.Tensor]:
    """Per pair, a random ``fraction`` of its token rows (at least one)."""
    out = []
    for ref, _ in pairs:
        n = ref[0].shape[2]
        out.append(torch.randperm(n, generator=gen)[: max(1, math.ceil(fraction * n))])
    return out


def held_out_energy(pairs: list[tuple[KV, KV]], rows: list[torch.Tensor], ridge: float) -> dict[str, float]:
    """The squared deviation on the rows outside ``rows`` left by each fit in `FITS`, each pair's K and V
    error weighted by the inverse of the mean squared norm of its true rows, summed.
    """
    energy = dict.fromkeys(FITS, 0.0)
    sizes = torch.tensor([ref[0].shape[2] for ref, _ in pairs])
    owner = torch.repeat_interleave(torch.arange(len(pairs)), sizes)  # the pair each row belongs to
    starts = torch.cumsum(sizes, 0) - sizes
    fit = torch.cat([r + starts[j] for j, r in enumerate(rows)])
    held = torch.ones(int(sizes.sum()), dtype=torch.bool)
    held[fit] = False
    for which in (0, 1):
        full = torch.cat([ref[which] for ref, _ in pairs], 2)
        stored = torch.cat([got[which] for _, got in pairs], 2)
        delta = full - stored
        scale = full.pow(2).sum(-1).mean(-1)  # [L, H]
        per_chunk = torch.zeros_like(delta)
        for j in range(len(pairs)):
            per_chunk[:, :, owner == j] = delta[:, :, fit[owner[fit] == j]].mean(2, keepdim=True)
        x = torch.cat([stored, torch.ones_like(stored[..., :1])], -1)
        xf, yf = x[:, :, fit], delta[:, :, fit]
        gram = xf.transpose(-1, -2) @ xf
        gram = gram + ridge * xf.pow(2).mean() * torch.eye(gram.shape[-1])
        weights = torch.linalg.solve(gram, xf.transpose(-1, -2) @ yf)
        predicted = {"none": torch.zeros(()), "global_mean": delta[:, :, fit].mean(2, keepdim=True),
                     "chunk_mean": per_chunk[:, :, held], "ridge_affine": x[:, :, held] @ weights}
        for name, guess in predicted.items():
            err = (delta[:, :, held] - guess).pow(2).sum(-1).sum(-1)
            energy[name] += float((err / scale).sum() / int(held.sum()))
    return energy


def corrected(pairs: list[tuple[KV, KV]], rows: list[torch.Tensor]) -> dict[str, list[KV]]:
    """Per variant in `VARIANTS`, the stale chunks' caches it answers from."""
    out: dict[str, list[KV]] = {name: [] for name in VARIANTS}
    for (ref, got), fit in zip(pairs, rows):
        shift = [(ref[w][:, :, fit] - got[w][:, :, fit]).mean(2, keepdim=True) for w in (0, 1)]
        out["none"].append(got)
        out["kv_mean"].append((got[0] + shift[0], got[1] + shift[1]))
        out["v_mean"].append((got[0], got[1] + shift[1]))
        out["k_mean"].append((got[0] + shift[0], got[1]))
        true = (got[0].clone(), got[1].clone())
        for w in (0, 1):
            true[w][:, :, fit] = ref[w][:, :, fit]
        out["true_rows"].append(true)
    return out


def main() -> None:
    parser = experiment_parser(__doc__, 8, "bench-out/mean-shift.json")
    parser.add_argument("--fit", type=float, default=0.15, help="fraction of each stale chunk's rows known")
    parser.add_argument("--ratio", type=float, default=0.15, help="probe's recompute ratio")
    parser.add_argument("--modes", default="reuse,probe")
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    modes = args.modes.split(",")
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        for item in load_questions(Path(args.data), args.n):
            keys = passage_keys(rag, item)
            chunks = rag.resolve_chunks(keys)
            question = item["question"]
            full = rag.answer(question, chunks=keys, fuse_config=FuseConfig(mode="full"), max_new_tokens=24)
            full_nll = -statistics.fmean(full.token_logprobs)
            _, pairs = stored_and_full(rag, item)
            fit = fit_rows(pairs, args.fit, gen)
            energy = held_out_energy(pairs, fit, args.ridge)
            lead = tuple(t.float() for t in rag.kvstore.load(lead_key(chunks[0].key)))
            row: dict[str, Any] = {"id": item["id"], "energy": energy}
            for variant, stale in corrected(pairs, fit).items():
                for mode in modes:
                    if variant == "true_rows" and mode == "reuse":
                        continue
                    ans = rag.answer(question, chunks=keys, fuse_config=FuseConfig(mode=mode, ratio=args.ratio),
                                     caches=[lead, *stale], max_new_tokens=24, score_ids=full.token_ids)
                    row[f"{mode}/{variant}"] = {"agreement": metrics.agreement(ans.text, full.text),
                                                "delta_nll": ans.score_nll - full_nll}
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if "/" in k]
    summary: dict[str, Any] = {
        "energy_vs_none": {f: sum(r["energy"][f] for r in rows) / sum(r["energy"]["none"] for r in rows)
                           for f in FITS},
        "answers": {k: {"agreement": statistics.fmean(r[k]["agreement"] for r in rows),
                        "mean_abs_delta_nll": statistics.fmean(abs(r[k]["delta_nll"]) for r in rows)}
                    for k in names},
    }
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
