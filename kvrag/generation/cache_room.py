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
    n, m = layer.keys.shape[-2], keys.shape[-2]
    big_k, big_v = room(layer, m)
    big_k[..., n: n + m, :] = keys
    big_v[..., n: n + m, :] = values
    return grown(layer, n + m)


def room(layer: Any, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers ``[B, kv_heads, size, head_dim]`` holding ``layer``'s rows first and room for ``m`` more after
    them (made, or made larger, when it has none); rows written there join the layer through `grown`.
    """
    held_k, held_v = layer.keys, layer.values
    n = held_k.shape[-2]
    kept = getattr(layer, "_kvrag_room", None)
    if (kept is None or kept[2] != n or kept[0].data_ptr() != held_k.data_ptr()
            or kept[1].data_ptr() != held_v.data_ptr() or kept[0].shape[-2] < n + m):
        size = n + m + max(ROOM_ROWS, (n + m) // 8)
        buffers = []
        for held in (held_k, held_v):
            buffer = held.new_empty((*held.shape[:-2], size, held.shape[-1]))
            buffer[..., :n, :] = held
            buffers.append(buffer)
        kept = (buffers[0], buffers[1], n)
        layer._kvrag_room = kept
    return kept[0], kept[1]


def grown(layer: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Make ``layer`` hold the first ``rows`` rows of its `room` buffers; its keys and values."""
    big_k, big_v, _ = layer._kvrag_room
    layer.keys, layer.values = big_k[..., :rows, :], big_v[..., :rows, :]
    layer._kvrag_room = (big_k, big_v, rows)
    return layer.keys, layer.values


_GROWING_LAYERS = frozenset({"DynamicLayer", "RowLayer"})  # transformers' dynamic layer, kvrag's `RowLayer`


def appendable(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a growing layer with rows, transformers' dynamic one or kvrag's
    `kvrag.model.row_cache.RowLayer` (what `append_rows` takes).
    """
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer).__name__ in _GROWING_LAYERS and getattr(layer, "keys", None) is not None
                                and layer.keys.dim() == 4 for layer in layers)
