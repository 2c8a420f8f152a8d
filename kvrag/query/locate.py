"""The first stage for a framework's flat prompt: find the stored passages in it and lay it out for fusion.

LangChain and LlamaIndex hand the LLM one string: their template with the retrieved passages stuffed in.
`lay_out_prompt` tokenizes it once, as a full prefill does, cuts the tokens at the passages
`kvrag.query.spans.find_chunk_spans` finds (`kvrag.query.prompt_tokens`) and gives the same `LaidOut` that
`kvrag.query.pipeline.lay_out` gives for a question, so the gate, its short-prompt path, the loading planner and
the streaming loader all run for it:

    [head][passage 1][text between]…[passage k][tail]

- The **head** (the template's text before the first passage: the chat template, the framework's
  instructions, in some templates the question) starts the prompt. The context's `HeadCache` keeps the heads
  of earlier prompts by token ids: the longest kept run of its leading tokens is the fusion prefix, exact and
  not recomputed, and the head's other tokens (a new question) are a text piece recomputed with the rest. A
  head equal to kvrag's own prompt prefix uses the index's prefix, so the first passage's stored cache is
  exact there.
- **Kept prompts** (``kept=True``, the gate's default path). The `HeadCache` also keeps whole prompts the gate
  answered from exact rows (`kvrag.query.prepare.prepare_prompt`). Passages that lie entirely inside the longest kept
  run of the prompt's leading tokens join the head: their exact rows are read from the kept prompt, not fused from
  their stored caches. A prompt asked again, or the same passages before a new question (a context-first
  template), has no passage left to fuse: its kept rows and one pass over the rest give the full prefill's answer.
- Each **passage** reads its stored cache for as many of its tokens in the prompt as equal, from the first, the
  ids that cache was computed for (`QueryContext.stored_ids`): all of them when the prompt holds it as it was
  stored, else its first rows (where the blank line after it tokenizes otherwise in the prompt); its other tokens
  are text. A passage edited, or whose first token differs (a template that joins a space to its first word),
  stays text.
- **Text between** passages is a piece without a cache, always recomputed; the **tail** (the question or
  the rest of the template, and the generation prompt) is the suffix.

The fused token ids are the prompt's own ids, so a mode that recomputes everything gives a plain forward pass over
exactly what a full prefill runs. Without any passage found, the prompt is the kept head rows it starts with
(`HeadCache.leading`), one text piece and its last token, all recomputed in one pass. A tokenizer without
character offsets (a slow one) has the pieces tokenized one by one instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvrag.errors import InputError
from kvrag.query.answer import RetrievedChunk
from kvrag.query.pipeline import LaidOut, QueryContext, check_length
from kvrag.query.prompt_tokens import PromptTokens, align, tokenize_prompt
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


def _cached_ids(ctx: QueryContext, prompt: str, span: Span) -> tuple[list[int], int] | None:
    """The span's token ids, and where they end in the prompt, if they are (a prefix of) the ids its cache was
    computed for, else None.
    """
    stored = ctx.stored_ids(span.chunk)  # type: ignore[arg-type]
    for stop in dict.fromkeys((span.stop, span.end)):  # with its separator, else without (a passage cache's own)
        ids = encode(ctx.lm.tokenizer, prompt[span.start : stop])
        if ids and stored[: len(ids)] == ids:
            return ids, stop
    return None


def _usable(ctx: QueryContext, prompt: str, spans: Sequence[Span]) -> list[tuple[Span, list[int], int]]:
    """The spans whose caches fit their tokens, with those tokens and where they end. A span at the very start
    joins the head (the prefix needs a token) and one at the very end joins the tail (the last token is
    recomputed for its logits).
    """
    usable = [(s, *fit) for s in spans if (fit := _cached_ids(ctx, prompt, s)) is not None]
    if usable and usable[0][0].start == 0:
        usable.pop(0)
    if usable and not prompt[usable[-1][2] :]:
        usable.pop()
    return usable


def _runs(ctx: QueryContext, tokens: PromptTokens, spans: Sequence[Span]) -> list[tuple[Span, int, int, int]]:
    """The spans whose caches fit the prompt's own tokens, each as ``(span, i, n, row)``: its tokens ``[i, i + n)``
    equal the ids its cache was computed for from row ``row`` on (`kvrag.query.prompt_tokens.align`: from the
    first token and row, or, where the prompt joined its first word to the space before it, from a later
    token and row). The span's other tokens are text. A run at the very start joins the
    head and one at the very end the tail.
    """
    runs: list[tuple[Span, int, int, int]] = []
    for span in spans:
        cover = tokens.cover(span.start, span.stop) or tokens.cover(span.start, span.end)  # with its separator
        if cover is None or (runs and cover[0] < runs[-1][1] + runs[-1][2]):
            continue
        i, j = cover
        n, skip, row = align(tokens.ids[i:j], ctx.stored_ids(span.chunk))  # type: ignore[arg-type]
        if n:
            runs.append((span, i + skip, n, row))
    if runs and runs[0][1] == 0:
        runs.pop(0)
    if runs and runs[-1][1] + runs[-1][2] >= len(tokens.ids):
        runs.pop()
    return runs


def _no_passage(ctx: QueryContext, prompt: str, ids: list[int], t0: float, kept: bool = False) -> LaidOut:
    """A prompt with no passage to read: the kept head rows it starts with (or kept prompt rows, with ``kept``), one
    text piece and its last token.
    """
    check_length(ctx, len(ids))
    if len(ids) < 2:
        raise InputError(f"the prompt {prompt!r:.40} has fewer than two tokens")
    t1 = time.perf_counter()
    prefix, rest = ctx.heads.leading(ctx.lm, ids[:-1], kept)  # the rest is recomputed in the answer's one pass
    return LaidOut(prefix, [None] if rest else [], [torch.tensor(rest)] if rest else [], torch.tensor(ids[-1:]),
                   False, True, t0, {"locate_s": t1 - t0, "head_s": time.perf_counter() - t1})


Piece = tuple[RetrievedChunk | None, list[int], int]  # (chunk or None for text, its ids, its first stored row)


def _laid_out(ctx: QueryContext, head: list[int], pieces: list[Piece], tail: list[int], t0: float,
              kept: bool = False) -> LaidOut:
    """The head's kept rows as the prefix (its other tokens a first text piece), then ``pieces`` (the empty ones
    left out), then ``tail``; ``rows_prefix`` and ``row_starts`` say which chunks read only part of their cache.
    """
    own = tuple(head) == tuple(ctx.layout.prefix_ids) and ctx.prefix_exact  # kvrag's own prompt prefix
    t_head = time.perf_counter()
    prefix, head_rest = (ctx.prefix, []) if own else ctx.heads.split(ctx.lm, head, kept)
    head_s = time.perf_counter() - t_head
    pieces = ([(None, head_rest, 0)] if head_rest else []) + [p for p in pieces if p[1]]
    check_length(ctx, prefix.length + sum(len(ids) for _, ids, _ in pieces) + len(tail))
    partial = any(c is not None and (row or len(ids) < len(ctx.stored_ids(c))) for c, ids, row in pieces)
    rows = [row for _, _, row in pieces]
    return LaidOut(prefix, [c for c, _, _ in pieces], [torch.tensor(ids) for _, ids, _ in pieces],
                   torch.tensor(tail), own, True, t0, {"locate_s": time.perf_counter() - t0 - head_s, "head_s": head_s},
                   partial, row_starts=rows if any(rows) else None)


def lay_out_prompt(ctx: QueryContext, prompt: str, candidates: Sequence[RetrievedChunk],
                   t0: float | None = None, kept: bool = False) -> LaidOut:
    """``prompt`` cut into head, passages, text between and tail (see the module docstring).

    Args:
        ctx: the index's question-time state.
        prompt: the exact prompt string (no chat template is added; see `chat_prompt`).
        candidates: the chunks that may occur in it.
        t0: when the prompt arrived (default: now).
        kept: read the passages that a kept whole prompt holds from its exact rows.

    Raises:
        InputError: an empty prompt, or one longer than the model's context window.
    """
    t0 = time.perf_counter() if t0 is None else t0
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"prompt must be a non-empty str, got {prompt!r:.40}")
    tokenizer = ctx.lm.tokenizer
    spans = find_chunk_spans(prompt, candidates)
    tokens = tokenize_prompt(tokenizer, prompt)
    if tokens is None:  # no character offsets: the pieces are tokenized one by one
        return _piecewise(ctx, prompt, spans, t0)
    found = _runs(ctx, tokens, spans)
    covered = ctx.heads.covered(tokens.ids) if kept and found else 0  # passages in kept exact rows join the head
    runs = [run for run in found if run[1] + run[2] > covered]
    inside: list[RetrievedChunk] = [run[0].chunk for run in found[: len(found) - len(runs)]]  # type: ignore[misc]
    if not runs:
        laid = _no_passage(ctx, prompt, tokens.ids, t0, kept)
        laid.kept = inside
        return laid
    ids, pieces = tokens.ids, list[Piece]()
    for k, (span, i, n, row) in enumerate(runs):
        pieces.append((span.chunk, ids[i : i + n], row))  # type: ignore[arg-type]
        pieces.append((None, ids[i + n : runs[k + 1][1] if k + 1 < len(runs) else i + n], 0))
    end = runs[-1][1] + runs[-1][2]
    laid = _laid_out(ctx, ids[: runs[0][1]], pieces, ids[end:], t0, kept)
    laid.kept = inside
    return laid


def _piecewise(ctx: QueryContext, prompt: str, spans: Sequence[Span], t0: float) -> LaidOut:
    """`lay_out_prompt` for a tokenizer without character offsets: each piece of the prompt tokenized alone."""
    tokenizer = ctx.lm.tokenizer
    usable = _usable(ctx, prompt, spans)
    if not usable:
        return _no_passage(ctx, prompt, encode(tokenizer, prompt), t0)
    pieces: list[Piece] = []
    for i, (span, ids, stop) in enumerate(usable):
        pieces.append((span.chunk, ids, 0))  # type: ignore[arg-type]
        gap_end = usable[i + 1][0].start if i + 1 < len(usable) else stop
        pieces.append((None, encode(tokenizer, prompt[stop:gap_end]), 0))
    return _laid_out(ctx, encode(tokenizer, prompt[: usable[0][0].start]), pieces,
                     encode(tokenizer, prompt[usable[-1][2] :]), t0)


def index_chunks(ctx: QueryContext) -> list[RetrievedChunk]:
    """Every chunk of the index, as candidates for a flat prompt (kept until the index grows)."""
    n = len(ctx.index)
    kept = ctx.all_chunks
    if kept is None or kept[0] != n:
        kept = ctx.all_chunks = (n, [RetrievedChunk.from_record(r) for r in ctx.index.records()])
    return kept[1]


__all__ = ["chat_prompt", "encode", "index_chunks", "lay_out_prompt"]
