"""The fixed prompt prefix's cache, and the per-layer K/V pair every stage passes around.

Contract: `prefix_cache` runs the model over the prefix once and keeps its rotated K/V per layer ``[1, H, P, D]``;
a `PrefixCache` is what fusion puts before the chunks and what chunk caches are computed after. `KV` is one
layer's (or one chunk's) ``(keys, values)``. Indexing and answering both import these from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.model import hf_compat
from kvrag.model.loading import LoadedModel

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefixCache:
    """The prefix's rotated KV, per layer ``[1, H, P, D]``, computed once per opened index."""

    ids: torch.Tensor  # [P]
    kv: list[KV]

    @property
    def length(self) -> int:
        return int(self.ids.numel())


def prefix_cache(lm: LoadedModel, prefix_ids: Sequence[int]) -> PrefixCache:
    ids = torch.tensor(list(prefix_ids), dtype=torch.long, device=lm.device)
    with torch.no_grad():
        base = hf_compat.base_model(lm.model)
        out = base(input_ids=ids[None], **hf_compat.with_cache(base, hf_compat.full_cache(base)), use_cache=True)
    kv = [(k.clone(), v.clone()) for k, v in hf_compat.cache_layers(hf_compat.returned_cache(out))]
    return PrefixCache(ids, kv)


def kv_rows(kv: KV, start: int, n: int) -> KV:
    """Rows ``[start, start + n)`` of a cache ``([L, H, T, D], [L, H, T, D])`` (itself when it has just those)."""
    keys, values = kv
    if start == 0 and keys.shape[2] == n:
        return kv
    return keys[:, :, start : start + n].contiguous(), values[:, :, start : start + n].contiguous()
