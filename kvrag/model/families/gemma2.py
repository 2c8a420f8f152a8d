"""Gemma 2: sliding-window layers alternating with global ones, attention logits soft-capped, final logits
soft-capped, scaled embeddings (inside its embedding module).

SDPA cannot soft-cap attention logits, so its layers run their own forward with transformers' eager attention,
under the dense masks fusion builds for them (each layer's window applied).
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.families.base import Family, ScoreRule, register_family


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` (the logits themselves for no cap)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


@register_family
class Gemma2Family(Family):
    """Eager attention; ``logits = cap · tanh(lm_head(norm(h)) / cap)``."""

    model_types = ("gemma2",)

    def eager_reason(self) -> str:
        return "SDPA does not soft-cap attention logits"

    def score_rule(self, model: Any, idx: int) -> ScoreRule:
        return ScoreRule(super().score_rule(model, idx).scale, self.config.attn_logit_softcapping)

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(hf_compat.final_logits(model, hidden), self.config.final_logit_softcapping)
