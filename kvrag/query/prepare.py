"""Where an answer's fusion is prepared: a question (`prepare_answer`) or a framework's flat prompt (`prepare_prompt`).

Contract: `settings` turns the answering methods' arguments into the fusion asked for (an `Attempt`, its mode
resolved once) and the gate's settings, refusing an unknown mode or option before any work. `prepare_answer`
retrieves (or resolves the chunks given), lays out the prompt in kvrag's layout, plans and executes
(`kvrag.query.answer_plan`); `prepare_prompt` finds the passages of a flat prompt (`kvrag.query.locate`) and plans
and executes the same way. Both give the `FusedPrompt` that generation decodes from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvrag.config import DEFAULT_MODE, FuseConfig, GateConfig
from kvrag.fusion.selectors.base import Selector
from kvrag.model import hf_compat
from kvrag.model.prefix import KV
from kvrag.query import pipeline
from kvrag.query.answer import RetrievedChunk
from kvrag.query.answer_plan import execute, plan_answer
from kvrag.query.attempt import Attempt
from kvrag.query.gate import gate_settings
from kvrag.query.locate import lay_out_prompt
from kvrag.query.pipeline import FusedPrompt, QueryContext


def settings(mode: str | None, ratio: float | None, fuse_config: FuseConfig | None, selector: Selector | None,
             caches: Sequence[KV | None] | None, gate: GateConfig | bool | None
             ) -> tuple[Attempt, GateConfig | None]:
    """The fusion asked for (its mode resolved once, `Attempt.of`) and the gate, from `KVRag.answer`'s arguments:
    the gate runs when asked, or by default when no mode, ratio, fusion settings, selector or caches are given. An
    unknown mode or option raises ValueError here, before any work.
    """
    default = mode is None and ratio is None and fuse_config is None and selector is None and caches is None
    config = fuse_config or FuseConfig(mode=mode or DEFAULT_MODE, ratio=FuseConfig.ratio if ratio is None else ratio)
    return Attempt.of(config), gate_settings(default if gate is None else gate)


def prepare_answer(ctx: QueryContext, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
                   mode: str | None, ratio: float | None, fuse_config: FuseConfig | None = None,
                   caches: Sequence[KV | None] | None = None, first_exact: bool = True,
                   selector: Selector | None = None, gate: GateConfig | bool | None = None) -> FusedPrompt:
    """The fused prompt for `KVRag.answer`'s arguments: retrieve (or resolve ``chunks``), lay out, plan, execute."""
    t0 = time.perf_counter()
    asked, gate_config = settings(mode, ratio, fuse_config, selector, caches, gate)
    pipeline.check_question(question)
    if caches is not None and chunks is None:
        raise ValueError("caches= needs chunks= (one cache per chunk, in the same order)")
    if not first_exact and caches is None:
        raise ValueError("first_exact=False describes caches= given by the caller; the index's own caches "
                         "know where they were computed")
    used = pipeline.retrieve(ctx, question, k) if chunks is None else pipeline.resolve_chunks(ctx.index, chunks)
    if caches is not None and len(caches) != len(used):
        raise ValueError(f"caches has {len(caches)} entries but chunks has {len(used)}; give one per chunk")
    laid = pipeline.lay_out(ctx, question, used, t0, {"retrieve_s": time.perf_counter() - t0})
    laid.first_exact = laid.first_exact and first_exact
    return execute(ctx, laid, plan_answer(laid, asked, gate_config), caches, selector, first_exact)


def prepare_prompt(ctx: QueryContext, prompt: str, candidates: Sequence[RetrievedChunk], asked: Attempt,
                   gate: GateConfig | None, selector: Selector | None = None) -> FusedPrompt:
    """The fused prompt for a framework's flat ``prompt`` under `settings`' ``asked`` attempt and ``gate``: its passages
    found among ``candidates`` (`kvrag.query.locate`), then planned and executed as `prepare_answer` does for a
    question. A plan that reads no cache (``full``, a short prompt without an exact first passage, a prompt mostly
    of text) runs over the prompt as one text: exactly a plain prefill's tokens, not the pieces' (the pieces'
    tokens can differ where a passage meets the template's text). Under the gate, such an exact answer's prompt is
    kept (`kvrag.query.head_cache.HeadCache.keep_prompt`), and passages a kept prompt holds are read from its rows.
    """
    kept = gate is not None  # the gate's path reads and keeps whole prompts (`kvrag.query.head_cache`)
    laid = lay_out_prompt(ctx, prompt, candidates, kept=kept)
    plan = plan_answer(laid, asked, gate)
    if laid.used and all(a.kind.recomputes_all for a in plan.attempts):
        # nothing will be read: the prompt as one text, tokenized as a plain prefill tokenizes it
        found, laid = laid.kept + laid.used, lay_out_prompt(ctx, prompt, [], kept=kept)
        laid.found = found
        whole = plan_answer(laid, asked, gate)
        kept_whole = whole.decision == "kept"
        plan = whole if kept_whole else replace(whole, decision=plan.decision, stale_tokens=plan.stale_tokens)
    fused = execute(ctx, laid, plan, None, selector)
    fused.prompt_ids = torch.cat([laid.prefix.ids.cpu(), *laid.piece_ids, laid.suffix_ids]).tolist()
    fused.exact_rows = all(chunk is None for chunk in laid.chunks)  # exact head rows and one pass over the rest
    if kept and fused.exact_rows:
        ctx.heads.keep_prompt(fused.prompt_ids, hf_compat.cache_layers(fused.fused.cache))
    return fused
