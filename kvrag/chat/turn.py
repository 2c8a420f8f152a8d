"""One conversation turn: retrieve for the user's message, fuse its passages after the kept history, answer.

A conversation's prompt is its messages in order, each user message carrying the passages retrieved for
it: ``[system][user 1: passages, question][answer 1][user 2: passages, question][answer 2]…``. A turn
appends to it and never changes what came before, so the history's KV is kept whole across turns: a turn
lays its passages after the kept KV (under the correctness gate by default, as `KVRag.answer`: recomputed there;
fused by a chosen mode or a fusing gate), prefills its question, decodes, and the conversation is kept with the turn's
prompt rows and its answer (`kvrag.chat.sessions`, in the background).

Without a kept history (the first turn, a conversation not seen, ``history_cache=False``) the history is
brought up by replaying its turns: each earlier user message's passages retrieved again and fused the same
way, each earlier answer prefilled. Replaying runs the operations the kept turns ran, so an answer over a
replayed history equals the answer over the kept one.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvrag.chat.history import HistoryKV, extend, plan_drop, truncated
from kvrag.chat.messages import Conversation, Turn, conversation
from kvrag.chat.sessions import ChatSessions, HistoryReport
from kvrag.config import FuseConfig, GateConfig, GenerateConfig
from kvrag.model import hf_compat
from kvrag.prompt import PromptLayout, chunk_token_ids
from kvrag.query import pipeline
from kvrag.query.answer import Answer, RetrievedChunk
from kvrag.query.pipeline import FusedPrompt, QueryContext
from kvrag.query.prepare import prepare_answer


@dataclass(frozen=True)
class TurnSettings:
    """How every turn of a request retrieves and fuses (earlier turns replay with the same settings)."""

    k: int = 4
    mode: str | None = None
    ratio: float | None = None
    fuse_config: FuseConfig | None = None
    gate: GateConfig | bool | None = None


@dataclass
class FusedTurn:
    """A user message fused after the history: its `FusedPrompt` and what its kept rows need."""

    fused: FusedPrompt
    history: HistoryKV
    index: int
    ids: list[int]  # the turn's prompt ids after the history

    def state(self) -> HistoryKV:
        """The history and this user message, as kept KV (the prompt's rows of the fused cache)."""
        n = self.fused.fused.n_tokens
        layers = hf_compat.cache_layers(self.fused.fused.cache)
        keys = torch.stack([k[0, :, :n] for k, _ in layers])
        values = torch.stack([v[0, :, :n] for _, v in layers])
        return HistoryKV(self.history.ids + self.ids, [*self.history.spans, (self.index, len(self.ids))], keys, values)


def conversation_for(ctx: QueryContext, messages: Sequence[Any], passages: bool = True) -> Conversation:
    """``messages`` cut per message for this index's model and prompt."""
    return conversation(ctx.lm.tokenizer, messages, ctx.layout.instruction, ctx.layout.question_tail, passages)


def _passages(ctx: QueryContext, conv: Conversation, question: str, k: int) -> list[RetrievedChunk]:
    return pipeline.retrieve(ctx, question, k) if conv.passages else []


def _need(ctx: QueryContext, turn: Turn, chunks: list[RetrievedChunk], after: int) -> int:
    """Tokens a user message takes with its passages, plus ``after`` more (its answer)."""
    tok = ctx.lm.tokenizer
    return (len(turn.head or []) + sum(len(chunk_token_ids(tok, c.text)) for c in chunks)
            + len(tok(turn.suffix, add_special_tokens=False)["input_ids"]) + after)


def fit(ctx: QueryContext, sessions: ChatSessions, history: HistoryKV, need: int) -> HistoryKV:
    """``history`` with its oldest turns dropped until ``need`` more tokens fit the budget."""
    drop = plan_drop([count for _, count in history.spans], need, sessions.budget)
    if not drop:
        return history
    keep_from = history.spans[1 + drop][0] if 1 + drop < len(history.spans) else history.spans[-1][0] + 1
    return truncated(ctx.lm, history, keep_from)


def fuse_turn(ctx: QueryContext, history: HistoryKV, index: int, turn: Turn, question: str,
              chunks: list[RetrievedChunk], settings: TurnSettings) -> FusedTurn:
    """User message ``index`` fused after ``history``: its head prefilled, its passages fused, its question
    prefilled.
    """
    with_head = extend(ctx.lm, history, [(index, turn.head)]) if turn.head else history
    exact = len(history.spans) == 1 and with_head.ids == list(ctx.layout.prefix_ids)
    layout = PromptLayout("", turn.suffix.replace("{", "{{").replace("}", "}}"), (), ctx.layout.instruction,
                          ctx.layout.question_tail)
    turn_ctx = replace(ctx, prefix=with_head.prefix(), layout=layout, prefix_exact=exact, reuse_prefix=True)
    if chunks:
        fused = prepare_answer(turn_ctx, question, len(chunks), chunks, settings.mode, settings.ratio,
                               settings.fuse_config, gate=settings.gate)
    else:
        fused = pipeline.prepare(turn_ctx, question, 1, [], FuseConfig(mode="full"))
    chunk_ids, suffix = pipeline.prompt_ids(turn_ctx, question, fused.chunks)
    ids = list(turn.head or []) + [int(t) for c in chunk_ids for t in c.tolist()] + suffix.tolist()
    return FusedTurn(fused, history, index, ids)


def bring_up(ctx: QueryContext, sessions: ChatSessions, conv: Conversation, settings: TurnSettings, need: int,
             use_cache: bool) -> tuple[HistoryKV, HistoryReport]:
    """The history's KV: the longest kept prefix (with ``use_cache``), the rest replayed; then fitted so
    that ``need`` more tokens fit.
    """
    found, tier = sessions.find(conv) if use_cache else (None, None)
    history, reused = found, (found.length if found is not None else 0)
    i = 0 if found is None else max(m for m, _ in found.spans) + 1
    messages = conv.messages
    while i < len(messages):
        if history is None or messages[i]["role"] != "user":  # the system message, or an answer on its own
            history = extend(ctx.lm, history, [(i, conv.pieces[i])])
            if i == 0 and use_cache:  # every conversation with this system message starts from it
                sessions.keep(conv.pieces[0], history)
            i += 1
            continue
        turn = conv.user_turn(i)
        question = messages[i]["content"].strip()
        chunks = _passages(ctx, conv, question, settings.k)
        answered = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        reply = conv.reply(i, messages[i + 1]["content"]) if answered else []
        history = fit(ctx, sessions, history, _need(ctx, turn, chunks, len(reply)))
        state = fuse_turn(ctx, history, i, turn, question, chunks, settings).state()
        history = extend(ctx.lm, state, [(i + 1, reply)]) if reply else state
        i += 2 if answered else 1
    assert history is not None
    prefilled = history.length - reused
    history = fit(ctx, sessions, history, need)
    return history, HistoryReport(reused, max(0, prefilled), tier, history.dropped, use_cache)


def stream_turn(ctx: QueryContext, sessions: ChatSessions, messages: Sequence[Any], settings: TurnSettings,
                generate: GenerateConfig, *, retrieve: bool = True,
                chunks: Sequence[str | RetrievedChunk] | None = None, history_cache: bool = True,
                on_answer: Any = None) -> Generator[str, None, Answer]:
    """Yield the turn's answer text as it is generated and return the `Answer`; ``on_answer(answer)`` gets
    it once it exists (before the first piece). The conversation is kept after the last piece.
    """
    t0 = time.perf_counter()
    conv = conversation_for(ctx, messages, chunks is not None or (retrieve and settings.k > 0))
    index = len(conv.messages)
    used = (pipeline.resolve_chunks(ctx.index, chunks) if chunks is not None
            else _passages(ctx, conv, conv.question, settings.k))
    t1 = time.perf_counter()
    turn = conv.user_turn(index)
    history, report = bring_up(ctx, sessions, conv, settings, _need(ctx, turn, used, generate.max_new_tokens),
                               history_cache)
    t2 = time.perf_counter()
    fused_turn = fuse_turn(ctx, history, index, turn, conv.question, used, settings)
    fused = fused_turn.fused
    fused.t0 = t0  # the time to first token counts retrieval and the history too
    fused.timings["retrieve_s"] = t1 - t0 + fused.timings.get("retrieve_s", 0.0)
    fused.timings["history_s"] = t2 - t1
    pieces = fused.stream(generate)
    first = next(pieces, None)
    answer = fused.answer
    assert answer is not None
    answer.history = report
    if on_answer is not None:
        on_answer(answer)
    if first is not None:
        yield first
        yield from pieces
    if history_cache:
        sessions.keep_async([*conv.pieces, *conv.closing_pieces(answer.text)],
                            lambda: extend(ctx.lm, fused_turn.state(), [(index + 1, conv.reply(index, answer.text))]))
    return answer


def answer_turn(ctx: QueryContext, sessions: ChatSessions, messages: Sequence[Any], settings: TurnSettings,
                generate: GenerateConfig, **options: Any) -> Answer:
    """`stream_turn` to the end: the whole `Answer`."""
    got: list[Answer] = []
    for _ in stream_turn(ctx, sessions, messages, settings, generate, on_answer=got.append, **options):
        pass
    return got[0]
