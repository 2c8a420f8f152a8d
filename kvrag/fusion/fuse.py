"""Fusion: place stored chunk caches at their new positions and selectively recompute.

The sequence is ``[prefix][chunk 1]…[chunk k][suffix]`` of N tokens. Its full K/V is assembled from
the prefix cache and the chunks' stored pre-RoPE caches rotated to their new positions; the model's
own decoder layers then run on the *selected* tokens only, writing their fresh K/V rows into the
full cache (`hf_compat.ScatterCache`). A selector chooses the tokens before layer 0 and may narrow
them after any layer. Selecting every token reproduces a full prefill exactly.

Layout: per layer ``[1, kv_heads, N, head_dim]``; stored chunks ``[layers, kv_heads, n, head_dim]``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from kvrag.model import hf_compat

from kvrag.fusion import scatter_attention
from kvrag.config import FuseConfig
from kvrag.loading.feed import ChunkFeed, TensorFeed
from kvrag.indexing.kvgen import KV, PrefixCache
from kvrag.model import LoadedModel, apply_rope, rope_at


@dataclass
class FusionInput:
    """What fusion needs. ``chunk_kv[i] is None`` marks a chunk without a usable cache (recomputed).

    ``chunk_kv`` is either the caches themselves or a `ChunkFeed` that delivers them layer by layer
    while fusion runs (loading overlapped with recompute). ``first_exact``: the first chunk's cache
    was computed right after the prefix, as the prompt places it, so it is exact and no selector
    recomputes it; False for caches computed after other context (neighbour context).
    """

    prefix: PrefixCache
    chunk_ids: list[torch.Tensor]  # each [n_i]
    chunk_kv: list[KV | None] | ChunkFeed  # each ([L, H, n_i, D] pre-RoPE keys, values) or None
    suffix_ids: torch.Tensor  # [S]
    first_exact: bool = True

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

    cache: Any  # transformers DynamicCache over all N tokens
    logits: torch.Tensor  # [vocab] float32, of the last prompt token
    n_tokens: int
    n_selected: list[int]  # per layer: how many tokens its attention and MLP ran on (a check layer also
    # projects the K/V of the tokens it then drops; those are not counted)
    fuse_s: float
    selected: torch.Tensor = field(repr=False)  # positions recomputed in the last layer
    load_wait_s: float = 0.0  # time the layer loop waited for stored layers (loading not hidden)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed token-layers over all token-layers (1.0 for ``full``)."""
        return sum(self.n_selected) / (len(self.n_selected) * self.n_tokens)


def segments(inp: FusionInput) -> Segments:
    p = inp.prefix.length
    starts, lens, pos = [], [], p
    for ids in inp.chunk_ids:
        starts.append(pos)
        lens.append(int(ids.numel()))
        pos += int(ids.numel())
    total = pos + int(inp.suffix_ids.numel())
    forced = torch.zeros(total, dtype=torch.bool)
    forced[pos:] = True
    for start, n, ok in zip(starts, lens, inp.available()):
        if not ok:
            forced[start : start + n] = True
    return Segments(p, starts, lens, pos, total, forced, inp.first_exact)


class Selector:
    """Chooses which positions are recomputed: before layer 0, and after each layer."""

    def initial(self, seg: Segments) -> torch.Tensor:
        """Bool mask ``[N]`` of positions recomputed from layer 0."""
        raise NotImplementedError

    def checks(self, layer: int) -> bool:
        """Whether `narrow` runs at ``layer``, on the K/V deviation of its fresh rows, before its body."""
        return False

    def narrow(
        self, layer: int, sel: torch.Tensor, deviation: torch.Tensor, seg: Segments
    ) -> torch.Tensor | None:
        """Indices into ``sel`` that ``layer``'s body and the layers after it run on (None keeps all)."""
        return None

    def probe_from(self, seg: Segments, n_layers: int) -> int | None:
        """If the `initial` tokens run first as a probe: the first layer whose suffix attention
        `choose` ranks by; None runs the `initial` tokens as the one pass.
        """
        return None

    def choose(self, attention: torch.Tensor, seg: Segments) -> torch.Tensor:
        """After a probe: bool mask ``[N]`` of the positions recomputed, from the suffix attention ``[N]``."""
        raise NotImplementedError


