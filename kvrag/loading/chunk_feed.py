"""`ChunkFeed`: the interface through which fusion receives stored K/V one layer at a time.

Contract: a feed covers a run of chunks in prompt order, ``lengths[j]`` tokens each; ``layer(i)``
returns layer ``i``'s pre-RoPE ``(keys, values)``, each ``[kv_heads, total, head_dim]`` on the feed's
device and dtype, the chunks side by side and zeros for chunks without a cache. Layers are asked for
in order 0, 1, …; ``wait_s`` accumulates the time the caller spent blocked in ``layer``. ``close``
(or leaving the ``with`` block) stops background work and releases buffers.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kvrag.loading.staging import LayerKV

DEFAULT_DEPTH = 2  # layers prepared ahead of the one fusion is working on


class ChunkFeed(ABC):
    """Per-layer K/V of a run of chunks, in the order they appear in the prompt."""

    def __init__(self, lengths: Sequence[int], available: Sequence[bool], n_layers: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if len(lengths) != len(available):
            raise ValueError(f"{len(lengths)} chunk lengths but {len(available)} availability flags")
        self.lengths, self.available = [int(n) for n in lengths], [bool(a) for a in available]
        self.n_layers, self.device, self.dtype = n_layers, torch.device(device), dtype
        self.offsets = [sum(self.lengths[:i]) for i in range(len(self.lengths))]
        self.total = sum(self.lengths)
        self.wait_s = 0.0

    def layer(self, i: int) -> LayerKV:
        """Layer ``i``'s pre-RoPE ``(keys, values)`` ``[H, total, D]`` on the device (layers in order)."""
        t0 = time.perf_counter()
        out = self._layer(i)
        self.wait_s += time.perf_counter() - t0
        return out

    @abstractmethod
    def _layer(self, i: int) -> LayerKV: ...

    def close(self) -> None:
        """Stop background work and release buffers."""

    def __enter__(self) -> ChunkFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
