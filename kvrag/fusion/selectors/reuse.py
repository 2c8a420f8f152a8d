"""``reuse``: every stored cache as it is; only the forced tokens (suffix, chunks without cache) run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.fusion.inputs import Segments


@register_selector("reuse")
class ReuseSelector(Selector):
    """Recompute nothing that has a stored cache: the cheapest mode, and the least faithful."""

    def initial(self, seg: Segments) -> torch.Tensor:
        return seg.forced.clone()  # bool [N]
