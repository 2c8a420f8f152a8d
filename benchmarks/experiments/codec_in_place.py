"""What a codec's rounding alone does to answers: a prompt's own caches, encoded, decoded and read in place.

    python benchmarks/experiments/codec_in_place.py --data benchmarks/data/musique_hipporag100.jsonl \\
        --fit 61:66 --eval 1:10 --codecs int8,cachegen@2,cachegen@3 --out DIR

Each question's passages are laid out under a chat prompt (~2K tokens for MuSiQue's 20 passages) and prefilled in
full, recording every layer's pre-RoPE keys and values (what kvrag's codecs encode). Each codec then encodes and
decodes them, and the prompt is read again with the decoded rows in place of the exact ones, except the template's
head before the first passage, which kvrag never stores (it computes that prefix at question time). Nothing else
differs from the full prefill, so what moves is the codec's doing. Per question and codec: bits per element (the
blobs' bytes, container included), the teacher-forced \\|ΔNLL\\| of the full prefill's greedy answer, whether the
first token and the whole greedy answer are the same, and their agreement (`kvrag.bench.metrics.agreement`,
the token F1 of the answers' words).

Codec specs (comma-separated): ``int8``, ``raw``, ``cachegen@LEVEL``, and ``steps@K1/K2/K3:V1/V2/V3`` (``cachegen``
with its quantisation steps per layer third replaced, in units of each layer's RMS). A ``+kv:0-9`` suffix keeps the
decoded rows of only those kinds (``k``, ``v``) and layers and the exact rows elsewhere: where the rounding matters.
A ``~err:0.02`` suffix reads the exact rows of the 2 % of the prompt's tokens (after the head) whose rounding error
is largest, summed over layers and K/V, each layer's error relative to its mean (an oracle); ``~norm:0.02`` those
whose exact rows have the largest norms (what a codec could see); ``~kerr:0.05`` by the keys' error alone. Their
bits count the kept tokens at 16 bits an element on top of the codec's own: whether the damage sits in few tokens.
``cachegen`` is fitted once on the ``--fit`` questions' caches (none of them evaluated).

The model runs through transformers' modules (``KVRAG_NATIVE_MODELS=0``), whose projections can be hooked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("KVRAG_NATIVE_MODELS", "0")

import torch  # noqa: E402

from kvrag.bench.metrics import agreement, first_token_agreement  # noqa: E402
from kvrag.bench.qa_data import load_questions, passage_text  # noqa: E402
from kvrag.codec.base import Codec, make_codec  # noqa: E402
from kvrag.codec.cachegen import CacheGenCodec  # noqa: E402
from kvrag.model.loading import load_model  # noqa: E402

FIT_CHUNK = 256  # tokens per sample chunk `cachegen` is fitted on
INSTRUCTION = "Answer the question from the passages, in a few words."


@dataclass
class Rows:
    """One prompt's exact pre-RoPE keys and values per layer, ``[T, kv_heads * head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class HookedModel:
    """The model with its k/v projections recorded, or replaced over the prompt's first rows."""

    def __init__(self, name: str) -> None:
        self.lm = load_model(name, dtype="float32")
        self.model, self.tok = self.lm.model, self.lm.tokenizer
        cfg = self.model.config
        self.layers = self.model.model.layers
        self.heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.recorded: dict[str, list[torch.Tensor | None]] = {}
        self.replacing: dict[str, list[torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_proj.register_forward_hook(self._hook("k", i))
            layer.self_attn.v_proj.register_forward_hook(self._hook("v", i))

    def _hook(self, kind: str, layer: int) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            if kind in self.recorded and self.recorded[kind][layer] is None:  # the prompt's pass only
                self.recorded[kind][layer] = out[0].detach().clone()
            rows = self.replacing.get(kind)
            if rows is not None and out.shape[1] >= rows[layer].shape[0]:
                out = out.clone()
                out[0, : rows[layer].shape[0]] = rows[layer].to(out.dtype)
            return out
        return hook

    def prompt(self, item: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The prompt's token ids and the length of its head (the tokens before the first passage)."""
        context = "\n\n".join(passage_text(ctx) for ctx in item["ctxs"])
        user = f"{INSTRUCTION}\n\n{context}\n\nQuestion: {item['question']}"
        text = self.tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                            tokenize=False)
        head_text = text[: text.index(context)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        head = len(self.tok(head_text, add_special_tokens=False)["input_ids"])
        return torch.tensor(ids), head

    def record(self, ids: torch.Tensor, n: int = 1) -> tuple[Rows, list[int], float]:
        """The prompt's exact rows, with `read`'s greedy answer and its NLL."""
        layers = len(self.layers)
        self.recorded = {"k": [None] * layers, "v": [None] * layers}
        try:
            tokens, nll = self.read(ids, n)
            keys, values = self.recorded["k"], self.recorded["v"]
        finally:
            self.recorded = {}
        return Rows([t for t in keys if t is not None], [t for t in values if t is not None]), tokens, nll

    @torch.no_grad()
    def read(self, ids: torch.Tensor, n: int, reference: list[int] | None = None) -> tuple[list[int], float]:
        """One prefill of ``ids`` (rows replaced where `replacing` says, keys and values recorded where `recorded`
        is set), then the greedy answer of up to ``n`` tokens and the teacher-forced NLL per token of ``reference``
        (of the greedy answer itself when None) over the same prompt cache.
        """
        out = self.model(ids[None], use_cache=True)
        cache, last = out.past_key_values, out.logits[0, -1]
        replacing, self.replacing = self.replacing, {}  # later steps are the model's own
        try:
            tokens = [int(last.argmax())]
            while len(tokens) < n and tokens[-1] != self.tok.eos_token_id:
                out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            target = tokens if reference is None else reference
            if extra := cache.get_seq_length() - len(ids):  # back to the prompt's rows
                cache.crop(-extra)
            logits = [last[None]]
            if len(target) > 1:
                logits.append(self.model(torch.tensor([target[:-1]]), past_key_values=cache).logits[0])
            nll = float(torch.nn.functional.cross_entropy(torch.cat(logits), torch.tensor(target)))
        finally:
            self.replacing = replacing
        return tokens, nll

    def split(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1, self.heads, self.head_dim).transpose(0, 1)  # [H, T, D]


@dataclass
class Spec:
    """A codec spec: the codec, and the kinds and layers whose decoded rows are read (the rest exact)."""

    text: str
    codec: Codec
    kinds: str = "kv"
    layers: range | None = None
    keep: tuple[str, float] | None = None  # (criterion, fraction) of tokens read exact (module docstring)


def parse_specs(text: str, samples: list[tuple[torch.Tensor, torch.Tensor]], n_layers: int) -> list[Spec]:
    """The codecs ``text`` names; the ``cachegen`` ones fitted on ``samples``."""
    fitted = CacheGenCodec(level=2)
    if "cachegen@" in text:
        fitted.fit(samples, n_layers=n_layers)
    specs = []
    for whole in text.split(","):
        part, _, keep = whole.partition("~")
        name, _, only = part.partition("+")
        if name.startswith("cachegen@"):
            codec: Codec = fitted.with_level(int(name.split("@")[1]))
        elif name.startswith("steps@"):
            k, v = (tuple(float(x) for x in half.split("/")) for half in name.split("@")[1].split(":"))
            codec = CacheGenCodec(level=2, steps={2: (k, v)})
            codec.fit(samples, n_layers=n_layers)
        else:
            codec = make_codec(name)
        spec = Spec(whole, codec)
        if keep:
            criterion, _, fraction = keep.partition(":")
            if criterion not in ("err", "kerr", "norm"):
                raise ValueError(f"unknown criterion {criterion!r} in {whole}: err, kerr or norm")
            spec.keep = (criterion, float(fraction))
        if only:
            kinds, _, span = only.partition(":")
            lo, hi = (int(x) for x in span.split("-"))
            spec.kinds, spec.layers = kinds, range(lo, hi + 1)
        specs.append(spec)
    return specs


def fit_samples(hm: HookedModel, items: list[dict[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``items``' exact caches cut into `FIT_CHUNK`-token chunks ``[L, H, S, D]``, what `cachegen` fits on."""
    keys: list[list[torch.Tensor]] = [[] for _ in hm.layers]
    values: list[list[torch.Tensor]] = [[] for _ in hm.layers]
    for item in items:
        rows = hm.record(hm.prompt(item)[0])[0]
        for i in range(len(hm.layers)):
            keys[i].append(rows.keys[i])
            values[i].append(rows.values[i])
    k_all, v_all = [torch.cat(x) for x in keys], [torch.cat(x) for x in values]
    return [(torch.stack([hm.split(k[a : a + FIT_CHUNK]) for k in k_all]),
                torch.stack([hm.split(v[a : a + FIT_CHUNK]) for v in v_all]))
            for a in range(0, k_all[0].shape[0] - FIT_CHUNK + 1, FIT_CHUNK)]


def round_trip(hm: HookedModel, rows: Rows, spec: Spec, head: int) -> tuple[Rows, float]:
    """The rows as read back after ``spec``'s codec, and its bits per element."""
    out = Rows([], [])
    nbytes = elements = 0
    for i, (k, v) in enumerate(zip(rows.keys, rows.values, strict=True)):
        kh, vh = hm.split(k), hm.split(v)
        blob = spec.codec.encode_layer(kh, vh, i)
        nbytes, elements = nbytes + len(blob), elements + 2 * kh.numel()
        dk, dv = spec.codec.decode_layer(blob, i, tuple(kh.shape), torch.float32)
        used = spec.layers is None or i in spec.layers
        for kind, exact, decoded, dest in (("k", k, dk, out.keys), ("v", v, dv, out.values)):
            row = decoded.transpose(0, 1).reshape(exact.shape) if used and kind in spec.kinds else exact.clone()
            row[:head] = exact[:head]
            dest.append(row)
    bits = 8 * nbytes / elements
    if spec.keep is not None:
        bits += 16 * keep_exact(rows, out, head, *spec.keep)
    return out, bits


def keep_exact(exact: Rows, read: Rows, head: int, criterion: str, fraction: float) -> float:
    """Put back the exact rows of ``fraction`` of the tokens after ``head``, chosen by ``criterion`` (module
    docstring), in ``read``; the share of the prompt's tokens kept.
    """
    score = torch.zeros(exact.keys[0].shape[0])
    for layer in range(len(exact.keys)):
        for kind, rows, back in (("k", exact.keys, read.keys), ("v", exact.values, read.values)):
            if criterion == "kerr" and kind != "k":
                continue
            part = ((back[layer] - rows[layer]) ** 2 if criterion != "norm" else rows[layer] ** 2).sum(-1)
            score += part / part.mean()
    score[:head] = -1
    picked = torch.topk(score, round(fraction * (score.numel() - head))).indices
    for layer in range(len(exact.keys)):
        read.keys[layer][picked] = exact.keys[layer][picked]
        read.values[layer][picked] = exact.values[layer][picked]
    return picked.numel() / score.numel()


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


def summarise(rows: list[dict[str, Any]]) -> str:
    lines = ["| codec | questions | bits/element | × smaller than bf16 | mean \\|ΔNLL\\| | median | same first token "
             "| same answer | agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for spec in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == spec]
        bits = statistics.mean(r["bits"] for r in mine)
        dnll = [r["dnll"] for r in mine]
        lines.append(f"| `{spec}` | {len(mine)} | {bits:.2f} | {16 / bits:.2f} | {statistics.mean(dnll):.4f} | "
                     f"{statistics.median(dnll):.4f} | {sum(r['first_same'] for r in mine)} | "
                     f"{sum(r['same'] for r in mine)} | {statistics.mean(r['f1'] for r in mine):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, type=Path, help="QA JSONL: {id, question, answers, ctxs}")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--fit", default="61:66", help="questions FIRST:LAST (1-based) whose caches fit cachegen")
    parser.add_argument("--eval", default="1:10", help="questions FIRST:LAST (1-based) evaluated")
    parser.add_argument("--codecs", default="int8,cachegen@2,cachegen@3")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="folder for rows.jsonl and summary.md")
    parser.add_argument("--summarise", nargs="*", type=Path, help="only print the summary of these rows.jsonl")
    args = parser.parse_args(argv)
    if args.summarise:
        print(summarise([json.loads(line) for path in args.summarise for line in path.open()]))
        return 0
    torch.set_num_threads(args.threads)
    fit, evaluated = span(args.fit), span(args.eval)
    items = load_questions(args.data, max(fit[1], evaluated[1]))
    hm = HookedModel(args.model)
    specs = parse_specs(args.codecs, fit_samples(hm, items[fit[0] - 1 : fit[1]]), len(hm.layers))
    rows = []
    sink = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        sink = (args.out / "rows.jsonl").open("w")
    for item in items[evaluated[0] - 1 : evaluated[1]]:
        ids, head = hm.prompt(item)
        exact, answer, base = hm.record(ids, args.max_new_tokens)
        reference = hm.tok.decode(answer, skip_special_tokens=True)
        for spec in specs:
            read, bits = round_trip(hm, exact, spec, head)
            hm.replacing = {"k": read.keys, "v": read.values}
            try:
                tokens, nll = hm.read(ids, args.max_new_tokens, reference=answer)
            finally:
                hm.replacing = {}
            row = {"item": item["id"], "tokens": len(ids), "head": head, "codec": spec.text, "bits": bits,
                   "dnll": abs(nll - base), "first_same": bool(first_token_agreement(tokens, answer)),
                   "same": tokens == answer,
                   "f1": agreement(hm.tok.decode(tokens, skip_special_tokens=True), reference)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
    summary = summarise(rows)
    print(summary)
    if args.out:
        (args.out / "summary.md").write_text(summary + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
