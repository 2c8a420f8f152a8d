"""The correctness gate: decide per answer whether the fused cache can be trusted; escalate when not.

Three steps, each cheap next to a fusion:

1. **Cost and trust.** A prompt whose stale chunk tokens (all but the first chunk, whose cache is exact) are fewer
   than `GateConfig.full_below_tokens` has every one of them recomputed outright: fusion would save little there.
   It reads the first chunk's stored cache and recomputes the rest (the ``prefix`` mode, `GateConfig.short_mode`),
   which gives the full prefill's answer sooner. Unless `GateConfig.fuse` is set, a longer prompt is prefilled in
   full after its kept head (decision ``"exact"``): fused answers did not hold with the models measured, and one
   chunk's cache saves less there than the fusion loop costs over a plain prefill. A fusing gate prefills in
   full a prompt that is mostly text without a stored cache (more than `GateConfig.fuse_max_text_share` of it:
   passages seen for the first time), which is then sooner than a fused pass, and a prompt with text before its
   passages that no stored cache saw (more than `GateConfig.max_text_before` tokens: a question asked before the
   context), where fused answers part from the full prefill's at any ratio measured. A prompt whose every stored
   cache holds rows computed after exactly the tokens before it there (a passage cache's rows of this same prompt,
   `LaidOut.in_place`) recomputes only its text pieces and suffix: that is a full prefill's computation, up to the
   codec's rounding, and the check does not apply.
2. **Check.** After the fused pass, before decoding: the first token's log-probability lead over the
   runner-up (its *margin*), and, for a mode that runs a probe pass (``probe``), whether the question
   alone over the stored caches predicted the same first token. Where recomputing 15 % of the tokens
   changed the first token, the stored caches matter to this answer more than the selection covers.
   At the settings `GateConfig` documents the check passes every fused pass; ``min_margin``,
   ``probe_must_agree`` and ``strict`` make it bite.
3. **Escalate.** A failed check fuses again at each ratio of `GateConfig.ladder` in turn, and at the end
   prefills in full. With `GateConfig.strict`, a failure goes straight to the full prefill.

The steps are planned once per answer, before anything is fused (`plan_answer` gives an `AnswerPlan`: the
attempts in order), and executed once (`execute`). Both first stages end here: a question (`prepare_answer`,
after retrieval and kvrag's own layout) and a framework's flat prompt (`prepare_prompt`, after
`kvrag.query.locate` found its passages). Everything the gate measured and did is kept in a `GateReport`
(`Answer.gate`); the answer's time to first token counts every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvrag.config import DEFAULT_MODE, FuseConfig, GateConfig
from kvrag.fusion.inputs import FusionResult
from kvrag.fusion.selectors.base import Selector
from kvrag.model import hf_compat
from kvrag.model.prefix import KV
from kvrag.query import pipeline
from kvrag.query.answer import RetrievedChunk
from kvrag.query.attempt import Attempt
from kvrag.query.locate import lay_out_prompt
from kvrag.query.pipeline import FusedPrompt, LaidOut, QueryContext, run


@dataclass(frozen=True)
class Signals:
    """What the gate reads off one fused pass: its first token and margin, and its probe pass's."""

    top: int
    margin: float
    probe_top: int | None = None
    probe_margin: float | None = None

    @property
    def probe_agrees(self) -> bool | None:
        """Whether the probe pass predicted the fused pass's first token (None without a probe pass)."""
        return None if self.probe_top is None else self.probe_top == self.top

    def to_json(self) -> dict[str, Any]:
        """The signals as `Answer.to_json` reports them."""
        return {"top": self.top, "margin": self.margin, "probe_top": self.probe_top,
                "probe_margin": self.probe_margin, "probe_agrees": self.probe_agrees}


def _top_and_margin(logits: torch.Tensor) -> tuple[int, float]:
    """The argmax of ``logits`` ``[vocab]`` and its log-probability lead over the runner-up."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, 2)
    return int(best.indices[0]), float(best.values[0] - best.values[1])


def read_signals(fused: FusionResult) -> Signals:
    """The gate's signals for one fused pass."""
    top, margin = _top_and_margin(fused.logits)
    if fused.probe_logits is None:
        return Signals(top, margin)
    probe_top, probe_margin = _top_and_margin(fused.probe_logits)
    return Signals(top, margin, probe_top, probe_margin)


def passes(signals: Signals, gate: GateConfig) -> tuple[bool, str]:
    """Whether a fused pass with these ``signals`` is trusted, and why not when it is not."""
    min_margin = max(gate.min_margin, gate.strict_margin) if gate.strict else gate.min_margin
    if signals.margin < min_margin:
        return False, f"first-token margin {signals.margin:.3f} < {min_margin}"
    must_agree = gate.probe_must_agree or gate.strict
    if must_agree and signals.probe_agrees is False and (gate.strict or signals.margin < gate.sure_margin):
        return False, "the probe pass predicted another first token"
    return True, ""


@dataclass
class GateReport:
    """What the gate did for one answer: each attempt with its signals, and the outcome."""

    # "fused": the first attempt passed; "escalated": a later one was used; "short": a short prompt, every stale
    # token recomputed (the attempt's mode says how: "prefix" or "full"); "exact": a longer one answered so, as
    # the gate does unless it fuses (`GateConfig.fuse`); "text": mostly text without a cache,
    # prefilled in full; "text_before": text no stored cache saw before the passages (a question asked before the
    # context), prefilled in full; "kept": every passage read from a kept prompt's exact rows; "stored": every
    # passage read from stored rows computed after this very text (`LaidOut.in_place`), only the rest recomputed
    decision: str
    stale_tokens: int
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def escalations(self) -> int:
        """Attempts after the first."""
        return max(0, len(self.attempts) - 1)

    def to_json(self) -> dict[str, Any]:
        """The report as `Answer.to_json` gives it."""
        return {"decision": self.decision, "stale_tokens": self.stale_tokens, "escalations": self.escalations,
                "attempts": self.attempts}