class FullSelector(Selector):
    def initial(self, seg: Segments) -> torch.Tensor:
        return torch.ones(seg.total, dtype=torch.bool)


class ReuseSelector(Selector):
    def initial(self, seg: Segments) -> torch.Tensor:
        return seg.forced.clone()


class PrefixSelector(Selector):
    """Reuse only the first chunk (whose cache is exact: it was computed right after the prefix)."""

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()
        if len(seg.chunk_starts) > 1:
            mask[seg.chunk_starts[1] : seg.suffix_start] = True
        return mask


class AttnLinkSelector(Selector):
    """Epic's AttnLink: the first ``k`` tokens of every chunk after the first (of every chunk when
    even the first one's cache is stale), plus the suffix.
    """

    def __init__(self, link_tokens: int) -> None:
        self.link_tokens = link_tokens

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()
        for start, n in seg.stale:
            mask[start : start + min(n, self.link_tokens)] = True
        return mask


class CacheBlendSelector(Selector):
    """CacheBlend's HKVD with gradual filtering.

    All stale chunk tokens (those after the first chunk, see `Segments.stale`) are recomputed below
    the first check layer. At each check layer their fresh K/V rows there are compared with the
    stored ones, and the tokens with the largest deviation are kept, shrinking geometrically from
    ``ratio * first_ratio_scale`` to ``ratio`` of the chunk tokens at the last check layer; the
    layer's attention and MLP run on the kept tokens alone, and the dropped ones keep their fresh
    K/V rows at that layer. Forced tokens (suffix, chunks without cache) are always kept.
    """

    def __init__(self, config: FuseConfig) -> None:
        self.ratio = float(config.ratio)
        check_layers = list(config.check_layers)
        first = min(1.0, self.ratio * config.first_ratio_scale)
        steps = max(1, len(check_layers) - 1)
        self.schedule = {
            layer: first * (self.ratio / first) ** (i / steps) if len(check_layers) > 1 else self.ratio
            for i, layer in enumerate(check_layers)
        }

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()
        mask[seg.stale_start : seg.suffix_start] = True
        return mask

    def checks(self, layer: int) -> bool:
        return layer in self.schedule

    def target(self, layer: int, seg: Segments) -> int:
        return math.ceil(self.schedule[layer] * seg.chunk_tokens - 1e-9)

    def narrow(
        self, layer: int, sel: torch.Tensor, deviation: torch.Tensor, seg: Segments
    ) -> torch.Tensor | None:
        forced = seg.forced[sel]
        candidates = (~forced).nonzero().squeeze(1)
        keep_n = min(self.target(layer, seg), int(candidates.numel()))
        top = candidates[deviation[candidates].topk(keep_n).indices]
        keep = torch.cat([forced.nonzero().squeeze(1), top])
        return keep.sort().values


