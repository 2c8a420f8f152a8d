"""Selections that weigh `probe`'s attention by each stale token's deviation, against `probe` itself.

Would knowing how far each stale token's cache is from a full prefill improve on `probe`'s choice?
Two selections of the same size as ``probe@0.15`` over the stored caches, each recomputed through
every layer:

- ``att*dev``: the question's attention (the probe pass, layers from ``probe_from`` up) times the
  token's exact deviation from a full prefill summed over layers — the first-order effect of a stale
  row on what the question reads; an oracle, since it needs the full prefill;
- ``att*sens``: the attention times the token's context sensitivity, the deviation between its
  neighbour-context cache and its plain cache (both in a neighbour-context index) over the layers
  from ``probe_from`` up — a prior a build could store at no query-time cost.

    python scripts/selection_oracles.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/nc-stored-idx --quality benchmarks/quality-musique-precision/quality.json --n 10 \
        --out benchmarks/quality-musique-precision/selection-oracles.json

Each answer is compared with ``full``'s answer in the ``--quality`` run (same index and model), next
to that run's ``probe@0.15`` answer.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common, metrics
from kvrag.bench.deviation import Tally, stored_and_full, token_deviation
from kvrag.bench.quality import against_full, experiment_parser, load_run
from kvrag.config import FuseConfig
from kvrag.fusion.fuse import FixedSelector, ProbeSelector
from kvrag.indexing.kvgen import lead_key


def sensitivity(context: tuple[torch.Tensor, torch.Tensor], plain: tuple[torch.Tensor, torch.Tensor],
                first_layer: int) -> torch.Tensor:
    """Per token: squared K and V change between two caches of one chunk over the layers from
    ``first_layer`` up, each relative to the plain cache's mean squared norm at the layer
    (`token_deviation`'s measure, with the plain cache as the reference).
    """
    ref = (plain[0][first_layer:].float(), plain[1][first_layer:].float())
    got = (context[0][first_layer:].float(), context[1][first_layer:].float())
    return token_deviation([(ref, got)], Tally(ref[0].shape[0])).sum(0)


def main() -> None:
    parser = experiment_parser(__doc__, 10, "bench-out/selection-oracles.json",
                               "quality.json of a run with full and probe@0.15 on it")
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    run = load_run(args.quality)
    config = FuseConfig(mode="probe", ratio=0.15)
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        first_layer = int(config.probe_from * rag.lm.spec.n_layers)
        for item, keys, full in against_full(rag, args, run):
            probe = run[(item["id"], "probe@0.15")]
            reading = ProbeSelector(config)
            rag.answer(item["question"], chunks=keys, fuse_config=config, max_new_tokens=1, selector=reading)
            chunk_ids, pairs = stored_and_full(rag, item)
            deviation = token_deviation(pairs, Tally(rag.lm.spec.n_layers)).sum(0)
            chunks = rag.resolve_chunks(keys)[1:]
            sens = torch.cat([sensitivity(rag.kvstore.load(c.key), rag.kvstore.load(lead_key(c.key)), first_layer)
                              for c in chunks])
            start = rag.prefix.length + len(chunk_ids[0])
            assert reading.attention is not None
            attention = reading.attention[start : start + deviation.numel()]
            keep = math.ceil(config.ratio * sum(map(len, chunk_ids)) - 1e-9)
            row: dict[str, Any] = {
                "id": item["id"], "probe@0.15": probe["agreement"], "probe@0.15_delta_nll": probe["delta_nll"],
                "corr_attention_deviation": float(torch.corrcoef(torch.stack([attention, deviation]))[0, 1]),
                "corr_sensitivity_deviation": float(torch.corrcoef(torch.stack([sens, deviation]))[0, 1]),
            }
            for name, score in (("att*dev", attention * deviation), ("att*sens", attention * sens)):
                picked = score.topk(min(keep, score.numel())).indices + start
                ans = rag.answer(item["question"], chunks=keys, fuse_config=config, max_new_tokens=24,
                                 score_ids=full["token_ids"], selector=FixedSelector(picked))
                row[name] = metrics.agreement(ans.text, full["answer"])
                row[f"{name}_delta_nll"] = ans.score_nll - full["nll_full_answer"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {name: {"agreement": statistics.fmean(r[name] for r in rows),
                      "mean_abs_delta_nll": statistics.fmean(abs(r[f"{name}_delta_nll"]) for r in rows)}
               for name in ("probe@0.15", "att*dev", "att*sens")}
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
