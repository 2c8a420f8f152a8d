"""SmolLM3: Llama-shaped, with layers without positional encoding (NoPE) between rotary ones
(``no_rope_layers[i] == 0``). A NoPE layer's keys carry no position, so they are stored and placed as they are
(its rotary embedding is the identity).
"""

from __future__ import annotations

from kvrag.model.families.base import DEFAULT_ROPE, Family, LayerKind, register_family


@register_family
class SmolLM3Family(Family):
    """Per layer: rotary or none, and the window ``layer_types`` gives it."""

    model_types = ("smollm3",)

    def layer_kinds(self) -> list[LayerKind]:
        uses_rope = self.config.no_rope_layers
        return [LayerKind(kind.window, DEFAULT_ROPE if uses_rope[i] else None)
                for i, kind in enumerate(super().layer_kinds())]
