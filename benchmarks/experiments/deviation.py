"""Experiment: where stored chunk caches deviate from a full prefill: by layer, by token, by position in a chunk.

For each question of a QA JSONL file, its passages' stored caches (one passage = one chunk) are
compared with the K/V that a full prefill of the same fused prompt computes for those tokens. The
first chunk is left out (it follows the prefix alone, so its cache is exact). A token's deviation
at a layer is its squared K change plus its squared V change, each relative to the mean squared
norm of that layer's full-prefill keys (values) — the scale `kvrag.fusion.scores.kv_deviation` uses.
Reported, summed over the questions:

- **per layer**: K and V deviation energy relative to the full-prefill energy;
- **concentration**: the share of all deviation (summed over layers) held by the top ``r`` of the
  tokens — the most a selector that recomputes ``r`` of the tokens could remove, if recomputing a
  token removed all of its deviation;
- **ranking by layer**: how many of the top ``r`` tokens by total deviation are also in the top
  ``r`` by one layer's deviation (what a check layer that saw the exact deviation would find;
  a random pick finds ``r``);
- **position in chunk**: mean deviation per block of token offsets, relative to the overall mean
  (whether a chunk's first tokens, which AttnLink recomputes, deviate more);
- **position in the prompt**: mean deviation of the chunks that stand 2nd, 3rd, … in the prompt,
  relative to the overall mean (whether a chunk misses more the more passages precede it);
- with ``--neutral-passages K``: the same per-layer energies for chunk caches computed after the
  prefix plus K passages of other questions (whether a generic context at KV generation helps).

Outputs in ``--out``: ``deviation.json``, ``deviation.md`` and ``deviation_layers.png``. `oracle_positions` is the
selection of ``oracle_quality.py``.

    python benchmarks/experiments/deviation.py --data QA.jsonl --model smollm2 --n 20 --out bench-out/deviation
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.bench import common
from kvrag.bench.qa_data import build_index, load_questions, passage_keys, passage_text

if TYPE_CHECKING:
    from kvrag.indexing.kvgen import KV, PrefixCache

log = logging.getLogger(__name__)

RATIOS = (0.05, 0.15, 0.25, 0.5)
OFFSET_BLOCK = 16  # tokens per position-in-chunk bucket
OFFSET_BUCKETS = 8  # the last bucket holds every offset beyond


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--model", default="smollm2", help="HF id/folder, .gguf file, or 'smollm2'")
    parser.add_argument("--n", type=int, default=4, help="questions (the first N of the file)")
    parser.add_argument("--neutral-passages", type=int, default=0,
                        help="also measure caches computed after the prefix plus this many passages of other "
                             "questions (taken after the first N of the file)")
    parser.add_argument("--max-chunk-tokens", type=int, default=2048, help="passages longer than this are split")
    parser.add_argument("--index", default=None, help="index directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="bench-out/deviation", help="output directory")


def top_share(dev: torch.Tensor, ratio: float) -> float:
    """Share of ``dev.sum()`` held by its largest ``ceil(ratio * n)`` entries."""
    k = max(1, math.ceil(ratio * dev.numel() - 1e-9))
    total = float(dev.sum())
    return float(dev.topk(min(k, dev.numel())).values.sum()) / total if total > 0 else 0.0


def top_overlap(score: torch.Tensor, truth: torch.Tensor, ratio: float) -> float:
    """Fraction of the top ``ratio`` entries of ``truth`` that are also in the top ``ratio`` of ``score``."""
    k = max(1, min(truth.numel(), math.ceil(ratio * truth.numel() - 1e-9)))
    picked = set(score.topk(k).indices.tolist())
    return len(picked & set(truth.topk(k).indices.tolist())) / k


class Tally:
    """Running sums over questions."""

    def __init__(self, n_layers: int) -> None:
        self.k_err = torch.zeros(n_layers, dtype=torch.float64)
        self.k_ref = torch.zeros(n_layers, dtype=torch.float64)
        self.v_err = torch.zeros(n_layers, dtype=torch.float64)
        self.v_ref = torch.zeros(n_layers, dtype=torch.float64)

    def add(self, ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add one chunk's energies; returns its squared K and V errors and the reference K and V
        squared norms, each per layer and token ``[L, n]``.
        """
        dk = (ref[0] - got[0]).pow(2).sum(dim=(1, 3))  # [L, n]
        dv = (ref[1] - got[1]).pow(2).sum(dim=(1, 3))
        nk, nv = ref[0].pow(2).sum(dim=(1, 3)), ref[1].pow(2).sum(dim=(1, 3))
        self.k_err += dk.sum(1).double()
        self.v_err += dv.sum(1).double()
        self.k_ref += nk.sum(1).double()
        self.v_ref += nv.sum(1).double()
        return dk, dv, nk, nv

    def energies(self) -> tuple[list[float], list[float]]:
        k = (self.k_err / self.k_ref.clamp_min(1e-30)).tolist()
        v = (self.v_err / self.v_ref.clamp_min(1e-30)).tolist()
        return k, v


