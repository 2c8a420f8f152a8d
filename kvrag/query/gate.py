"""The correctness gate: decide per answer whether the fused cache can be trusted; escalate when not.

Three steps, each cheap next to a fusion:

1. **Cost.** A prompt whose stale chunk tokens (all but the first chunk, whose cache is exact) are fewer
   than `GateConfig.full_below_tokens` has every one of them recomputed outright: fusion would save little
   there. By default it reads the first chunk's stored cache and recomputes the rest (the ``prefix`` mode,
   `GateConfig.short_mode`), which gives the full prefill's answer sooner.
2. **Check.** After the fused pass, before decoding: the first token's log-probability lead over the
   runner-up (its *margin*), and, for a mode that runs a probe pass (``probe``), whether the question
   alone over the stored caches predicted the same first token. Where recomputing 15 % of the tokens
   changed the first token, the stored caches matter to this answer more than the selection covers.
   By default the check passes every fused pass (see `GateConfig` for why); ``strict`` makes it bite.
3. **Escalate.** A failed check fuses again at each ratio of `GateConfig.ladder` in turn, and at the end
   prefills in full. With `GateConfig.strict`, a failure goes straight to the full prefill.

Everything the gate measured and did is kept in a `GateReport` (`Answer.gate`); the answer's time to first
token counts every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvrag.config import DEFAULT_MODE, FuseConfig, GateConfig
from kvrag.fusion import FusionResult, Selector
from kvrag.indexing.kvgen import KV
from kvrag.query import pipeline
from kvrag.query.answer import RetrievedChunk
from kvrag.query.pipeline import FusedPrompt, QueryContext


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
    # token recomputed (the attempt's mode says how: "prefix" or "full")
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


def stale_tokens(ctx: QueryContext, chunks: Sequence[RetrievedChunk], first_exact: bool = True) -> int:
    """Chunk tokens whose stored caches are approximate in this prompt: all but the first chunk's."""
    lengths = [len(ctx.chunk_ids(c.text)) for c in chunks]
    return sum(lengths[1:] if first_exact else lengths)


def gated_prepare(ctx: QueryContext, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
                  config: FuseConfig, gate: GateConfig, caches: Sequence[KV | None] | None = None,
                  selector: Selector | None = None, first_exact: bool = True) -> FusedPrompt:
    """`pipeline.prepare` under the gate: the fused prompt it trusts, with its `GateReport` attached."""
    t0 = time.perf_counter()
    pipeline.check_question(question)
    used = pipeline.retrieve(ctx, question, k) if chunks is None else pipeline.resolve_chunks(ctx.index, chunks)
    retrieve_s = time.perf_counter() - t0
    exact_first = first_exact and ctx.prefix_exact
    report = GateReport("fused", stale_tokens(ctx, used, exact_first))
    if config.mode == "full":
        attempts = [config]
    elif report.stale_tokens < gate.full_below_tokens:
        report.decision = "short"
        short = gate.short_mode if exact_first and not gate.strict else "full"
        attempts = [replace(config, mode=short)]
    else:
        ladder = () if gate.strict else tuple(r for r in gate.ladder if r > config.ratio)
        attempts = [config, *(replace(config, ratio=r) for r in ladder), replace(config, mode="full")]
    fused: FusedPrompt | None = None
    for i, attempt in enumerate(attempts):
        t = time.perf_counter()
        fused = None  # a failed attempt's cache goes before the next attempt builds its own
        chooser = selector if attempt.mode == config.mode else None  # a given selector serves the fused mode only
        fused = pipeline.prepare(ctx, question, k, used, attempt, caches, chooser, first_exact)
        signals = read_signals(fused.fused)
        ok, why = (True, "") if attempt.mode == "full" or report.decision == "short" else passes(signals, gate)
        report.attempts.append({"mode": attempt.mode, "ratio": attempt.ratio, "signals": signals.to_json(),
                                "passed": ok, "reason": why, "seconds": time.perf_counter() - t})
        if ok:
            if i > 0:
                report.decision = "escalated"
            break
    assert fused is not None  # the last attempt, a full prefill, always passes
    fused.t0 = t0  # the answer's time to first token counts every attempt
    fused.timings["retrieve_s"] += retrieve_s
    fused.timings["gate_s"] = sum(a["seconds"] for a in report.attempts[:-1])
    fused.gate = report
    return fused


def prepare_answer(ctx: QueryContext, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
                   mode: str | None, ratio: float | None, fuse_config: FuseConfig | None = None,
                   caches: Sequence[KV | None] | None = None, first_exact: bool = True,
                   selector: Selector | None = None, gate: GateConfig | bool | None = None) -> FusedPrompt:
    """The fused prompt for `KVRag.answer`'s arguments: the gate runs when asked, or by default when no
    mode, ratio, fusion settings, selector or caches are given.
    """
    default = mode is None and ratio is None and fuse_config is None and selector is None and caches is None
    config = fuse_config or FuseConfig(mode=mode or DEFAULT_MODE, ratio=FuseConfig.ratio if ratio is None else ratio)
    gate_config = gate_settings(default if gate is None else gate)
    if gate_config is None or config.mode == "full":
        return pipeline.prepare(ctx, question, k, chunks, config, caches, selector, first_exact)
    return gated_prepare(ctx, question, k, chunks, config, gate_config, caches, selector, first_exact)
