"""Granite: Llama-shaped, with an embedding multiplier, a residual multiplier, an attention scale and a logit
divisor.

The residual multiplier and the attention scale live in the decoder layer, which runs its own forward; the
embedding multiplier and the logit divisor live in the model's forward, which fusion does not call, so they are
applied here.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.families.base import Family, register_family


@register_family
class GraniteFamily(Family):
    """``embed = embedding · embedding_multiplier``; ``logits = lm_head(norm(h)) / logits_scaling``."""

    model_types = ("granite",)

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        return hf_compat.embed_tokens(model, ids) * self.config.embedding_multiplier

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        return hf_compat.final_logits(model, hidden) / self.config.logits_scaling