def full_chunk_rows(lm: Any, prefix: Any, chunk_ids: list[list[int]]) -> list[KV]:
    """Each chunk's rows of one prefill of all the chunks in a row after ``prefix`` (a `PrefixCache`):
    the K/V a full prefill of the fused prompt gives them, pre-RoPE ``[L, H, n, D]``. The question
    after the chunks is left out, as no chunk token attends to it.
    """
    from kvrag.indexing.kvgen import chunk_caches

    _, (keys, values) = next(chunk_caches(lm, prefix, [sum(chunk_ids, [])]))
    rows, pos = [], 0
    for ids in chunk_ids:
        rows.append((keys[:, :, pos : pos + len(ids)].contiguous(), values[:, :, pos : pos + len(ids)].contiguous()))
        pos += len(ids)
    return rows


def stored_and_full(rag: Any, item: dict[str, Any]) -> tuple[list[list[int]], list[tuple[KV, KV]]]:
    """An item's passages' token ids, and for each passage after the first its stored cache paired
    with the K/V that a full prefill of the fused prompt gives the same tokens: ``(full, stored)``,
    float32 pre-RoPE ``[L, H, n, D]`` each.
    """
    from kvrag.prompt import chunk_token_ids

    lm = rag.lm
    chunks = rag.resolve_chunks(passage_keys(rag, item))
    chunk_ids = [chunk_token_ids(lm.tokenizer, c.text) for c in chunks]
    pairs = []
    for chunk, (full_k, full_v) in zip(chunks[1:], full_chunk_rows(lm, rag.prefix, chunk_ids)[1:]):
        keys, values = rag.load_chunk(chunk)
        pairs.append(((full_k.float(), full_v.float()),
                      (keys.float().to(full_k.device), values.float().to(full_k.device))))
    return chunk_ids, pairs


def token_deviation(pairs: list[tuple[KV, KV]], tally: Tally) -> torch.Tensor:
    """Add each ``(full, stored)`` pair of `stored_and_full` to ``tally``; per layer and token of the
    pairs side by side ``[L, n]``: the squared K error over the layer's mean squared key norm, plus the
    same for V.
    """
    dk, dv, nk, nv = (torch.cat(part, 1) for part in zip(*(tally.add(ref, got) for ref, got in pairs)))
    return (dk / nk.mean(1, keepdim=True).clamp_min(1e-30) + dv / nv.mean(1, keepdim=True).clamp_min(1e-30)).cpu()


def measure_question(rag: Any, item: dict[str, Any], stored: Tally, neutral: Tally | None,
                     neutral_prefix: PrefixCache | None) -> dict[str, Any]:
    """Compare one question's stored chunk caches (and those computed after ``neutral_prefix``) with
    the caches a full prefill of its prompt gives the same tokens.
    """
    from kvrag.indexing.kvgen import chunk_caches

    chunk_ids, pairs = stored_and_full(rag, item)
    dev = token_deviation(pairs, stored)  # [L, n]
    if neutral is not None and neutral_prefix is not None:
        others = dict(chunk_caches(rag.lm, neutral_prefix, chunk_ids[1:]))
        for j, (ref, _) in enumerate(pairs):
            neutral.add(ref, (others[j][0].float(), others[j][1].float()))
    total = dev.sum(0)
    lengths = [ref[0].shape[2] for ref, _ in pairs]
    offset = torch.cat([torch.arange(n) for n in lengths]).clamp_max(OFFSET_BLOCK * OFFSET_BUCKETS - 1) // OFFSET_BLOCK
    bucket_sum = torch.zeros(OFFSET_BUCKETS).index_add_(0, offset, total)
    bucket_n = torch.zeros(OFFSET_BUCKETS).index_add_(0, offset, torch.ones_like(total))
    return {
        "id": item["id"],
        "tokens": int(total.numel()),
        "concentration": {str(r): top_share(total, r) for r in RATIOS},
        "ranking_by_layer": [top_overlap(dev[layer], total, 0.15) for layer in range(dev.shape[0])],
        "offset_sum": bucket_sum.tolist(),
        "offset_n": bucket_n.tolist(),
        # per chunk from the prompt's second on: summed deviation and token count
        "chunk_sum": [float(part.sum()) for part in total.split(lengths)],
        "chunk_n": lengths,
    }


