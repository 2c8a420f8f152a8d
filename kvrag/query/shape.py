"""`FusionShape`: the token counts of a prompt that the loading controller (`kvrag.query.plan`) plans with.

Contract: a shape lists every chunk's tokens in prompt order, which chunks are stale where the prompt places
them, the suffix's and the prefix's tokens, the model's layers, its `half_cost_keys` and its sliding window.
From those it counts the token-layers a fusion runs (`FusionShape.token_layers`), the same weighted by the keys
each token's attention reads (`FusionShape.units`), and the tokens loaded from the store. `fusion_shape` and
`prompt_shape` build one; nothing here measures or plans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrag.model import hf_compat

if TYPE_CHECKING:
    from kvrag.model import LoadedModel


@dataclass(frozen=True)
class FusionShape:
    """The token counts a plan is made for: every chunk's tokens in prompt order, which chunks are
    stale where the prompt places them (all after the first; the first too unless its cache is exact),
    the suffix's tokens, the model's layers, the prefix's tokens, the model's `half_cost_keys`
    (infinite: every token-layer costs the same wherever it stands) and its sliding window, if any.
    """

    chunk_tokens: tuple[int, ...]
    stale: tuple[bool, ...]
    suffix_tokens: int
    n_layers: int
    prefix_tokens: int = 0
    half_cost_keys: float = math.inf
    window: int | None = None

    def token_layers(self, work: float, from_text: Sequence[int]) -> float:
        """Predicted token-layers the loop runs: the suffix and text chunks through every layer, plus
        ``work`` token-layers per layer for each stale chunk token that is loaded.
        """
        text = set(from_text)
        dense = self.suffix_tokens + sum(self.chunk_tokens[j] for j in text)
        stale = sum(n for j, (n, s) in enumerate(zip(self.chunk_tokens, self.stale)) if s and j not in text)
        return self.n_layers * (dense + work * stale)

    def units(self, work: float, from_text: Sequence[int]) -> float:
        """`token_layers` weighted by each token's ``1 + keys / half_cost_keys``, a token at position
        ``p`` attending to ``p + 1`` keys (at most the window's); the ``work`` on a stale chunk is taken
        as spread evenly over its tokens.
        """
        text = set(from_text)
        start = self.prefix_tokens + sum(self.chunk_tokens)
        dense = stale = 0.0
        for j, n in reversed(list(enumerate(self.chunk_tokens))):
            start -= n
            if j in text:
                dense += self._weighted(start, n)
            elif self.stale[j]:
                stale += self._weighted(start, n)
        dense += self._weighted(self.prefix_tokens + sum(self.chunk_tokens), self.suffix_tokens)
        return self.n_layers * (dense + work * stale)

    def _weighted(self, start: int, n: int) -> float:
        """Positions ``start … start + n - 1``, each weighted ``1 + keys / half_cost_keys`` where
        ``keys = min(p + 1, window)``.
        """
        lo, hi = start + 1, start + n  # the key counts of the first and last position
        cap = hi if self.window is None else min(hi, self.window)
        keys = (lo + cap) * (cap - lo + 1) / 2 if cap >= lo else 0.0  # positions whose keys grow
        if self.window is not None:
            keys += self.window * max(0, hi - max(lo, self.window + 1) + 1)  # the rest read a full window
        return n + keys / self.half_cost_keys

    def loaded_tokens(self, from_text: Sequence[int]) -> int:
        """The chunk tokens loaded from the store: every chunk's but those recomputed from their text."""
        text = set(from_text)
        return sum(n for j, n in enumerate(self.chunk_tokens) if j not in text)


def fusion_shape(chunk_tokens: Sequence[int], suffix_tokens: int, n_layers: int, first_exact: bool = True,
                 prefix_tokens: int = 0, half_cost_keys: float = math.inf, window: int | None = None
                 ) -> FusionShape:
    """The `FusionShape` of a prompt: every chunk after the first is stale, the first too unless its
    cache is exact where the prompt places it (see `kvrag.fusion.FusionInput`).
    """
    stale = tuple(j > 0 or not first_exact for j in range(len(chunk_tokens)))
    return FusionShape(tuple(int(n) for n in chunk_tokens), stale, int(suffix_tokens), n_layers,
                       int(prefix_tokens), float(half_cost_keys), window)


def prompt_shape(lm: LoadedModel, chunk_tokens: Sequence[int], suffix_tokens: int, prefix_tokens: int,
                 first_exact: bool = True) -> FusionShape:
    """`fusion_shape` for a prompt of ``lm``'s, its attention weighted by the model's `half_cost_keys`."""
    windows = {kind.window for kind in lm.family.kinds}  # a window that not every layer has costs as none
    return fusion_shape(chunk_tokens, suffix_tokens, lm.spec.n_layers, first_exact, prefix_tokens,
                        half_cost_keys(lm.model), windows.pop() if len(windows) == 1 else None)


def half_cost_keys(model: Any) -> float:
    """How many keys a token's attention reads when it costs as many FLOPs as the rest of its decoder
    layer: the layer's matrix products take ``2 · params`` per token, the attention ``4 · heads ·
    head_dim`` per key (scores, then the weighted values). The first decoder layer's parameters stand
    for every layer's.
    """
    layer = hf_compat.decoder_layers(model)[0]
    attn = layer.self_attn
    heads = getattr(attn, "num_heads", None) or model.config.num_attention_heads
    params = sum(p.numel() for p in layer.parameters())
    return params / (2 * heads * attn.head_dim)