class ProbeSelector(Selector):
    """Question probe: recompute the chunk tokens the question reads most.

    A first pass runs only the forced tokens (the question suffix, chunks without cache) over the
    stored caches, as ``reuse`` does, and sums the attention the suffix puts on every position over
    the layers from ``int(probe_from * n_layers)`` up. The ``ratio`` of chunk tokens it attends to
    most, taken from the stale chunks (`Segments.stale`: those after the first), are then
    recomputed through every layer together with the forced tokens. The stored caches deviate
    little in the lowest layers, where HKVD checks, and most in the upper ones, spread over many
    tokens; the question's own reading of those layers tells which of the stale rows the answer
    depends on.
    """

    def __init__(self, config: FuseConfig) -> None:
        self.ratio = float(config.ratio)
        self.from_fraction = float(config.probe_from)
        self.attention: torch.Tensor | None = None  # the last probe's reading (`choose`)
        self.picked: torch.Tensor | None = None

    def initial(self, seg: Segments) -> torch.Tensor:
        return seg.forced.clone()

    def probe_from(self, seg: Segments, n_layers: int) -> int | None:
        return int(self.from_fraction * n_layers) if self.candidates(seg).numel() else None

    @staticmethod
    def candidates(seg: Segments) -> torch.Tensor:
        """Positions the probe may choose: stored tokens of the stale chunks."""
        start = seg.stale_start
        return (~seg.forced[start : seg.suffix_start]).nonzero().squeeze(1) + start

    def choose(self, attention: torch.Tensor, seg: Segments) -> torch.Tensor:
        """Bool mask ``[N]`` of the main pass: forced tokens and the most attended candidates.

        The probe's reading stays on the selector for inspection: ``attention`` (the summed suffix
        attention ``[N]``) and ``picked`` (the candidate positions chosen, most attended first).
        """
        mask = seg.forced.clone()
        candidates = self.candidates(seg)
        keep_n = min(math.ceil(self.ratio * seg.chunk_tokens - 1e-9), int(candidates.numel()))
        self.attention, self.picked = attention, candidates[attention[candidates].topk(keep_n).indices]
        mask[self.picked] = True
        return mask


class FixedSelector(Selector):
    """Recompute given positions of the fused prompt (with the forced ones) through every layer.

    For selections made outside fusion: e.g. the benchmark's deviation oracle, which ranks the stale
    tokens by how far their stored K/V are from a full prefill's.
    """

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions.long().flatten().cpu()

    def initial(self, seg: Segments) -> torch.Tensor:
        mask = seg.forced.clone()
        if self.positions.numel() and not 0 <= int(self.positions.min()) <= int(self.positions.max()) < seg.total:
            raise ValueError(f"selected positions must lie in [0, {seg.total}), the fused prompt")
        mask[self.positions] = True
        return mask


def make_selector(config: FuseConfig) -> Selector:
    """The selector for ``config.mode``."""
    if config.mode == "full":
        return FullSelector()
    if config.mode == "reuse":
        return ReuseSelector()
    if config.mode == "prefix":
        return PrefixSelector()
    if config.mode == "attnlink":
        return AttnLinkSelector(config.link_tokens)
    if config.mode == "probe":
        return ProbeSelector(config)
    return CacheBlendSelector(config)


def _prefixed_layers(lm: LoadedModel, inp: FusionInput, seg: Segments) -> list[KV]:
    """Per-layer K/V ``[1, H, N, D]`` holding the prefix; every other row is written before it is read
    (stored chunk rows by `_place_layer`, recomputed rows by the layer itself).
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


def _open_feed(lm: LoadedModel, inp: FusionInput, seg: Segments, dtype: torch.dtype) -> ChunkFeed | None:
    if not any(inp.available()):
        return None
    if isinstance(inp.chunk_kv, ChunkFeed):
        return inp.chunk_kv
    return TensorFeed(inp.chunk_kv, seg.chunk_lens, lm.spec.n_layers, lm.device, dtype)


def _place_layer(layer: hf_compat.ScatterLayer, kv: tuple[torch.Tensor, torch.Tensor], seg: Segments,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write one layer's stored chunk K/V (``[H, n, D]`` pre-RoPE) into the full cache, keys rotated."""
    keys, values, _ = layer.full()
    start, stop = seg.prefix_len, seg.suffix_start
    keys[0, :, start:stop] = apply_rope(kv[0][None].to(keys.dtype), cos, sin)[0]
    values[0, :, start:stop] = kv[1].to(values.dtype)