def oracle_positions(rag: Any, item: dict[str, Any], ratio: float) -> torch.Tensor:
    """Fused-prompt positions of the ``ratio`` of an item's chunk tokens (as `probe` counts them)
    whose stored K/V deviate most from a full prefill, summed over layers: the selection an exact
    KV-deviation (HKVD) check would make, for measuring how far such a selector could go.
    """
    chunk_ids, pairs = stored_and_full(rag, item)
    if not pairs:
        return torch.zeros(0, dtype=torch.long)
    total = token_deviation(pairs, Tally(rag.lm.spec.n_layers)).sum(0)
    keep = min(math.ceil(ratio * sum(map(len, chunk_ids)) - 1e-9), int(total.numel()))
    return total.topk(keep).indices + rag.prefix.length + len(chunk_ids[0])


def _neutral_prefix(rag: Any, items: list[dict[str, Any]], count: int) -> tuple[PrefixCache, int]:
    """The index's prompt prefix followed by the first ``count`` passages of ``items``, prefilled once;
    and how many passage tokens it adds.
    """
    from kvrag.indexing.kvgen import prefix_cache
    from kvrag.prompt import chunk_token_ids

    passages = [passage_text(ctx) for item in items for ctx in item["ctxs"]][:count]
    if len(passages) < count:
        raise ValueError(f"--neutral-passages {count}: the file has only {len(passages)} passages after the first N "
                         "questions")
    ids = sum((chunk_token_ids(rag.lm.tokenizer, p) for p in passages), [])
    return prefix_cache(rag.lm, rag.prefix.ids.tolist() + ids), len(ids)


def summarise(rows: list[dict[str, Any]], stored: Tally, neutral: Tally | None) -> dict[str, Any]:
    k, v = stored.energies()
    n_layers = len(k)
    bucket_sum = torch.tensor([r["offset_sum"] for r in rows]).sum(0)
    bucket_n = torch.tensor([r["offset_n"] for r in rows]).sum(0)
    overall = float(bucket_sum.sum() / bucket_n.sum().clamp_min(1))
    out: dict[str, Any] = {
        "k_energy": k,
        "v_energy": v,
        "concentration": {str(r): sum(row["concentration"][str(r)] for row in rows) / len(rows) for r in RATIOS},
        "ranking_by_layer": [sum(row["ranking_by_layer"][i] for row in rows) / len(rows) for i in range(n_layers)],
        "offset_relative": [
            float(s / c) / overall if c > 0 and overall > 0 else None
            for s, c in zip(bucket_sum.tolist(), bucket_n.tolist())
        ],
        "prompt_position_relative": _by_prompt_position(rows, overall),
    }
    if neutral is not None:
        out["neutral_k_energy"], out["neutral_v_energy"] = neutral.energies()
    return out


def _by_prompt_position(rows: list[dict[str, Any]], overall: float) -> list[float | None]:
    """Mean deviation per token of the chunks at each place in the prompt (the second chunk first),
    over the questions that have a chunk there, relative to ``overall``.
    """
    places = max(len(r["chunk_sum"]) for r in rows)
    sums, counts = [0.0] * places, [0] * places
    for row in rows:
        for j, (s, c) in enumerate(zip(row["chunk_sum"], row["chunk_n"])):
            sums[j] += s
            counts[j] += c
    return [s / c / overall if c > 0 and overall > 0 else None for s, c in zip(sums, counts)]


