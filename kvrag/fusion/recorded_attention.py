"""Attention that also records where the question reads: one pass for a probe layer's output and its scores.

A probe pass (`kvrag.fusion.selectors.probe`) runs the question alone over the stored caches and, from a
layer on, sums the attention the question's tokens put on every position. Computing that sum apart
(`kvrag.fusion.scores.question_attention`) projects the queries a second time and multiplies them with every key
a second time, beside the layer's own attention call. Here the layer's attention itself is written out
(scores, causal mask, softmax in float32, then the weighted values) and the weights of the last ``readers``
queries, summed over their query heads, are added to ``sink`` on the way: the layer's output and the
question's reading come from the same products.

Written out, the weights of every query over every key are held at once (``queries * query heads * keys``
floats), so a `RecordingBias` is for a few queries: `fits` says whether a selection is few enough.

Layout: ``[1, heads, seq, head_dim]``; ``sink`` ``[N]`` float32.
"""

from __future__ import annotations

import math

import torch

from kvrag.fusion.kernel_mask import KernelMask
from kvrag.fusion.scores import causal_weights

# The most attention weights (queries x query heads x keys) written out at once: 32 MB of float32.
MAX_WEIGHTS = 8 * 1024 * 1024


def fits(n_queries: int, n_heads: int, n_keys: int) -> bool:
    """Whether a selection of ``n_queries`` over ``n_keys`` keys, with ``n_heads`` query heads, is few enough to
    write its attention weights out.
    """
    return n_queries * n_heads * n_keys <= MAX_WEIGHTS


def recorded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                      readers: int, sink: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention ``[1, Hq, n, D]`` of ``query`` (at sorted ``positions`` ``[n]``) over ``key``/``value``
    ``[1, H, >= positions[-1] + 1, D]`` (``H`` divides ``Hq``), query ``i`` seeing keys ``0..positions[i]``;
    the weights the last ``readers`` queries put on each key, summed over them and their heads, are added to
    ``sink[: positions[-1] + 1]``.
    """
    _, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    if n != positions.numel() or not 0 < readers <= n:
        raise ValueError(f"{n} queries, {positions.numel()} positions and {readers} readers do not fit")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not group over {kv_heads} key/value heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    limit = int(positions[-1]) + 1
    keys, values = key[:, :, :limit], value[:, :, :limit]
    weights = causal_weights(query, keys, positions, None, scale)  # [1, H, groups, n, limit]
    sink[:limit] += weights[:, :, :, n - readers :].sum(dim=(0, 1, 2, 3))
    out = weights.view(1, kv_heads, -1, limit).to(values.dtype) @ values
    return out.view(1, q_heads, n, dim)


class RecordingBias(KernelMask):
    """Passed as a decoder layer's ``attention_mask``: queries at the sorted ``positions`` see the keys up to
    their own, and the last ``readers`` of them add their attention weights to ``sink`` (`recorded_attention`).
    """

    positions: torch.Tensor

    def __new__(cls, positions: torch.Tensor, readers: int, sink: torch.Tensor) -> RecordingBias:
        """An empty tensor on ``positions``' device."""
        return super().__new__(cls, positions.device)

    def __init__(self, positions: torch.Tensor, readers: int, sink: torch.Tensor) -> None:
        self.positions, self.readers, self.sink = positions, readers, sink

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """`recorded_attention` at this stand-in's positions, into its sink."""
        return recorded_attention(query, key, value, self.positions, self.readers, self.sink, scale)