def gate_settings(gate: GateConfig | bool) -> GateConfig | None:
    """The gate's settings from `KVRag.answer`'s ``gate`` argument (True: the defaults; False: off)."""
    if isinstance(gate, GateConfig):
        return gate
    return GateConfig() if gate else None


@dataclass(frozen=True)
class AnswerPlan:
    """What one answer runs, made once before anything is fused: the fusions to try in order (each an
    `Attempt`; the first one whose check passes is used) and the gate they answer to (None: no gate,
    one attempt). ``decision`` is the `GateReport`'s: ``"fused"``, ``"short"`` for a short prompt, ``"exact"`` for
    a longer one answered exactly (a gate that does not fuse), ``"text"`` for a prompt that is mostly text without a
    stored cache, ``"text_before"`` for one with new text before its passages, ``"kept"`` for one whose passages all
    lie in a kept prompt's exact rows (`kvrag.query.head_cache`), or ``"stored"`` for one whose passages' stored
    rows were all computed after the very tokens before them here (`LaidOut.in_place`).
    ``mode`` is the mode asked for: a selector given with it chooses only that mode's positions.
    """

    attempts: tuple[Attempt, ...]
    gate: GateConfig | None
    decision: str
    stale_tokens: int
    mode: str


def plan_answer(laid: LaidOut, asked: Attempt, gate: GateConfig | None) -> AnswerPlan:
    """The attempts for ``laid`` under the ``asked`` attempt and ``gate`` (see the module docstring).

    A mode that recomputes every position, or a prompt without a stored cache to read, is one attempt that
    recomputes everything. A prompt whose stored caches are all in place is one attempt of ``reuse``: its text
    pieces and suffix recomputed, nothing else. A short prompt is one attempt of ``gate.short_mode`` where the first
    chunk's cache is exact (else of the exact mode); a longer one under a gate that does not fuse, a prompt mostly of
    text without a cache, or one with new text before its passages, one attempt of the exact mode.
    Otherwise: ``asked``, the ladder's larger ratios, then the exact mode.
    """
    stale, mode = laid.stale_tokens, asked.mode
    if asked.kind.recomputes_all:
        return AnswerPlan((asked,), gate, "fused", stale, mode)
    if not any(c is not None for c in laid.chunks):
        return AnswerPlan((asked.exact(),), gate, "kept" if laid.kept else "short", stale, mode)
    if gate is None:
        return AnswerPlan((asked,), None, "fused", stale, mode)
    if laid.in_place:  # the stored rows are what a full prefill computes there: only the rest runs
        return AnswerPlan((asked.with_mode("reuse"),), gate, "stored", stale, mode)
    if stale < gate.full_below_tokens:
        short = asked.with_mode(gate.short_mode) if laid.first_exact and not gate.strict else asked.exact()
        return AnswerPlan((short,), gate, "short", stale, mode)
    if not (gate.fuse or gate.strict):  # one chunk's cache saves less here than the fusion loop costs over a prefill
        return AnswerPlan((asked.exact(),), gate, "exact", stale, mode)
    if laid.text_share > gate.fuse_max_text_share:
        return AnswerPlan((asked.exact(),), gate, "text", stale, mode)
    if laid.text_before > gate.max_text_before:
        return AnswerPlan((asked.exact(),), gate, "text_before", stale, mode)
    ladder = () if gate.strict else tuple(r for r in gate.ladder if r > asked.ratio)
    return AnswerPlan((asked, *(asked.with_ratio(r) for r in ladder), asked.exact()), gate, "fused", stale, mode)


def execute(ctx: QueryContext, laid: LaidOut, plan: AnswerPlan, caches: Sequence[KV | None] | None = None,
            selector: Selector | None = None, first_exact: bool = True) -> FusedPrompt:
    """Run ``plan``'s attempts over ``laid`` until one passes the gate's check: the fused prompt it trusts,
    with the `GateReport` attached when a gate was asked for. A given ``selector`` serves the mode asked for
    only.
    """
    report = GateReport(plan.decision, plan.stale_tokens) if plan.gate is not None else None
    fused: FusedPrompt | None = None
    spent = 0.0
    for i, attempt in enumerate(plan.attempts):
        t = time.perf_counter()
        fused = None  # a failed attempt's cache goes before the next attempt builds its own
        chooser = selector if attempt.mode == plan.mode else None
        fused = run(ctx, laid, attempt, caches, chooser, first_exact)
        if plan.gate is None:
            break
        signals = read_signals(fused.fused)
        final = i == len(plan.attempts) - 1  # a plan that is not fused has one attempt
        ok, why = (True, "") if final else passes(signals, plan.gate)
        seconds = time.perf_counter() - t
        assert report is not None  # made with the gate
        report.attempts.append({"mode": attempt.mode, "ratio": attempt.ratio, "signals": signals.to_json(),
                                "passed": ok, "reason": why, "seconds": seconds})
        if ok:
            if i > 0:
                report.decision = "escalated"
            break
        spent += seconds
    assert fused is not None  # the last attempt always passes
    if report is not None:
        fused.timings["gate_s"] = spent
        fused.gate = report
    return fused


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
