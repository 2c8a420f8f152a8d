"""OLMo 2: attention and MLP read the layer input un-normed and are normed after (post-norm blocks); its q/k norms
run over the whole projection, before it is split into heads.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.cpu_linear import linear
from kvrag.model.families.base import Family, register_family


@register_family
class Olmo2Family(Family):
    """Projections of the raw layer input; ``k_norm(k_proj(x))`` then heads, then rotary."""

    model_types = ("olmo2",)

    def attention_input(self, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def projections(self, layer: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, d = layer.self_attn, self.head_dim

        def heads(x: torch.Tensor) -> torch.Tensor:  # [1, n, heads·D] -> [1, heads, n, D]
            return x.view(1, h.shape[1], -1, d).transpose(1, 2)

        queries = heads(attn.q_norm(linear(h, attn.q_proj.weight, attn.q_proj.bias)))
        keys = heads(attn.k_norm(linear(h, attn.k_proj.weight, attn.k_proj.bias)))
        values = heads(linear(h, attn.v_proj.weight, attn.v_proj.bias))
        return hf_compat.apply_rope(queries, *rope), hf_compat.apply_rope(keys, *rope), values
