"""An answer's plan under the correctness gate, made once before anything is fused, and its execution.

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
2. **Check** (`kvrag.query.gate`): after each fused pass, before decoding, whether it can be trusted.
3. **Escalate.** A failed check fuses again at each ratio of `GateConfig.ladder` in turn, and at the end
   prefills in full. With `GateConfig.strict`, a failure goes straight to the full prefill.

`plan_answer` gives an `AnswerPlan` (the attempts in order); `execute` runs it once, each attempt one
`kvrag.query.pipeline.run`, and attaches the `GateReport`; the answer's time to first token counts every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.config import GateConfig
from kvrag.fusion.selectors.base import Selector
from kvrag.model.prefix import KV
from kvrag.query.attempt import Attempt
from kvrag.query.gate import GateReport, passes, read_signals
from kvrag.query.pipeline import FusedPrompt, LaidOut, QueryContext, run


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
    if not gate.fuses:  # one chunk's cache saves less here than the fusion loop costs over a prefill
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