def _attention_mask(sel: torch.Tensor, total: int, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """Additive mask ``[1, 1, n_sel, total]``: selected token i sees positions j <= pos_i (within window)."""
    cols = torch.arange(total, device=sel.device)
    allowed = cols[None, :] <= sel[:, None]
    if window is not None:
        allowed &= cols[None, :] > sel[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sel.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


ATTENTION_BLOCKS = 4  # selected tokens run through a layer in up to this many position-ordered blocks
MIN_BLOCK_TOKENS = 64  # on the CPU a block pays for itself from a few dozen tokens
MIN_BLOCK_TOKENS_CUDA = 1024  # on a GPU each block launches the layer's kernels again: only long selections split
# where a selection of the last positions runs as one block with a lower-right causal bias instead of masked blocks;
# on the CPU SDPA would build that mask anyway, and the blocks halve the keys read
LOWER_RIGHT_DEVICES = {"cuda"}
# (part of the selection, keys it attends to, mask, the model's (cos, sin) for its positions)
Block = tuple[slice, int, "torch.Tensor | None", tuple[torch.Tensor, torch.Tensor]]  # mask: additive or a CausalBias


def _blocks(lm: LoadedModel, sel: torch.Tensor, total: int, dtype: torch.dtype, window: int | None,
            causal_ok: bool, flex_from: int | None = None) -> list[Block]:
    """How the selected tokens run through each layer.

    Every position selected and a kernel that masks causally by itself (``causal_ok``): one block,
    no mask — a plain causal prefill, which SDPA runs with its flash kernel. On CUDA, the last ``n``
    positions all selected (cacheblend before its first check, `prefix`): one block under a
    lower-right causal bias, which SDPA also runs with its flash kernel. A selection spread over the
    prompt runs as one block under a `ScatterBias` (FlexAttention) when it attends to at least
    ``flex_from`` keys (`attention_kernel`; None: never). Otherwise it is cut into position-ordered
    blocks run in order; a block attends only to the positions up to its last token, so the attention
    reads about half the keys it would with one block over all of them. Exact: a block sees the fresh
    rows written by the blocks before it, and no row after it. Each block's rotary embeddings are
    computed here, once per pass.
    """
    n = int(sel.numel())
    like = torch.empty(0, dtype=dtype, device=sel.device)  # the dtype and device of the embeddings

    def block(part: slice, limit: int, mask: torch.Tensor | None) -> Block:
        return part, limit, mask, hf_compat.position_embeddings(lm.model, like, sel[part])

    causal_ok = causal_ok and (window is None or total <= window)  # the window masks nothing here
    if causal_ok and n == total:
        return [block(slice(0, n), total, None)]
    first, last = (int(p) for p in sel[[0, -1]].tolist())
    last += 1  # the keys the selection attends to
    biased = causal_ok and sel.device.type in LOWER_RIGHT_DEVICES and n > 1
    if biased and first == total - n and last == total:
        # the last n positions, every one selected: causal aligned to the last key, no mask to build
        # or read, so SDPA runs its flash kernel (the first layers of cacheblend and every `prefix` one)
        return [block(slice(0, n), total, causal_lower_right(n, total))]
    if flex_from is not None and last >= flex_from and causal_ok:  # (SDPA, and a window that masks nothing)
        plan = scatter_attention.ScatterPlan.build(sel, last)
        return [block(slice(0, n), last, scatter_attention.ScatterBias(plan))]
    min_tokens = MIN_BLOCK_TOKENS_CUDA if sel.device.type == "cuda" else MIN_BLOCK_TOKENS
    count = max(1, min(ATTENTION_BLOCKS, n // min_tokens))
    bounds = [round(i * n / count) for i in range(count + 1)]
    limits = sel[[b - 1 for b in bounds[1:]]].tolist()
    blocks: list[Block] = []
    for a, b, end in zip(bounds, bounds[1:], limits):
        limit = int(end) + 1
        within = window if window is not None and limit > window else None
        blocks.append(block(slice(a, b), limit, _attention_mask(sel[a:b], limit, dtype, within)))
    return blocks


# `FuseConfig.attention="auto"` on CUDA: FlexAttention for selections attending to this many keys or more.
# Measured on H100s (Llama-3.1-8B shape, cacheblend@0.15 from GPU memory, runs on different machines):
# at 32K tokens 479 ms with it against 676 ms with masked blocks; at 8K 123-136 ms with it against
# 100-111 ms with blocks, where a fusion is closer to bound by its kernel launches.
FLEX_MIN_KEYS = 16384


def attention_kernel(choice: str, device: torch.device) -> int | None:
    """From how many keys a scattered selection runs under FlexAttention, for `FuseConfig.attention`
    ``choice`` on ``device`` (None: always masked blocks).
    """
    if choice == "flex":
        return 0
    if choice == "blocks" or device.type != "cuda":
        return None
    return FLEX_MIN_KEYS if scatter_attention.flex_works(device) else None


def _run_layer(lm: LoadedModel, layer_idx: int, hidden: torch.Tensor, sel: torch.Tensor, blocks: list[Block],
               cache: hf_compat.ScatterCache) -> torch.Tensor:
    """One decoder layer over the selected tokens, block by block; the layer's output hidden states."""
    scatter = cache.layer(layer_idx)
    outs = []
    for part, limit, mask, rope in blocks:
        scatter.rows, scatter.limit = sel[part], limit
        outs.append(hf_compat.run_decoder_layer(lm.model, layer_idx, hidden[:, part], mask, sel[part], rope, cache))
    scatter.rows, scatter.limit = sel, None
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _token_scores(
    lm: LoadedModel, score: str, layer_idx: int, hidden_in: torch.Tensor, sel: torch.Tensor,
    layer: hf_compat.ScatterLayer, seg: Segments, stored: KV, fresh: KV, rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The ranking score of each selected token at a check layer (higher is kept).

    ``stored`` and ``fresh`` are the selected tokens' stored and fresh K/V rows ``[1, H, n_sel, D]``
    at the layer, ``rope`` their rotary embeddings.
    """
    if score == "kv":
        return kv_deviation(stored, fresh)
    attention = suffix_attention(lm, layer_idx, hidden_in, sel, layer, seg, rope)
    if score == "attention":
        return attention
    return kv_deviation(stored, fresh) * attention


def kv_deviation(stored: KV, fresh: KV) -> torch.Tensor:
    """Per token: squared K and V change of the ``fresh`` rows vs the ``stored`` ones (each
    ``(keys, values)`` ``[1, H, n, D]``), each relative to the fresh rows' mean squared norm.
    """
    new_k, new_v = fresh[0].float(), fresh[1].float()
    dk = (new_k - stored[0].float()).pow(2).sum(dim=(0, 1, 3))
    dv = (new_v - stored[1].float()).pow(2).sum(dim=(0, 1, 3))
    scale_k = new_k.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    scale_v = new_v.pow(2).sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)
    return dk / scale_k + dv / scale_v


def suffix_attention(
    lm: LoadedModel, layer_idx: int, hidden_in: torch.Tensor, sel: torch.Tensor,
    layer: hf_compat.ScatterLayer, seg: Segments, rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Attention mass the question suffix puts on each selected token at ``layer_idx``: ``[n_sel]``.

    ``hidden_in`` is the layer's input for the selected tokens ``[1, n_sel, hidden]`` and ``rope``
    their rotary embeddings; the suffix is the tail of the selection.
    """
    n_suffix = seg.total - seg.suffix_start
    q_rope = (rope[0][:, -n_suffix:], rope[1][:, -n_suffix:])
    return question_attention(lm, layer_idx, hidden_in[:, -n_suffix:], sel[-n_suffix:], q_rope, sel, layer)


def question_attention(
    lm: LoadedModel, layer_idx: int, hidden_q: torch.Tensor, q_pos: torch.Tensor,
    q_rope: tuple[torch.Tensor, torch.Tensor], key_pos: torch.Tensor | None, layer: hf_compat.ScatterLayer,
    weigh_values: bool = False,
) -> torch.Tensor:
    """Attention mass queries at ``q_pos`` (layer input ``hidden_q`` ``[1, n_q, hidden]``, rotary
    embeddings ``q_rope``) put on the cached keys at ``key_pos`` (None: every position), summed over
    queries and heads: ``[n_keys]``. With ``weigh_values`` each head's weight on a key is multiplied by
    the norm of that key's value row in the head: the size of what the key adds to the head's output.

    Each query's softmax runs over the keys it may see among ``key_pos`` (causal, and within the
    model's sliding window if it has one). The products run in the model's dtype (accumulated in
    float32 by the matrix kernels), the softmax in float32.
    """
    q = hf_compat.layer_queries(lm.model, layer_idx, hidden_q, q_rope)  # [1, H_q, n_q, D]
    keys, values, _ = layer.full()
    if key_pos is None:
        key_pos = torch.arange(keys.shape[2], device=keys.device)
    else:
        keys = keys[:, :, key_pos]  # [1, H_kv, n_keys, D]
    n_q, groups = q_pos.numel(), q.shape[1] // keys.shape[1]
    q = q.reshape(1, keys.shape[1], groups * n_q, -1).to(keys.dtype)  # heads of one KV group side by side
    scores = (q @ keys.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    hidden = key_pos[None, :] > q_pos[:, None]  # [n_q, n_keys]
    window = lm.spec.sliding_window
    if window is not None:
        hidden |= key_pos[None, :] <= q_pos[:, None] - window
    weights = scores.view(1, keys.shape[1], groups, n_q, -1).masked_fill(hidden, float("-inf")).softmax(-1)
    if weigh_values:
        weights = weights * values[:, :, key_pos].float().norm(dim=-1)[:, :, None, None]
    return weights.sum(dim=(0, 1, 2, 3))


def _causal_kernel(lm: LoadedModel) -> bool:
    """Whether the model's attention applies a causal mask by itself when given none (SDPA)."""
    return getattr(lm.model.config, "_attn_implementation", None) == "sdpa"


def fuse(lm: LoadedModel, inp: FusionInput, config: FuseConfig, selector: Selector | None = None) -> FusionResult:
    """Run the selective-recompute layer loop and return the fused cache and last-token logits.

    ``selector`` replaces the one ``config.mode`` names (e.g. a `FixedSelector`).

    Stored chunk layers are placed into the cache just before their layer runs, so a `ChunkFeed`
    input loads later layers while earlier ones are recomputed. ``probe`` runs the loop twice: the
    question alone while the stored layers arrive, then its chosen tokens over the placed cache.
    """
    t0 = time.perf_counter()
    seg = segments(inp)
    selector = make_selector(config) if selector is None else selector
    device = lm.device
    ids = torch.cat([inp.prefix.ids.to(device)] + [c.to(device) for c in inp.chunk_ids]
                    + [inp.suffix_ids.to(device)])
    layers = _prefixed_layers(lm, inp, seg)
    cache = hf_compat.ScatterCache(layers)
    feed = _open_feed(lm, inp, seg, layers[0][0].dtype)
    loop = _LayerLoop(lm, ids, seg, cache, selector, config.score, attention_kernel(config.attention, device))
    sel = selector.initial(seg).nonzero().squeeze(1).to(device)
    try:
        with torch.no_grad():
            placement = None
            if feed is not None:
                positions = torch.arange(seg.prefix_len, seg.suffix_start, device=device)
                placement = (feed, *rope_at(lm.model, positions, layers[0][0]))
            probe_counts: list[int] = []
            probe_from = selector.probe_from(seg, lm.spec.n_layers)
            if probe_from is not None:
                attention = torch.zeros(seg.total, dtype=torch.float32, device=device)
                _, _, probe_counts = loop.run(sel, placement, attention, probe_from)
                sel, placement = selector.choose(attention.cpu(), seg).nonzero().squeeze(1).to(device), None
            hidden, sel, n_selected = loop.run(sel, placement)
            if probe_counts:
                n_selected = [a + b for a, b in zip(probe_counts, n_selected)]
            logits = hf_compat.final_logits(lm.model, hidden[:, -1:])[0, -1]
    finally:
        if feed is not None:
            feed.close()
    return FusionResult(cache.to_dynamic(), logits, seg.total, n_selected,
                        time.perf_counter() - t0, sel, feed.wait_s if feed is not None else 0.0)


class _LayerLoop:
    """One pass of the selected tokens through every decoder layer, writing their rows into the cache."""

    def __init__(self, lm: LoadedModel, ids: torch.Tensor, seg: Segments, cache: hf_compat.ScatterCache,
                 selector: Selector, score: str, flex_from: int | None = None) -> None:
        self.lm, self.ids, self.seg, self.cache = lm, ids, seg, cache
        self.selector, self.score, self.flex_from = selector, score, flex_from
        self.window, self.causal_ok = lm.spec.sliding_window, _causal_kernel(lm)

    def run(
        self, sel: torch.Tensor, placement: tuple[ChunkFeed, torch.Tensor, torch.Tensor] | None,
        attention: torch.Tensor | None = None, attention_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Run ``sel`` (sorted positions) through all layers; the last hidden states, the final
        selection and the per-layer counts.

        ``placement`` (feed, cos, sin) writes each stored layer into the cache before it runs.
        ``attention`` ``[N]`` accumulates the suffix's attention over all positions at the layers
        from ``attention_from`` up.
        """
        lm, seg, selector = self.lm, self.seg, self.selector
        hidden = hf_compat.embed_tokens(lm.model, self.ids[sel])[None]  # [1, n_sel, hidden]
        blocks = _blocks(self.lm, sel, seg.total, hidden.dtype, self.window, self.causal_ok, self.flex_from)
        n_suffix = seg.total - seg.suffix_start
        if attention is not None:  # the question's rotary embeddings, for its queries at every layer
            q_rope = hf_compat.position_embeddings(lm.model, hidden, sel[-n_suffix:])
        n_selected = []
        for layer_idx in range(lm.spec.n_layers):
            scatter = self.cache.layer(layer_idx)
            if placement is not None:
                feed, cos, sin = placement
                _place_layer(scatter, feed.layer(layer_idx), seg, cos, sin)
            if selector.checks(layer_idx):
                keep = self.narrow(layer_idx, sel, hidden, scatter, _rope_of(blocks))
                if keep is not None:
                    sel, hidden = sel[keep], hidden[:, keep]
                    blocks = _blocks(lm, sel, seg.total, hidden.dtype, self.window, self.causal_ok, self.flex_from)
            n_selected.append(int(sel.numel()))
            hidden_in = hidden
            hidden = _run_layer(lm, layer_idx, hidden, sel, blocks, self.cache)
            if attention is not None and layer_idx >= attention_from:
                attention += question_attention(lm, layer_idx, hidden_in[:, -n_suffix:], sel[-n_suffix:],
                                                q_rope, None, scatter)
        return hidden, sel, n_selected

    def narrow(self, layer_idx: int, sel: torch.Tensor, hidden_in: torch.Tensor,
               scatter: hf_compat.ScatterLayer, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """A check before layer ``layer_idx``'s body: which of the selected tokens (``hidden_in``:
        their input to the layer, ``rope``: their rotary embeddings) the layer runs on, as indices
        into ``sel`` on its device (None: all).

        Every selected token's fresh K/V rows are written first, from the layer's projections alone,
        and ranked against the stored rows; the tokens the selector drops keep those fresh rows, so
        running the layer's attention and MLP on the kept tokens alone gives what running it on all
        of them and then dropping the rest would, at the cost of the K/V projections for the rest.
        """
        keys, values, _ = scatter.full()
        stored = keys[:, :, sel], values[:, :, sel]
        fresh = hf_compat.layer_keys_values(self.lm.model, layer_idx, hidden_in, rope)
        keys[:, :, sel] = fresh[0].to(keys.dtype)
        values[:, :, sel] = fresh[1].to(values.dtype)
        score = _token_scores(self.lm, self.score, layer_idx, hidden_in, sel, scatter, self.seg, stored, fresh, rope)
        keep = self.selector.narrow(layer_idx, sel.cpu(), score.cpu(), self.seg)
        if keep is None or keep.numel() == sel.numel():
            return None
        return keep.to(sel.device)


def _rope_of(blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embeddings ``[1, n_sel, R]`` of the whole selection, from its blocks'."""
    if len(blocks) == 1:
        return blocks[0][3]
    return (torch.cat([b[3][0] for b in blocks], dim=1), torch.cat([b[3][1] for b in blocks], dim=1))
