"""Causal attention for queries at sorted, scattered positions on the CPU, in one call per layer.

Selective recompute runs a few tokens spread over the prompt (sorted positions ``p``) through a decoder
layer over the full cache: query ``i`` may see keys ``0..p[i]``. With a dense additive mask, SDPA's CPU
kernel reads every key for every query and runs slower than it does unmasked (about 75 against 110 GFLOP/s
on a 2-core AVX2 machine). Here the queries are cut into position-ordered tiles of about `TILE_ROWS` rows; a tile
whose first position is ``a`` and last ``b`` attends

- to keys ``0..a-1`` with no mask at all (every query of the tile sees them), and
- to keys ``a..b`` under a small mask,

and the two partial results are merged exactly through their log-sum-exps. The query heads that share a
key/value head run as one row block (``[1, kv_heads, groups * t, D]``), so grouped keys are not copied and
the kernel's tiles are fuller. The result equals one masked SDPA call to float rounding.

A decoder layer gets a `SortedCausalBias` as its attention mask; like `scatter_attention.ScatterBias` it
intercepts the layer's ``scaled_dot_product_attention`` call, so it works under a layer's own forward
(which may pass the keys repeated per query head) and under `kvrag.model.llama_layer`.

Layout: ``[1, heads, seq, head_dim]``.
"""

from __future__ import annotations

import math

import torch

from kvrag.fusion.kernel_mask import KernelMask

# Rows (queries times the query heads of a key/value head) per tile. SDPA's CPU kernel splits its query rows into
# blocks of 256 from 768 rows up and of 64 below, and the larger blocks run faster: on 2 cores, for 916 queries at
# 6,000 tokens (3 groups of 3 heads), tiles of 256 queries took 118 ms, of 128 148 ms, masked blocks 170 ms.
TILE_ROWS = 768


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel: the output ``[1, H, n, D]`` and its log-sum-exp ``[1, H, n]``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=mask,
                                                                            scale=scale)[:2]
    return out, lse


# A tile: its queries ``a:b``, the keys ``first:last`` its mask covers, that mask ``[1, 1, groups * t, last - first]``.
Tile = tuple[int, int, int, int, torch.Tensor]


def plan_tiles(positions: torch.Tensor, groups: int, dtype: torch.dtype, tile: int | None = None) -> list[Tile]:
    """The tiles of queries at sorted ``positions`` with ``groups`` query heads per key/value head, each with its
    additive mask in ``dtype`` (the same for every layer, so built once per selection).
    """
    tile = tile or -(-TILE_ROWS // groups)
    bounds, n = positions.tolist(), int(positions.numel())
    tiles = []
    for a in range(0, n, tile):
        b = min(n, a + tile)
        first, last = bounds[a], bounds[b - 1] + 1
        hidden = torch.arange(first, last, device=positions.device)[None, :] > positions[a:b, None]  # [t, keys]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, -math.inf)
        tiles.append((a, b, first, last, mask.repeat(groups, 1)[None, None]))
    return tiles


def sorted_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                            scale: float | None = None, tile: int | None = None,
                            tiles: list[Tile] | None = None) -> torch.Tensor:
    """Attention ``[1, Hq, n, D]`` of ``query`` (at sorted ``positions`` ``[n]``) over ``key``/``value``
    ``[1, H, >= positions[-1] + 1, D]`` (``H`` divides ``Hq``), query ``i`` seeing keys ``0..positions[i]``;
    ``tiles``: `plan_tiles` of these positions, when already made (``tile`` is then unused).
    """
    _, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    if n != positions.numel():
        raise ValueError(f"{n} queries but {positions.numel()} positions")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not group over {kv_heads} key/value heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    groups = q_heads // kv_heads
    out = torch.empty(1, n, q_heads, dim, dtype=query.dtype, device=query.device)  # the layer's next layout
    for a, b, first, last, mask in tiles or plan_tiles(positions, groups, query.dtype, tile):
        rows = query[:, :, a:b].reshape(1, kv_heads, groups * (b - a), dim)  # query head h = kv * groups + g
        tail, tail_lse = _flash(rows, key[:, :, first:last], value[:, :, first:last], mask, scale)
        if first > 0:
            head, head_lse = _flash(rows, key[:, :, :first], value[:, :, :first], None, scale)
            lse = torch.logaddexp(head_lse, tail_lse)
            tail = head * (head_lse - lse).exp_()[..., None] + tail * (tail_lse - lse).exp_()[..., None]
        out[:, a:b] = tail.reshape(1, q_heads, b - a, dim).transpose(1, 2)
    return out.transpose(1, 2)


class SortedCausalBias(KernelMask):
    """Passed as a decoder layer's ``attention_mask``: queries at the sorted ``positions`` see the keys up to
    their own; its SDPA call runs `sorted_causal_attention`.
    """

    positions: torch.Tensor

    def __new__(cls, positions: torch.Tensor) -> SortedCausalBias:
        """An empty tensor on ``positions``' device."""
        return super().__new__(cls, positions.device)

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self._tiles: dict[tuple[int, torch.dtype], list[Tile]] = {}  # every layer of a pass shares its tiles

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """`sorted_causal_attention` at this stand-in's positions, its tiles planned on the first call."""
        groups = query.shape[1] // key.shape[1]
        tiles = self._tiles.get((groups, query.dtype))
        if tiles is None:
            tiles = self._tiles[groups, query.dtype] = plan_tiles(self.positions, groups, query.dtype)
        return sorted_causal_attention(query, key, value, self.positions, scale, tiles=tiles)
