"""``prefix``: reuse only the first chunk's cache, recompute everything after it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.fusion.inputs import Segments


@register_selector("prefix")
class PrefixSelector(Selector):
    """Reuse only the first chunk (whose cache is exact: it was computed right after the prefix)."""

    reads_first_chunk_only = True  # the others are recomputed: their caches are not loaded

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]
        if len(seg.chunk_starts) > 1:
            mask[seg.chunk_starts[1] : seg.suffix_start] = True
        return mask
