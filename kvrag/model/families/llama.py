"""The Llama family (Llama, Mistral, Qwen2, Qwen3): the shape `Family` describes, with nothing to override.

Their decoder layers run from their parts (`kvrag.model.llama_layer`) where `llama_layer.runs_plain` takes them.
Mistral's window covers every layer; Qwen2's covers the layers its ``layer_types`` mark as sliding.
"""

from __future__ import annotations

from kvrag.model.families.base import Family, register_family


@register_family
class LlamaFamily(Family):
    """Pre-norm attention (Qwen3: per-head q/k norms), one rotary embedding, a gated MLP."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")
