"""The first stage for a framework's flat prompt: find the stored passages in it and lay it out for fusion.

LangChain and LlamaIndex hand the LLM one string: their template with the retrieved passages stuffed in.
`lay_out_prompt` cuts it at the passages `kvrag.query.spans.find_chunk_spans` finds and tokenizes it piece by
piece into the same `LaidOut` that `kvrag.query.pipeline.lay_out` gives for a question, so the gate, its
short-prompt path, the loading planner and the streaming loader all run for it:

    [head][passage 1][text between]…[passage k][tail]

- The **head** (the template's text before the first passage: the chat template, the framework's
  instructions, in some templates the question) starts the prompt. The context's `HeadCache` keeps the heads
  of earlier prompts by token ids: the longest kept run of its leading tokens is the fusion prefix, exact and
  not recomputed, and the head's other tokens (a new question) are a text piece recomputed with the rest. A
  head equal to kvrag's own prompt prefix uses the index's prefix, so the first passage's stored cache is
  exact there.
- Each **passage** reads its stored cache: whole when kvrag's separator follows it in the prompt, else its
  first rows, where its tokens there are a prefix of the stored ones (a template that ends the context
  without a separator). A passage that tokenizes otherwise, or was edited, stays text.
- **Text between** passages is a piece without a cache, always recomputed; the **tail** (the question or
  the rest of the template, and the generation prompt) is the suffix.

The fused token ids are the pieces' ids one after another, so a mode that recomputes everything gives a
plain forward pass over exactly those ids. Without any passage found, the prompt is the kept head rows it starts
with (`HeadCache.leading`), one text piece and its last token, all recomputed in one pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvrag.errors import InputError
from kvrag.query.answer import RetrievedChunk
from kvrag.query.pipeline import LaidOut, QueryContext, check_length
from kvrag.query.spans import Span, find_chunk_spans


def chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as the user turn of the model's chat template (with the generation prompt).

    Without a chat template the text is returned with the tokenizer's BOS in front, as kvrag's own
    prompt layout does.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return (tokenizer.bos_token or "") + text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a piece of prompt text (special tokens as the text spells them, none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _cached_ids(ctx: QueryContext, prompt: str, span: Span) -> list[int] | None:
    """The span's token ids if they are (a prefix of) the ids its cache was computed for, else None."""
    stored = ctx.chunk_ids(span.chunk.text)
    ids = encode(ctx.lm.tokenizer, prompt[span.start : span.stop])
    return ids if ids and stored[: len(ids)] == ids else None


def _usable(ctx: QueryContext, prompt: str, spans: Sequence[Span]) -> list[tuple[Span, list[int]]]:
    """The spans whose caches fit their tokens, with those tokens. A span at the very start joins the head
    (the prefix needs a token) and one at the very end joins the tail (the last token is recomputed for its
    logits).
    """
    usable = [(s, ids) for s in spans if (ids := _cached_ids(ctx, prompt, s)) is not None]
    if usable and usable[0][0].start == 0:
        usable.pop(0)
    if usable and not prompt[usable[-1][0].stop :]:
        usable.pop()
    return usable


def lay_out_prompt(ctx: QueryContext, prompt: str, candidates: Sequence[RetrievedChunk],
                   t0: float | None = None) -> LaidOut:
    """``prompt`` cut into head, passages, text between and tail (see the module docstring).

    Args:
        ctx: the index's question-time state.
        prompt: the exact prompt string (no chat template is added; see `chat_prompt`).
        candidates: the chunks that may occur in it.
        t0: when the prompt arrived (default: now).

    Raises:
        InputError: an empty prompt, or one longer than the model's context window.
    """
    t0 = time.perf_counter() if t0 is None else t0
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"prompt must be a non-empty str, got {prompt!r:.40}")
    tokenizer = ctx.lm.tokenizer
    usable = _usable(ctx, prompt, find_chunk_spans(prompt, candidates))
    if not usable:  # nothing to reuse but a kept head: the prompt's last token is the suffix
        ids = encode(tokenizer, prompt)
        check_length(ctx, len(ids))
        if len(ids) < 2:
            raise InputError(f"the prompt {prompt!r:.40} has fewer than two tokens")
        t1 = time.perf_counter()
        prefix, rest = ctx.heads.leading(ctx.lm, ids[:-1])  # the rest is recomputed in the answer's one pass
        return LaidOut(prefix, [None] if rest else [], [torch.tensor(rest)] if rest else [], torch.tensor(ids[-1:]),
                       False, True, t0, {"locate_s": t1 - t0, "head_s": time.perf_counter() - t1})
    head = encode(tokenizer, prompt[: usable[0][0].start])
    own = tuple(head) == tuple(ctx.layout.prefix_ids) and ctx.prefix_exact  # kvrag's own prompt prefix
    t_head = time.perf_counter()
    prefix, head_rest = (ctx.prefix, []) if own else ctx.heads.split(ctx.lm, head)
    head_s = time.perf_counter() - t_head
    chunks: list[RetrievedChunk | None] = [None] if head_rest else []
    pieces: list[list[int]] = [head_rest] if head_rest else []
    for i, (span, ids) in enumerate(usable):
        chunks.append(span.chunk)  # type: ignore[arg-type]
        pieces.append(ids)
        gap_end = usable[i + 1][0].start if i + 1 < len(usable) else span.stop
        gap = encode(tokenizer, prompt[span.stop : gap_end])
        if gap:
            chunks.append(None)
            pieces.append(gap)
    tail = encode(tokenizer, prompt[usable[-1][0].stop :])
    check_length(ctx, prefix.length + sum(map(len, pieces)) + len(tail))
    rows_prefix = any(len(ids) < len(ctx.chunk_ids(span.chunk.text)) for span, ids in usable)
    return LaidOut(prefix, chunks, [torch.tensor(p) for p in pieces], torch.tensor(tail), own, True, t0,
                   {"locate_s": time.perf_counter() - t0 - head_s, "head_s": head_s}, rows_prefix)


def index_chunks(ctx: QueryContext) -> list[RetrievedChunk]:
    """Every chunk of the index, as candidates for a flat prompt (kept until the index grows)."""
    n = len(ctx.index)
    kept = ctx.all_chunks
    if kept is None or kept[0] != n:
        kept = ctx.all_chunks = (n, [RetrievedChunk.from_record(r) for r in ctx.index.records()])
    return kept[1]


__all__ = ["chat_prompt", "encode", "index_chunks", "lay_out_prompt"]
