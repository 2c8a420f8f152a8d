"""Mixture-of-experts families (Mixtral, Qwen3-MoE): Llama-shaped attention over a routed expert MLP.

A token's experts depend on that token's hidden state alone, so recomputing selected tokens routes them as a
full forward would: nothing differs from `Family` for fusion. Each layer runs its own forward.
"""

from __future__ import annotations

from kvrag.model.families.base import Family, register_family


@register_family
class ExpertsFamily(Family):
    """Llama attention (Qwen3-MoE: per-head q/k norms; Mixtral: an optional window over every layer)."""

    model_types = ("mixtral", "qwen3_moe")
