r"""Recompute the upper layers densely from stored hidden states, against `probe` and `cacheblend`.

The stored caches deviate most in the upper layers (benchmarks/README.md, "Where the stored caches
deviate"). Would it help to store each chunk's hidden state at the input of layer ``L`` and, at
query time, run every stale chunk token densely through layers ``L``… while below ``L`` only the
question runs over the stored caches (as ``reuse`` does)? Layers from ``L`` up then see every other
chunk, but start from a residual stream computed without them.

    python scripts/upper_layers.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/nc-stored-idx --quality benchmarks/quality-musique-probe/quality.json \
        --layers 24,20,15 --n 8 --out bench-out/upper-layers.json

The caches are the chunks' plain ones (computed right after the prefix, stored under `lead_key` in a
neighbour-context index), so the ``--quality`` run to compare with is one over plain caches. The
hidden states are computed here by prefilling each chunk after the prefix; an index would store them.
``--layers 0`` recomputes every stale token from its embedding and must reproduce ``full``'s NLL.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

import kvrag.fusion.fuse as fusion
from kvrag.model import hf_compat
from kvrag.bench import common, metrics
from kvrag.bench.quality import against_full, experiment_parser, load_run
from kvrag.config import FuseConfig
from kvrag.indexing.kvgen import lead_key
from kvrag.prompt import chunk_token_ids


class UpperLoop(fusion._LayerLoop):
    """The layer loop with the selection widened at layer ``layer`` to every stale chunk token, whose
    input there is ``hidden`` ``[stale tokens, hidden size]`` (set before each fusion).
    """

    layer: int = 0
    hidden: torch.Tensor = torch.empty(0)

    def run(self, sel: torch.Tensor, placement: Any, attention: Any = None, attention_from: int = 0,
            ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        lm, seg = self.lm, self.seg
        hidden = hf_compat.embed_tokens(lm.model, self.ids[sel])[None]
        blocks = fusion._blocks(lm, sel, seg.total, hidden.dtype, self.window, self.causal_ok, self.flex_from)
        n_selected = []
        for layer_idx in range(lm.spec.n_layers):
            scatter = self.cache.layer(layer_idx)
            if placement is not None:
                feed, cos, sin = placement
                fusion._place_layer(scatter, feed.layer(layer_idx), seg, cos, sin)
            if layer_idx == UpperLoop.layer:
                span = torch.arange(seg.stale_start, seg.suffix_start, device=sel.device)
                wide = torch.unique(torch.cat([sel, span]))
                inputs = torch.zeros(1, wide.numel(), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
                inputs[0, torch.searchsorted(wide, sel)] = hidden[0]
                inputs[0, torch.searchsorted(wide, span)] = UpperLoop.hidden.to(hidden.dtype)
                sel, hidden = wide, inputs
                blocks = fusion._blocks(lm, sel, seg.total, hidden.dtype, self.window, self.causal_ok, self.flex_from)
            n_selected.append(int(sel.numel()))
            hidden = fusion._run_layer(lm, layer_idx, hidden, sel, blocks, self.cache)
        return hidden, sel, n_selected


def stale_hidden(rag: Any, chunk_ids: list[list[int]], layers: list[int]) -> dict[int, torch.Tensor]:
    """Per layer: the input to that layer of every chunk's tokens, each chunk prefilled after the prefix."""
    prefix = rag.prefix.ids.tolist()
    per_chunk = []
    for ids in chunk_ids:
        with torch.no_grad():
            states = hf_compat.base_model(rag.lm.model)(
                input_ids=torch.tensor([prefix + list(ids)]), output_hidden_states=True).hidden_states
        per_chunk.append([states[layer][0, len(prefix):] for layer in layers])
    return {layer: torch.cat([c[i] for c in per_chunk]) for i, layer in enumerate(layers)}


def main() -> None:
    parser = experiment_parser(__doc__, 8, "bench-out/upper-layers.json",
                               "quality.json of a plain-cache run with full in it")
    parser.add_argument("--layers", default="24,20,15")
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    fusion._LayerLoop = UpperLoop  # type: ignore[misc]
    run = load_run(args.quality)
    layers = [int(t) for t in args.layers.split(",")]
    others = sorted({m for _, m in run} - {"full"})
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        for item, keys, full in against_full(rag, args, run):
            chunks = rag.resolve_chunks(keys)
            ids = [chunk_token_ids(rag.lm.tokenizer, c.text) for c in chunks]
            caches = [rag.kvstore.load(lead_key(c.key)) for c in chunks]
            row: dict[str, Any] = {"id": item["id"]}
            hidden = stale_hidden(rag, ids[1:], layers)
            for layer in layers:
                UpperLoop.layer, UpperLoop.hidden = layer, hidden[layer]
                ans = rag.answer(item["question"], chunks=keys, fuse_config=FuseConfig(mode="reuse"), caches=caches,
                                 max_new_tokens=24, score_ids=full["token_ids"])
                row[f"upper@{layer}"] = {"agreement": metrics.agreement(ans.text, full["answer"]),
                                         "delta_nll": ans.score_nll - full["nll_full_answer"],
                                         "recomputed": ans.recompute_fraction}
            for mode in others:
                got = run[(item["id"], mode)]
                row[mode] = {"agreement": got["agreement"], "delta_nll": got["delta_nll"],
                             "recomputed": got["recompute_fraction"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {name: {"agreement": statistics.fmean(r[name]["agreement"] for r in rows),
                      "mean_abs_delta_nll": statistics.fmean(abs(r[name]["delta_nll"]) for r in rows),
                      "recomputed": statistics.fmean(r[name]["recomputed"] for r in rows)}
               for name in [f"upper@{layer}" for layer in layers] + others}
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
