r"""Refresh stale rows while the answer is decoded, chosen by what each new token reads.

The 15 % modes' first token is `full`'s on nearly every question; their answers leave `full`'s
later, at near ties (benchmarks/README.md, "The precision floor"). The tokens the question reads are
recomputed before the first token; the tokens the answer reads as it goes on may be others. Here,
after every ``every``-th decoded token, the attention that token pays over the stale chunk rows
(summed over heads and the layers from ``probe_from`` up) picks ``m`` stale rows not yet recomputed.
Those rows and the token itself then run through every layer over the current cache, and the
token's fresh logits choose the next one. TTFT is unchanged; the work comes after it.

    python scripts/follow.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl \
        --index /tmp/nc-stored-idx --quality benchmarks/quality-musique-precision/quality.json \
        --variants 0.01/1,0.03/4 --n 20 --out bench-out/follow.json

A variant ``F/E`` refreshes ``F`` of the chunk tokens after every ``E``-th token; ``F/E/s`` also
re-runs the question and the answer so far, so that their rows see the refreshed ones. Each answer
is compared with `full`'s answer from the ``--quality`` run (same index, same model), next to that
run's other modes; ``recomputed`` is the prompt's recomputed fraction at the first token and
``after`` the token-layers recomputed after it, over the prompt's token-layers.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import kvrag.fusion.fuse as fusion
from kvrag.model import hf_compat
from kvrag.bench import common, metrics
from kvrag.bench.quality import against_full, experiment_parser, load_run
from kvrag.config import FuseConfig
from kvrag.generation.decode import eos_ids


class Inputs:
    """Each decoder layer's input (and rotary embeddings) for the last forward step."""

    def __init__(self, model: Any) -> None:
        self.hidden: dict[int, torch.Tensor] = {}
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.handles = [layer.register_forward_pre_hook(self.hook(i), with_kwargs=True)
                        for i, layer in enumerate(hf_compat.decoder_layers(model))]

    def hook(self, idx: int) -> Any:
        def capture(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.hidden[idx] = args[0] if args else kwargs["hidden_states"]
            self.rope = kwargs.get("position_embeddings", self.rope)
        return capture

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def answer_following(rag: Any, question: str, keys: list[str], frac: float, every: int, suffix: bool,
                     max_new: int) -> dict[str, Any]:
    """``probe@0.15``, then decoding that refreshes ``frac`` of the chunk tokens after every ``every``-th token."""
    lm = rag.lm
    t0 = time.perf_counter()
    _, inp, fused, _, _ = rag._prepare(question, len(keys), keys, FuseConfig(mode="probe", ratio=0.15))
    seg = fusion.segments(inp)
    ids = torch.cat([inp.prefix.ids] + list(inp.chunk_ids) + [inp.suffix_ids]).tolist()
    done = torch.zeros(seg.total, dtype=torch.bool)
    done[fused.selected.cpu()] = True
    stale = torch.zeros(seg.total, dtype=torch.bool)
    for start, n in seg.stale:
        stale[start:start + n] = True
    m = max(1, round(frac * seg.chunk_tokens))
    from_layer = int(0.33 * lm.spec.n_layers)
    cache, logits, pos = fused.cache, fused.logits, seg.total
    stop, tokens, after, ttft = eos_ids(lm.model, lm.tokenizer), [], 0, 0.0
    inputs = Inputs(lm.model)
    try:
        with torch.no_grad():
            for step in range(max_new):
                token = int(logits.argmax())
                if not tokens:
                    ttft = time.perf_counter() - t0
                if token in stop:
                    break
                tokens.append(token)
                ids.append(token)
                out = lm.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]),
                               past_key_values=cache, use_cache=True)
                logits = out.logits[0, -1].float()
                pos += 1
                left = stale & ~done
                if every <= 0 or (step + 1) % every or not left.any():
                    continue
                scatter = hf_compat.ScatterCache(hf_compat.cache_layers(cache))  # writes into the cache in place
                score = torch.zeros(pos)
                for idx in range(from_layer, lm.spec.n_layers):
                    score += fusion.question_attention(lm, idx, inputs.hidden[idx], torch.tensor([pos - 1]),
                                                       inputs.rope, None, scatter.layer(idx))
                cand = left.nonzero().squeeze(1)
                pick = cand[score[cand].topk(min(m, cand.numel())).indices]
                done[pick] = True
                tail = torch.arange(seg.suffix_start if suffix else pos - 1, pos)
                sel = torch.cat([pick.sort().values, tail])
                part = fusion.Segments(seg.prefix_len, seg.chunk_starts, seg.chunk_lens, seg.suffix_start, pos,
                                       torch.zeros(pos, dtype=torch.bool), seg.first_exact)
                loop = fusion._LayerLoop(lm, torch.tensor(ids), part, scatter, fusion.Selector(), "kv")
                hidden, _, counts = loop.run(sel, None)
                after += sum(counts)
                logits = hf_compat.final_logits(lm.model, hidden[:, -1:])[0, -1]
    finally:
        inputs.close()
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return {"answer": text, "token_ids": tokens, "ttft_s": ttft, "total_s": time.perf_counter() - t0,
            "recomputed": fused.recompute_fraction, "after": after / (seg.total * lm.spec.n_layers)}


def main() -> None:
    parser = experiment_parser(__doc__, 20, "bench-out/follow.json",
                               "quality.json of a run over the same index, with full")
    parser.add_argument("--variants", default="0.01/1,0.03/4", help="F/E[/s], comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    from kvrag.rag import KVRag

    common.set_threads(args.threads)
    run = load_run(args.quality)
    variants = [v.split("/") for v in args.variants.split(",")]
    names = [f"follow@{v[0]}/{v[1]}" + ("/s" if len(v) > 2 else "") for v in variants]
    others = sorted({m for _, m in run} - {"full"})
    rows: list[dict[str, Any]] = []
    with KVRag.open(args.index) as rag:
        for item, keys, full in against_full(rag, args, run):
            row: dict[str, Any] = {"id": item["id"]}
            for name, v in zip(names, variants):
                got = answer_following(rag, item["question"], keys, float(v[0]), int(v[1]), len(v) > 2,
                                       args.max_new_tokens)
                row[name] = {"agreement": metrics.agreement(got["answer"], full["answer"]),
                             "identical": got["token_ids"] == full["token_ids"],
                             **{k: got[k] for k in ("recomputed", "after", "ttft_s", "total_s", "answer")}}
            for mode in others:
                r = run[(item["id"], mode)]
                row[mode] = {"agreement": r["agreement"], "identical": r["token_ids"] == full["token_ids"],
                             "recomputed": r["recompute_fraction"], "after": 0.0}
            rows.append(row)
            print(json.dumps({k: (v if k == "id" else {a: b for a, b in v.items() if a != "answer"})
                              for k, v in row.items()}), flush=True)
    summary = {name: {"agreement": statistics.fmean(r[name]["agreement"] for r in rows),
                      "identical": sum(r[name]["identical"] for r in rows),
                      "recomputed": statistics.fmean(r[name]["recomputed"] for r in rows),
                      "after": statistics.fmean(r[name]["after"] for r in rows)}
               for name in names + others}
    common.write_json(Path(args.out), {**common.stamp(args), "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