def markdown(summary: dict[str, Any], header: str) -> str:
    neutral = "neutral_k_energy" in summary
    layer_headers = ["layer", "K deviation", "V deviation", "top-15% overlap"]
    if neutral:
        layer_headers += ["K (neutral context)", "V (neutral context)"]
    layer_rows = []
    for i, (k, v, o) in enumerate(zip(summary["k_energy"], summary["v_energy"], summary["ranking_by_layer"])):
        row = [i, k, v, o]
        if neutral:
            row += [summary["neutral_k_energy"][i], summary["neutral_v_energy"][i]]
        layer_rows.append(row)
    conc = common.markdown_table(["top share of tokens", "share of deviation"],
                                 [[f"{float(r):.0%}", s] for r, s in summary["concentration"].items()])
    offsets = common.markdown_table(
        ["offset in chunk", "mean deviation / overall mean"],
        [[f"{i * OFFSET_BLOCK}–{(i + 1) * OFFSET_BLOCK - 1}" if i < OFFSET_BUCKETS - 1 else f"≥ {i * OFFSET_BLOCK}", r]
         for i, r in enumerate(summary["offset_relative"])])
    places = common.markdown_table(
        ["chunk's place in the prompt", "mean deviation / overall mean"],
        [[j + 2, r] for j, r in enumerate(summary["prompt_position_relative"])])
    return (f"{header}\n\n## Per layer\n\nDeviation energy relative to the full prefill's; top-15% overlap: share "
            f"of the 15% of tokens with the largest total deviation that this layer's deviation also ranks in its "
            f"top 15% (random: 0.15).\n\n{common.markdown_table(layer_headers, layer_rows)}\n\n"
            f"## Concentration over tokens\n\n{conc}\n\n## Position in chunk\n\n{offsets}\n\n"
            f"## Position in the prompt\n\n{places}\n")


def layer_plot(summary: dict[str, Any], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    layers = list(range(len(summary["k_energy"])))
    ax.plot(layers, summary["k_energy"], marker="o", label="K (stored)")
    ax.plot(layers, summary["v_energy"], marker="o", label="V (stored)")
    if "neutral_k_energy" in summary:
        ax.plot(layers, summary["neutral_k_energy"], linestyle="--", label="K (neutral context)")
        ax.plot(layers, summary["neutral_v_energy"], linestyle="--", label="V (neutral context)")
    ax.set_xlabel("layer")
    ax.set_ylabel("deviation energy / full-prefill energy")
    common.save_plot(plt, fig, ax, path, title)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    common.set_threads(args.threads)
    if args.n < 1 or args.neutral_passages < 0:
        raise ValueError("--n must be >= 1 and --neutral-passages >= 0")
    # the questions measured, then (with --neutral-passages) enough more to take that many passages from
    loaded = load_questions(Path(args.data), args.n + args.neutral_passages)
    items, extra = loaded[: args.n], loaded[args.n :]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-") as tmp:
        rag, _ = build_index(args, items, Path(args.index) if args.index else Path(tmp) / "index")
        with rag:
            neutral_prefix, neutral_tokens = (_neutral_prefix(rag, extra, args.neutral_passages)
                                              if args.neutral_passages else (None, 0))
            n_layers = rag.lm.spec.n_layers
            stored = Tally(n_layers)
            neutral = Tally(n_layers) if neutral_prefix is not None else None
            rows = []
            for item in tqdm(items, desc="questions", unit="q", disable=None):
                if len(item["ctxs"]) < 2:
                    log.warning("%s has fewer than two passages; skipped", item["id"])
                    continue
                rows.append(measure_question(rag, item, stored, neutral, neutral_prefix))
    if not rows:
        raise ValueError("no question with at least two passages")
    summary = summarise(rows, stored, neutral)
    payload = {**common.stamp(args), "data": args.data, "model": args.model, "n_questions": len(rows),
               "neutral_passages": args.neutral_passages, "neutral_tokens": neutral_tokens,
               "summary": summary, "rows": rows}
    common.write_json(out / "deviation.json", payload)
    header = (f"# deviation of stored caches\n\n`{payload['command']}`\n\n{len(rows)} questions from "
              f"`{Path(args.data).name}`, model `{args.model}`, {sum(r['tokens'] for r in rows)} chunk tokens "
              f"compared (chunks after the first)"
              + (f"; neutral context: {neutral_tokens} tokens" if args.neutral_passages else "") + ".")
    text = markdown(summary, header)
    (out / "deviation.md").write_text(text)
    layer_plot(summary, out / "deviation_layers.png", f"{Path(args.data).name}, {len(rows)} q, {args.model}")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
