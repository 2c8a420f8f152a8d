"""Phi-3 and Phi-4-mini: one fused q/k/v projection, a fused gate-up MLP, optional partial rotary; ``longrope``
checkpoints are static (their short factors) only up to their original context, so kvrag fuses them when
``max_position_embeddings`` does not exceed it and refuses them otherwise (`Family.refusal`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.model.cpu_linear import linear
from kvrag.model.families.base import Family, register_family


@register_family
class Phi3Family(Family):
    """The fused projection ``qkv_proj`` split into queries, keys and values."""

    model_types = ("phi3",)

    def projections(self, layer: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, d = self.config, self.head_dim
        qkv = linear(h, layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias)  # [1, n, (H + 2·KV)·D]
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        parts = qkv.split([q_size, kv_size, kv_size], dim=-1)
        queries, keys, values = (p.reshape(1, h.shape[1], -1, d).transpose(1, 2) for p in parts)
        return hf_compat.apply_rope(queries, *rope), hf_compat.apply_rope(keys, *rope), values

    def far_position(self) -> int:
        # longrope switches to its long factors past its original context, which `refusal` keeps the model within
        if hf_compat.rope_parameters(self.config).get("rope_type") == "longrope":
            return int(self.config.max_position_embeddings) - 1
        return super().far_position()
