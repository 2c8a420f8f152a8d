"""`TieredFeed`: chunk caches from the process's decoded tier where it holds them, from the store otherwise.

Contract: what ``layer(i)`` returns is what a `StoreFeed` over every chunk would return — each chunk's rows as
the store decodes them, side by side, zeros for chunks without a cache — but a chunk the `DecodedTier` holds is
copied from memory, neither read nor decoded. The chunks read from the store go through an inner `StoreFeed`
(keys of the held chunks left out); each one read whole from checked bytes (not recomputed after a failed check)
is kept in the tier once its last layer is delivered, so the next prompt that places it reads it from memory.
On the CPU only (`open_tiered` gives the plain `StoreFeed` elsewhere): a GPU decodes a region faster than it
copies one from the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvrag.loading.chunk_feed import ChunkFeed
from kvrag.loading.staging import LayerKV
from kvrag.loading.store_feed import StoreFeed
from kvrag.storage.decoded_tier import KV, DecodedTier, TierKey

TIERED_DEVICES = {"cpu"}


class TieredFeed(ChunkFeed):
    """Chunks held decoded in ``tier`` (``held[j]``: their ``[L, H, n, D]`` keys and values) beside the rest, read
    by ``inner`` (None when the tier holds every chunk with a cache); ``tier_keys[j]``: chunk ``j``'s entry key
    (None: no cache).
    """

    def __init__(self, tier: DecodedTier, tier_keys: Sequence[TierKey | None], held: Sequence[KV | None],
                 inner: StoreFeed | None, lengths: Sequence[int], n_layers: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        available = [h is not None or (inner is not None and inner.available[j]) for j, h in enumerate(held)]
        super().__init__(lengths, available, n_layers, device, dtype)
        self.tier, self.tier_keys, self.held, self.inner = tier, list(tier_keys), list(held), inner
        self._columns = [slice(off, off + n) for off, n in zip(self.offsets, self.lengths)]
        # the chunks the store reads, kept whole as their layers arrive: chunk -> (keys, values) [L, H, n, D]
        self._kept: dict[int, KV] = {}
        self._keeping = [j for j, (key, kv) in enumerate(zip(self.tier_keys, held)) if key is not None and kv is None]
        self._shape = next(((int(h[0].shape[1]), int(h[0].shape[3])) for h in held if h is not None), None)

    @property
    def from_memory(self) -> int:
        """How many chunks the tier held (copied from memory, not read)."""
        return sum(kv is not None for kv in self.held)

    @property
    def decode_s(self) -> float:
        """Time the inner feed spent reading and decoding (0 when every chunk came from memory)."""
        return self.inner.decode_s if self.inner is not None else 0.0

    def _layer(self, i: int) -> LayerKV:
        if self.inner is not None:
            k, v = self.inner.layer(i)
        else:
            if self._shape is None:
                raise RuntimeError("no chunk in this feed has a cache")
            h, d = self._shape
            k = torch.zeros((h, self.total, d), dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
        for kv, cols in zip(self.held, self._columns):
            if kv is not None:
                k[:, cols].copy_(kv[0][i])
                v[:, cols].copy_(kv[1][i])
        self._keep(i, k, v)
        return k, v

    def _keep(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy layer ``i`` of the chunks the store read into their tier entries; after the last, keep them."""
        inner = self.inner
        if inner is None:
            return
        for j in self._keeping:
            cols = self._columns[j]
            if j not in self._kept:
                shape = (self.n_layers, k.shape[0], self.lengths[j], k.shape[2])
                self._kept[j] = (torch.empty(shape, dtype=k.dtype), torch.empty(shape, dtype=v.dtype))
            self._kept[j][0][i].copy_(k[:, cols])
            self._kept[j][1][i].copy_(v[:, cols])
        if i == self.n_layers - 1:
            for j, kv in self._kept.items():
                key = self.tier_keys[j]
                if key is not None and not inner.recovered(j):
                    self.tier.put(key, kv)
            self._kept.clear()

    def close(self) -> None:
        self._kept.clear()
        if self.inner is not None:
            self.inner.close()


def open_tiered(tier: DecodedTier | None, keys: Sequence[str | None], levels: Sequence[int | None],
                row_starts: Sequence[int], lengths: Sequence[int], n_layers: int, device: torch.device,
                dtype: torch.dtype, open_store: Callable[[list[str | None]], StoreFeed],
                touch: Callable[[str, int | None], None] | None = None) -> ChunkFeed:
    """The feed of chunks ``keys`` (None: no cache; ``levels``, ``row_starts``, ``lengths``: how each is read):
    a `TieredFeed` over ``tier`` on a device in `TIERED_DEVICES`, else ``open_store(keys)``. ``open_store``
    opens the `StoreFeed` of the keys it is given (None for the chunks it need not read); ``touch(key, level)``
    marks a chunk the tier held as used in the store, as reading it there would (`KVStore.touch`).
    """
    if tier is None or tier.max_bytes == 0 or device.type not in TIERED_DEVICES:
        return open_store(list(keys))
    tier_keys = [None if key is None else tier.key(key, level, start, n, dtype)
                 for key, level, start, n in zip(keys, levels, row_starts, lengths)]
    held = [None if key is None else tier.get(key) for key in tier_keys]
    for key, level, kv in zip(keys, levels, held):
        if kv is not None and key is not None and touch is not None:
            touch(key, level)
    rest = [None if kv is not None else key for key, kv in zip(keys, held)]
    inner = open_store(rest) if any(key is not None for key in rest) else None
    return TieredFeed(tier, tier_keys, held, inner, lengths, n_layers, device, dtype)
