"""Answer a flat prompt string — as LangChain or LlamaIndex hand it over — fusing the chunk caches in it.

The prompt is cut at the chunks `kvrag.query.spans.find_chunk_spans` locates and tokenized piece by piece:

    [head text][chunk 1 + SEPARATOR][text between]…[chunk k + SEPARATOR][tail text]

The head has no stored cache (it is the framework's template, not kvrag's prefix): its first token
is prefilled on the spot as the fusion prefix and the rest enters fusion as text; each cacheable
chunk brings its stored cache; the text between chunks enters fusion as a "chunk" without a cache
(always recomputed); the tail is the suffix. No stored chunk directly follows the fusion prefix,
so every selector treats every chunk as approximate (its cache was computed after kvrag's prefix).
A chunk found without the separator after it reuses the rows of its cache for its own tokens
(when they are a prefix of the stored ids); an edited chunk is not found and stays plain text.
Nothing matched means an ordinary full prefill of the prompt's token ids. With ``mode="full"`` the
result equals a plain forward pass over the same token ids — fusion never changes what is
computed, only what is reused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrag.config import DEFAULT_MODE, FuseConfig, GenerateConfig
from kvrag.errors import InputError
from kvrag.fusion import FusionInput, fuse
from kvrag.indexing.kvgen import KV, prefix_cache
from kvrag.model import hf_compat
from kvrag.prompt import chunk_token_ids
from kvrag.query.answer import Answer, RetrievedChunk, decode_into
from kvrag.query.spans import Span, find_chunk_spans

if TYPE_CHECKING:
    from kvrag.rag import KVRag


@dataclass
class FlatPlan:
    """A flat prompt cut into fusion pieces (token ids); ``chunks[i] is None`` marks plain text.

    ``sink_ids`` (the prompt's first token) is the fusion prefix; the rest of the head is the first
    piece, recomputed like any text. So no chunk sits where fusion assumes an exact cache (right
    after kvrag's own prefix) and every selector treats every chunk as approximate.
    """

    sink_ids: list[int]
    piece_ids: list[list[int]]
    chunks: list[RetrievedChunk | None]
    tail_ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.sink_ids) + sum(map(len, self.piece_ids)) + len(self.tail_ids)

    def token_ids(self) -> list[int]:
        """Return the whole prompt's token ids, as fused."""
        return self.sink_ids + [t for ids in self.piece_ids for t in ids] + self.tail_ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as the user turn of the model's chat template (with the generation prompt).

    Without a chat template the text is returned with the tokenizer's BOS in front, as kvrag's own
    prompt layout does.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return (tokenizer.bos_token or "") + text


def _cached_ids(tokenizer: Any, prompt: str, span: Span) -> list[int] | None:
    """Return the span's token ids if they are (a prefix of) the ids its cache was computed for.

    With the separator after it, a chunk's ids are exactly `chunk_token_ids`; without it (another
    formatter), its stripped text usually tokenizes to those ids minus the separator's, and a
    causal cache's first rows are then exact for it. Otherwise None: the span is plain text.
    """
    stored = chunk_token_ids(tokenizer, span.chunk.text)
    ids = _encode(tokenizer, prompt[span.start : span.stop])
    return ids if ids and stored[: len(ids)] == ids else None


def plan_flat_prompt(tokenizer: Any, prompt: str, spans: Sequence[Span]) -> FlatPlan | None:
    """Cut ``prompt`` at the spans whose caches fit; None when there is none to reuse.

    Spans before the prompt's second token join the head (a prefix must be prefilled anyway) and a
    span at the very end joins the tail (the last prompt token must be recomputed for its logits).
    """
    usable = [(s, ids) for s in spans if (ids := _cached_ids(tokenizer, prompt, s)) is not None]
    while usable and len(_encode(tokenizer, prompt[: usable[0][0].start])) < 2:
        usable.pop(0)
    if usable and not prompt[usable[-1][0].stop :]:
        usable.pop()
    if not usable:
        return None
    head = _encode(tokenizer, prompt[: usable[0][0].start])
    pieces: list[list[int]] = [head[1:]]
    chunks: list[RetrievedChunk | None] = [None]
    for i, (span, ids) in enumerate(usable):
        pieces.append(ids)
        chunks.append(span.chunk)  # type: ignore[arg-type]
        gap_end = usable[i + 1][0].start if i + 1 < len(usable) else span.stop
        gap = _encode(tokenizer, prompt[span.stop : gap_end])
        if gap:
            pieces.append(gap)
            chunks.append(None)
    return FlatPlan(head[:1], pieces, chunks, _encode(tokenizer, prompt[usable[-1][0].stop :]))


def _candidates(rag: KVRag, candidates: Sequence[str | RetrievedChunk] | None) -> list[RetrievedChunk]:
    if candidates is None:
        return [RetrievedChunk.from_record(r) for r in rag.index.records()]
    return rag.resolve_chunks(candidates)


def _load(rag: KVRag, chunk: RetrievedChunk | None, n: int, mode: str) -> KV | None:
    if chunk is None or mode == "full":
        return None
    keys, values = rag.load_chunk(chunk)  # [L, H, n_stored, D]; causal, so the first n rows stand alone
    return (keys[:, :, :n], values[:, :, :n]) if int(keys.shape[2]) >= n else None


def _full_prefill(rag: KVRag, ids: list[int]) -> tuple[Any, torch.Tensor]:
    device = rag.lm.device
    with torch.no_grad():
        out = rag.lm.model(input_ids=torch.tensor([ids], device=device), use_cache=True)
    return hf_compat.returned_cache(out), out.logits[0, -1].float()


def stream_flat_prompt(
    rag: KVRag, prompt: str, mode: str = DEFAULT_MODE, ratio: float = 0.15, max_new_tokens: int = 64, *,
    temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
    candidates: Sequence[str | RetrievedChunk] | None = None, fuse_config: FuseConfig | None = None,
) -> Iterator[str]:
    """Yield the answer to a flat ``prompt`` as it is generated; ``rag.last_answer`` holds the `Answer`.

    Args mirror `answer_flat_prompt`.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"prompt must be a non-empty str, got {prompt!r:.40}")
    fcfg = fuse_config or FuseConfig(mode=mode, ratio=ratio)
    gcfg = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
    lm, t0 = rag.lm, time.perf_counter()
    spans = find_chunk_spans(prompt, _candidates(rag, candidates))
    plan = plan_flat_prompt(lm.tokenizer, prompt, spans)
    t1 = time.perf_counter()
    timings = {"match_s": t1 - t0}
    n_tokens = plan.n_tokens if plan else len(_encode(lm.tokenizer, prompt))
    if n_tokens >= lm.spec.max_position:
        raise InputError(
            f"the prompt has {n_tokens} tokens but the model's context window is {lm.spec.max_position}")
    if plan is None:
        cache, logits = _full_prefill(rag, _encode(lm.tokenizer, prompt))
        used, fmode, fraction = [], "full", 1.0
        timings["fuse_s"] = time.perf_counter() - t1
    else:
        prefix = prefix_cache(lm, plan.sink_ids)
        t2 = time.perf_counter()
        kv = [_load(rag, c, len(ids), fcfg.mode) for c, ids in zip(plan.chunks, plan.piece_ids, strict=True)]
        t3 = time.perf_counter()
        pieces = [torch.tensor(ids) for ids in plan.piece_ids]
        inp = FusionInput(prefix, pieces, kv, torch.tensor(plan.tail_ids))
        fused = fuse(lm, inp, fcfg)
        cache, logits, fmode, fraction = fused.cache, fused.logits, fcfg.mode, fused.recompute_fraction
        used = [c for c in plan.chunks if c is not None]
        timings.update(head_s=t2 - t1, load_s=t3 - t2, fuse_s=fused.fuse_s)
    answer = Answer("", fmode, fcfg.ratio, math.nan, used, timings, n_prompt_tokens=n_tokens,
                    recompute_fraction=fraction)
    rag.last_answer = answer
    yield from decode_into(answer, lm, cache, logits, n_tokens, gcfg, t0)


def answer_flat_prompt(
    rag: KVRag, prompt: str, mode: str = DEFAULT_MODE, ratio: float = 0.15, max_new_tokens: int = 64, *,
    temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
    candidates: Sequence[str | RetrievedChunk] | None = None, fuse_config: FuseConfig | None = None,
) -> Answer:
    r"""Answer a flat prompt, reusing the caches of the stored chunks found in it.

    Args:
        rag: an opened `KVRag`.
        prompt: the exact prompt string (no chat template is added; see `chat_prompt`).
        mode: fusion mode (``full``, ``prefix``, ``reuse``, ``cacheblend``, ``probe`` (the default), ``attnlink``).
        ratio: ``cacheblend``'s or ``probe``'s recompute ratio in (0, 1].
        max_new_tokens: most tokens generated.
        temperature: 0 is greedy decoding.
        top_p: nucleus sampling mass.
        stop: strings that end the answer.
        seed: sampling seed.
        candidates: chunk keys or chunks that may occur in the prompt (default: every chunk of the
            index — fine for small indices; pass the retrieved ones for large indices).
        fuse_config: full control over fusion (overrides ``mode`` and ``ratio``).

    Returns:
        `Answer` whose ``chunks`` are the chunks whose caches were used, in prompt order, and whose
        ``mode`` is ``"full"`` when none was found.

    Example:
        >>> top = rag.retrieve("Who?", k=1)[0]  # doctest: +SKIP
        >>> prompt = "Context:\n" + top.text.strip() + "\n\nQ: Who?\nA:"  # doctest: +SKIP
        >>> answer_flat_prompt(rag, chat_prompt(rag.lm.tokenizer, prompt)).chunks  # doctest: +SKIP
    """
    stream = stream_flat_prompt(
        rag, prompt, mode, ratio, max_new_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
        candidates=candidates, fuse_config=fuse_config)
    for _ in stream:
        pass
    assert rag.last_answer is not None
    return rag.last_answer
