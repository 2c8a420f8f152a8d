"""`append_rows`: a decoding step's key/value rows written into room kept after a cache layer's rows.

Contract: a growing cache layer (transformers' dynamic one, kvrag's `RowLayer`) grows by concatenation, so every
step copies the whole layer to add one row: for a batch of answers over ~1K-token caches, the copies cost about a
quarter of a step on the CPU, as much as the attention that reads the rows. `append_rows` instead keeps the layer's
``keys``/``values`` as views of larger buffers (`ROOM_ROWS` rows, or an eighth of the length, more than they hold)
and writes new rows into the room: one copy when the room runs out, none per step. Nothing else changes: the
layer's tensors hold the same rows, and a layer whose tensors something else replaced (the layer's own ``update``,
a crop) gets fresh room on its next append, copied from what it holds then, so rows a view handed out earlier still
hold are never written.

Layout: a layer's ``keys``/``values`` ``[B, kv_heads, S, head_dim]``; rows appended along ``S``.
"""

from __future__ import annotations

from typing import Any

import torch

ROOM_ROWS = 128  # the least spare room a buffer keeps past its rows when it is made


def append_rows(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``keys``/``values`` ``[B, kv_heads, m, head_dim]`` after ``layer``'s rows (a growing cache layer,
    `appendable`); the layer's whole keys and values after it, as the layer's own ``update`` returns them.
    """
    held_k, held_v = layer.keys, layer.values
    n, m = held_k.shape[-2], keys.shape[-2]
    room = getattr(layer, "_kvrag_room", None)
    if (room is None or room[2] != n or room[0].data_ptr() != held_k.data_ptr()
            or room[1].data_ptr() != held_v.data_ptr() or room[0].shape[-2] < n + m):
        size = n + m + max(ROOM_ROWS, (n + m) // 8)
        buffers = []
        for held in (held_k, held_v):
            buffer = held.new_empty((*held.shape[:-2], size, held.shape[-1]))
            buffer[..., :n, :] = held
            buffers.append(buffer)
        room = (buffers[0], buffers[1], n)
    big_k, big_v, _ = room
    big_k[..., n: n + m, :] = keys
    big_v[..., n: n + m, :] = values
    layer.keys, layer.values = big_k[..., : n + m, :], big_v[..., : n + m, :]
    layer._kvrag_room = (big_k, big_v, n + m)
    return layer.keys, layer.values


_GROWING_LAYERS = frozenset({"DynamicLayer", "RowLayer"})  # transformers' dynamic layer, kvrag's `RowLayer`


def appendable(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a growing layer with rows, transformers' dynamic one or kvrag's
    `kvrag.model.row_cache.RowLayer` (what `append_rows` takes).
    """
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer).__name__ in _GROWING_LAYERS and getattr(layer, "keys", None) is not None
                                and layer.keys.dim() == 4 for layer in layers)
