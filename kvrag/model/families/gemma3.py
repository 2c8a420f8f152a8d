"""Gemma 3 (text): sliding-window layers between global ones, each kind with its own rotary embedding (local
base, and a global one that may be scaled), per-head q/k norms, scaled embeddings; soft-caps where the config
sets them.

Its layers run under SDPA unless the config soft-caps attention logits (then eager, as Gemma 2). A config with
bidirectional attention is refused: fusion's chunks attend causally.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.families.base import Family, LayerKind, ScoreRule, register_family
from kvrag.model.families.gemma2 import soft_cap


@register_family
class Gemma3Family(Family):
    """Per layer: the window and the rotary embedding its ``layer_types`` entry names."""

    model_types = ("gemma3_text",)

    def eager_reason(self) -> str | None:
        return "SDPA does not soft-cap attention logits" if self.config.attn_logit_softcapping is not None else None

    def layer_kinds(self) -> list[LayerKind]:
        return [LayerKind(kind.window, layer_type)
                for kind, layer_type in zip(super().layer_kinds(), self.config.layer_types)]

    def rope_parameters(self) -> list[dict[str, Any]]:
        return [dict(self.config.rope_parameters[t]) for t in sorted(set(self.config.layer_types))]

    def refusal(self) -> str | None:
        if getattr(self.config, "use_bidirectional_attention", False):
            return "Gemma 3 with use_bidirectional_attention attends both ways; fusion's chunks attend causally"
        return super().refusal()

    def rotary(self, model: Any, key: str, like: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return hf_compat.rotary(model)(like, positions, key)

    def score_rule(self, model: Any, idx: int) -> ScoreRule:
        return ScoreRule(super().score_rule(model, idx).scale, self.config.attn_logit_softcapping)

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(hf_compat.final_logits(model, hidden), self.config.final_logit_softcapping)
