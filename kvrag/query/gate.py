"""The correctness gate's check: whether one fused pass can be trusted, and the report of what the gate did.

After a fused pass, before decoding, `read_signals` reads the first token's log-probability lead over the runner-up
(its *margin*), and, for a mode that runs a probe pass (``probe``), whether the question alone over the stored
caches predicted the same first token. `passes` decides from them under a `GateConfig`: where recomputing 15 % of
the tokens changed the first token, the stored caches matter to this answer more than the selection covers. At the
settings `GateConfig` documents the check passes every fused pass; ``min_margin``, ``probe_must_agree`` and
``strict`` make it bite. Which passes an answer runs, and what a failed check escalates to, is
`kvrag.query.answer_plan`'s; everything measured and done is kept in a `GateReport` (`Answer.gate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag.config import GateConfig
from kvrag.fusion.inputs import FusionResult


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
