"""kvrag's own growing key/value cache, for the models kvrag runs itself (`kvrag.model.native_llama`).

Contract: `RowCache` is what transformers' ``DynamicCache`` is to kvrag, without importing transformers: a list of
`RowLayer`s, each holding one decoder layer's ``keys``/``values``; ``update(keys, values, idx)`` appends rows to
layer ``idx`` (made on first use) and returns the layer's whole keys and values; ``get_seq_length()`` counts layer
0's rows. A layer grows by concatenation, as a dynamic layer does, so a tensor it handed out is never written
through it (`kvrag.generation.cache_room` writes decoding steps into room kept after the rows instead).
Models loaded through transformers keep transformers' caches (`kvrag.model.hf_compat.dynamic_cache` chooses).

Layout: ``[batch, kv_heads, seq, head_dim]``; rows are appended along ``seq``.
"""

from __future__ import annotations

from typing import Any

import torch


class RowLayer:
    """One decoder layer's rows: ``keys``/``values`` ``[B, H, S, D]``, or None before the first update."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, n, D]``; the layer's whole keys and values."""
        if self.keys is None or self.values is None:
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])


class RowCache:
    """A list of `RowLayer`s (see the module docstring)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Layers holding the given per-layer ``(keys, values)`` themselves, not copies (none: an empty cache)."""
        self.layers = [RowLayer(k, v) for k, v in (kv or [])]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows to layer ``layer_idx`` (`RowLayer.update`), making the layers up to it when missing."""
        while len(self.layers) <= layer_idx:
            self.layers.append(RowLayer())
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """How many rows layer ``layer_idx`` holds (0 when it has none yet)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def __len__(self) -> int:
        return len(self.layers)
