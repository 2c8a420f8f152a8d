"""What a fusion takes and gives: `FusionInput`, its token layout `Segments`, and `FusionResult`.

The fused sequence is ``[prefix][chunk 1]…[chunk k][suffix]`` of N tokens. `segments` lays an input
out: where each piece starts, and which positions must be recomputed whatever the selector says
(``forced``: the suffix, and chunks without a stored cache).

Layout: stored chunk caches ``[layers, kv_heads, n_i, head_dim]`` (keys pre-RoPE); masks ``[N]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag.loading.feed import ChunkFeed
from kvrag.model.prefix import KV, PrefixCache


@dataclass
class FusionInput:
    """What fusion needs. ``chunk_kv[i] is None`` marks a chunk without a usable cache (recomputed).

    ``chunk_kv`` is either the caches themselves or a `ChunkFeed` that delivers them layer by layer
    while fusion runs (loading overlapped with recompute). ``first_exact``: the first chunk's cache
    was computed right after the prefix, as the prompt places it, so it is exact and no selector
    recomputes it; False for caches computed after other context (neighbour context, a conversation's
    history). ``reuse_prefix``: the prefix rows are exact and kept as they are even by ``full``.
    """

    prefix: PrefixCache
    chunk_ids: list[torch.Tensor]  # each [n_i]
    chunk_kv: list[KV | None] | ChunkFeed  # each ([L, H, n_i, D] pre-RoPE keys, values) or None
    suffix_ids: torch.Tensor  # [S]
    first_exact: bool = True
    reuse_prefix: bool = False  # the prefix's rows are a conversation's kept KV: ``full`` does not recompute them

    def available(self) -> list[bool]:
        """Per chunk: whether it has a stored cache."""
        if isinstance(self.chunk_kv, ChunkFeed):
            return list(self.chunk_kv.available)
        return [kv is not None for kv in self.chunk_kv]


@dataclass
class Segments:
    """Token spans of the fused sequence."""

    prefix_len: int
    chunk_starts: list[int]
    chunk_lens: list[int]
    suffix_start: int
    total: int
    forced: torch.Tensor  # bool [N]: tokens that must be recomputed (suffix, chunks without cache)
    first_exact: bool = True  # the first chunk's stored cache is exact (see `FusionInput`)
    reuse_prefix: bool = False  # ``full`` recomputes from ``prefix_len`` on (see `FusionInput`)

    @property
    def chunk_tokens(self) -> int:
        return sum(self.chunk_lens)

    @property
    def stale(self) -> list[tuple[int, int]]:
        """``(start, length)`` of the chunks whose stored caches are stale where the prompt places
        them: every chunk after the first, and the first too unless its cache is exact.
        """
        spans = list(zip(self.chunk_starts, self.chunk_lens))
        return spans[1:] if self.first_exact else spans

    @property
    def stale_start(self) -> int:
        """Where the stale chunks begin (``suffix_start`` when there are none)."""
        stale = self.stale
        return stale[0][0] if stale else self.suffix_start


@dataclass
class FusionResult:
    """The fused cache, the last token's logits and what was recomputed."""

    cache: Any  # the model's growing cache over all N tokens (`hf_compat.dynamic_cache`)
    logits: torch.Tensor  # [vocab] float32, of the last prompt token
    n_tokens: int
    n_selected: list[int]  # per layer: how many tokens its attention and MLP ran on (a check layer also
    # projects the K/V of the tokens it then drops; those are not counted)
    fuse_s: float
    selected: torch.Tensor = field(repr=False)  # positions recomputed in the last layer
    load_wait_s: float = 0.0  # time the layer loop waited for stored layers (loading not hidden)
    probe_logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab] float32: the last token's
    # logits from a probe pass (the question alone over the stored caches), for modes that run one through every layer

    @property
    def recompute_fraction(self) -> float:
        """Recomputed token-layers over all token-layers (1.0 for ``full``)."""
        return sum(self.n_selected) / (len(self.n_selected) * self.n_tokens)


def segments(inp: FusionInput) -> Segments:
    """Lay ``inp`` out as one sequence: the pieces' spans and the forced positions."""
    p = inp.prefix.length
    starts, lens, pos = [], [], p
    for ids in inp.chunk_ids:
        starts.append(pos)
        lens.append(int(ids.numel()))
        pos += int(ids.numel())
    total = pos + int(inp.suffix_ids.numel())
    forced = torch.zeros(total, dtype=torch.bool)  # on the CPU, where selectors build their masks
    forced[pos:] = True
    for start, n, ok in zip(starts, lens, inp.available()):
        if not ok:
            forced[start : start + n] = True
    return Segments(p, starts, lens, pos, total, forced, inp.first_exact, inp.reuse_prefix)
