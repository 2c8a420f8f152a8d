"""``cacheblend``: CacheBlend's HKVD selection with gradual filtering at its check layers.

Reads ``ratio`` from `FuseConfig` and its options ``check_layers``, ``first_ratio_scale`` and ``score``; the score
it ranks by is computed by the layer loop (`kvrag.fusion.scores.token_scores`, `Selector.check_score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrag.fusion.selectors.base import Selector, register_selector

if TYPE_CHECKING:
    import torch

    from kvrag.config import FuseConfig
    from kvrag.fusion.inputs import Segments


SCORES = ("kv", "attention", "kv_attention")


@register_selector("cacheblend")
class CacheBlendSelector(Selector):
    """CacheBlend's HKVD with gradual filtering.

    All stale chunk tokens (those after the first chunk, see `Segments.stale`) are recomputed below
    the first check layer. At each check layer their fresh K/V rows there are compared with the
    stored ones, and the tokens with the largest deviation are kept, shrinking geometrically from
    ``ratio * first_ratio_scale`` to ``ratio`` of the chunk tokens at the last check layer; the
    layer's attention and MLP run on the kept tokens alone, and the dropped ones keep their fresh
    K/V rows at that layer. Forced tokens (suffix, chunks without cache) are always kept.

    Args:
        config: the fusion settings (``ratio``; the options below).
    """

    @dataclass(frozen=True)
    class Options:
        """``check_layers``: where the selection is narrowed (strictly increasing layer indices), the last one
        reaching ``ratio``. ``first_ratio_scale``: the first check keeps ``min(1, ratio * first_ratio_scale)``.
        ``score``: what tokens are ranked by: ``"kv"`` (HKVD: fresh against stored K/V), ``"attention"`` (the
        question's attention on the token) or ``"kv_attention"`` (their product: deviations the question reads).
        """

        check_layers: tuple[int, ...] = (1, 2, 3)
        first_ratio_scale: float = 2.0
        score: str = "kv_attention"

        def __post_init__(self) -> None:
            layers = tuple(self.check_layers)
            object.__setattr__(self, "check_layers", layers)
            if not layers or any(c < 0 for c in layers):
                raise ValueError(f"check_layers must be non-negative layer indices, got {layers}")
            if list(layers) != sorted(set(layers)):
                raise ValueError(f"check_layers must be strictly increasing, got {layers}")
            if not self.first_ratio_scale >= 1.0:
                raise ValueError(f"first_ratio_scale must be >= 1, got {self.first_ratio_scale}")
            if self.score not in SCORES:
                raise ValueError(f"score must be one of {', '.join(map(repr, SCORES))}, got {self.score!r}")

    value_field, option_field = "ratio", "score"
    scales_with_ratio = True

    def __init__(self, config: FuseConfig) -> None:
        self.ratio = float(config.ratio)
        options = self.options(config)
        self.check_score = options.score
        check_layers = list(options.check_layers)
        first = min(1.0, self.ratio * options.first_ratio_scale)
        steps = max(1, len(check_layers) - 1)
        # check layer -> fraction of the chunk tokens kept from it on
        self.schedule = {
            layer: first * (self.ratio / first) ** (i / steps) if len(check_layers) > 1 else self.ratio
            for i, layer in enumerate(check_layers)
        }

    @classmethod
    def from_config(cls, config: FuseConfig) -> CacheBlendSelector:
        return cls(config)

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()  # bool [N]
        mask[seg.stale_start : seg.suffix_start] = True
        return mask

    def checks(self, layer: int) -> bool:
        return layer in self.schedule

    def target(self, layer: int, seg: Segments) -> int:
        """How many chunk tokens ``layer`` keeps (the ``- 1e-9`` absorbs the schedule's rounding)."""
        return math.ceil(self.schedule[layer] * seg.chunk_tokens - 1e-9)

    def narrow(
        self, layer: int, sel: torch.Tensor, deviation: torch.Tensor, seg: Segments
    ) -> torch.Tensor | None:
        forced = seg.forced[sel]  # bool [n_sel]
        candidates = (~forced).nonzero().squeeze(1)  # indices into sel
        keep_n = min(self.target(layer, seg), int(candidates.numel()))
        top = candidates[deviation[candidates].topk(keep_n).indices]
        # forced and top are disjoint: the kept indices, ascending
        kept = forced.clone()
        kept[top] = True
        return kept.nonzero().squeeze(1)
