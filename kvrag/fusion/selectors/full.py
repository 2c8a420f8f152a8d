"""``full``: recompute every position, a plain prefill (the reference every other mode is measured against)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.fusion.inputs import Segments


@register_selector("full")
class FullSelector(Selector):
    """Every position through every layer; the stored caches are not read."""

    def initial(self, seg: Segments) -> torch.Tensor:
        return seg.forced.new_ones(seg.total)  # bool [N], all True
