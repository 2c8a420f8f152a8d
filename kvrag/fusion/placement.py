"""The full cache a fusion writes into: prefix rows up front, stored chunk rows placed layer by layer.

Every row of the ``[1, kv_heads, N, head_dim]`` per-layer K/V is written before it is read: the
prefix here, the stored chunk rows (keys rotated from pre-RoPE to their new positions) by
`place_layer` just before their layer runs, and recomputed rows by the layer itself. Stored caches
arrive through a `ChunkFeed` (`open_feed` wraps in-memory ones in a `TensorFeed`), so later layers
can load while earlier ones are recomputed.
"""

from __future__ import annotations

import torch

from kvrag.fusion.inputs import FusionInput, Segments
from kvrag.loading.feed import ChunkFeed, TensorFeed
from kvrag.model import LoadedModel, hf_compat, llama_layer
from kvrag.model.prefix import KV


def prefixed_layers(lm: LoadedModel, inp: FusionInput, seg: Segments) -> list[KV]:
    """Per-layer K/V ``[1, H, N, D]`` holding the prefix; every other row is written before it is read
    (stored chunk rows by `place_layer`, recomputed rows by the layer itself).
    """
    spec, device = lm.spec, lm.device
    dtype = inp.prefix.kv[0][0].dtype
    shape = (1, spec.n_kv_heads, seg.total, spec.head_dim)
    layers = []
    for k_pre, v_pre in inp.prefix.kv:
        k_full = torch.empty(shape, dtype=dtype, device=device)
        v_full = torch.empty(shape, dtype=dtype, device=device)
        k_full[:, :, : seg.prefix_len] = k_pre
        v_full[:, :, : seg.prefix_len] = v_pre
        layers.append((k_full, v_full))
    return layers


def open_feed(lm: LoadedModel, inp: FusionInput, seg: Segments, dtype: torch.dtype) -> ChunkFeed | None:
    """The feed of ``inp``'s stored chunk layers (None when no chunk has a cache)."""
    if not any(inp.available()):
        return None
    if isinstance(inp.chunk_kv, ChunkFeed):
        return inp.chunk_kv
    return TensorFeed(inp.chunk_kv, seg.chunk_lens, lm.spec.n_layers, lm.device, dtype)


def place_layer(layer: hf_compat.ScatterLayer, kv: tuple[torch.Tensor, torch.Tensor], seg: Segments,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write one layer's stored chunk K/V (``[H, n, D]`` pre-RoPE) into the full cache, keys rotated."""
    keys, values, _ = layer.full()
    start, stop = seg.prefix_len, seg.suffix_start
    llama_layer.rotation(cos, sin, keys.dtype).rotate(kv[0][None].to(keys.dtype), out=keys[:, :, start:stop])
    values[0, :, start:stop] = kv[1].to(values.dtype)
