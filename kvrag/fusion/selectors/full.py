"""``full``: recompute every position, a plain prefill (the reference every other mode is measured against)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.fusion.inputs import Segments


@register_selector("full")
class FullSelector(Selector):
    """Every position through every layer (after a reused prefix); the stored caches are not read."""

    recomputes_all = True

    def initial(self, seg: Segments) -> torch.Tensor:
        chosen = seg.forced.new_ones(seg.total)  # bool [N], all True
        if seg.reuse_prefix:  # a conversation's kept history: already exact
            chosen[: seg.prefix_len] = False
        return chosen
