"""gpt-oss: learned attention sinks (one extra logit per head in every softmax), sliding-window layers alternating
with global ones, YaRN rotary scaling (static: exact when keys move), a routed expert MLP. Its rotary module
gives half-width ``(cos, sin)`` (one angle per pair of dimensions), which `full_width` repeats.

SDPA has no sinks, so its layers run their own forward with transformers' eager attention, under the dense masks
fusion builds for them (each layer's window applied).
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.families.base import Family, ScoreRule, register_family


@register_family
class GptOssFamily(Family):
    """Eager attention; otherwise Llama-shaped projections (with biases)."""

    model_types = ("gpt_oss",)

    def eager_reason(self) -> str:
        return "SDPA has no attention sinks"

    def score_rule(self, model: Any, idx: int) -> ScoreRule:
        attn = hf_compat.decoder_layers(model)[idx].self_attn
        return ScoreRule(float(attn.scaling), sinks=attn.sinks.detach())

    def full_width(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope  # [B, S, D/2]: x₁' = x₁ cos - x₂ sin, x₂' = x₂ cos + x₁ sin
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
