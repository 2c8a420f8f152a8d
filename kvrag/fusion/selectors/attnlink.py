"""``attnlink``: Epic's AttnLink, the first ``link_tokens`` (an option, 16 by default) tokens of every stale chunk."""

from __future__ import annotations

from dataclasses import dataclass
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

    @dataclass(frozen=True)
    class Options:
        """``link_tokens``: the leading tokens recomputed per stale chunk."""

        link_tokens: int = 16

        def __post_init__(self) -> None:
            if isinstance(self.link_tokens, bool) or not isinstance(self.link_tokens, int) or self.link_tokens < 0:
                raise ValueError(f"link_tokens must be an int >= 0, got {self.link_tokens!r}")

    value_field = "link_tokens"

    def __init__(self, link_tokens: int) -> None:
        self.link_tokens = link_tokens

    @classmethod
    def from_config(cls, config: FuseConfig) -> AttnLinkSelector:
        return cls(cls.options(config).link_tokens)

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]
        for start, n in seg.stale:
            mask[start : start + min(n, self.link_tokens)] = True
        return mask
