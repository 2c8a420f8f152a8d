"""``attnlink``: Epic's AttnLink, the first ``FuseConfig.link_tokens`` tokens of every stale chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.config import FuseConfig
    from kvrag.fusion.inputs import Segments


@register_selector("attnlink")
class AttnLinkSelector(Selector):
    """Epic's AttnLink: the first ``k`` tokens of every chunk after the first (of every chunk when
    even the first one's cache is stale), plus the suffix.

    Args:
        link_tokens: ``k``, the leading tokens recomputed per stale chunk.
    """

    value_field = "link_tokens"

    def __init__(self, link_tokens: int) -> None:
        self.link_tokens = link_tokens

    @classmethod
    def from_config(cls, config: FuseConfig) -> AttnLinkSelector:
        return cls(config.link_tokens)

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]
        for start, n in seg.stale:
            mask[start : start + min(n, self.link_tokens)] = True
        return mask
