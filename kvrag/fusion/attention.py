"""How the selected tokens attend in each layer: blocks, masks and the attention kernel.

The selection (sorted positions ``sel`` ``[n_sel]`` into the N-token sequence) runs through a layer
as one or more position-ordered *blocks*. Each block attends to the cache rows up to its last
position under either no mask (a plain causal prefill), a lower-right causal bias, a `ScatterBias`
(FlexAttention, `kvrag.fusion.scatter_attention`) or an additive dense mask; `layer_blocks`
picks one. All of them are exact: a block sees the fresh rows the blocks before it wrote, and no row
after its last position. `attention_kernel` turns `FuseConfig.attention` into the FlexAttention
threshold `layer_blocks` takes.

The constants below are read at call time, so tests can patch them on this module.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.fusion import recorded_attention, scatter_attention, tiled_attention
from kvrag.fusion.inputs import Segments
from kvrag.model import LoadedModel
from kvrag.model.families import DEFAULT_ROPE

ATTENTION_BLOCKS = 4  # selected tokens run through a layer in up to this many position-ordered blocks
MIN_BLOCK_TOKENS = 64  # on the CPU a block pays for itself from a few dozen tokens
MIN_BLOCK_TOKENS_CUDA = 1024  # on a GPU each block launches the layer's kernels again: only long selections split
# where a selection of the last positions runs as one block with a lower-right causal bias instead of masked blocks;
# on the CPU SDPA would build that mask anyway, and the blocks halve the keys read
LOWER_RIGHT_DEVICES = {"cuda"}
# where `FuseConfig.attention` "tiles" (and "auto") runs a scattered selection as one block under a `SortedCausalBias`
# (`kvrag.fusion.tiled_attention`, on SDPA's CPU flash kernel) and a probe pass reads the question's attention from the
# layer's own products (`RecordingBias`); a CUDA kernel takes FlexAttention or masked blocks instead
TILED_DEVICES = {"cpu"}
# (part of the selection, keys it attends to, mask, the model's (cos, sin) for its positions)
Block = tuple[slice, int, "torch.Tensor | None", tuple[torch.Tensor, torch.Tensor]]  # mask: additive or a CausalBias

# `FuseConfig.attention="auto"` on CUDA: FlexAttention for selections attending to this many keys or more.
# Measured on H100s (Llama-3.1-8B shape, cacheblend@0.15 from GPU memory, runs on different machines):
# at 32K tokens 479 ms with it against 676 ms with masked blocks; at 8K 123-136 ms with it against
# 100-111 ms with blocks, where a fusion is closer to bound by its kernel launches.
FLEX_MIN_KEYS = 16384


def unstored_rows(seg: Segments, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool ``[N]``: the chunk rows a layer with ``window`` does not store (all but each chunk's last ``window``,
    `kvrag.storage.container.encode_chunk`), which read back as zeros; None where there are none. Positions
    recomputed in the layer have fresh rows there; the rest of these are hidden from the selected tokens.
    """
    if window is None or all(n <= window for n in seg.chunk_lens):
        return None
    rows = torch.zeros(seg.total, dtype=torch.bool)
    for start, n in zip(seg.chunk_starts, seg.chunk_lens):
        if n > window and not bool(seg.forced[start]):
            rows[start : start + n - window] = True
    return rows.to(device)


def attention_mask(sel: torch.Tensor, total: int, dtype: torch.dtype, window: int | None,
                   visible: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[1, 1, n_sel, total]``: selected token i sees positions j <= pos_i (within window), and
    only those where ``visible`` (bool ``[>= total]``) is set.
    """
    cols = torch.arange(total, device=sel.device)
    allowed = cols[None, :] <= sel[:, None]
    if window is not None:
        allowed &= cols[None, :] > sel[:, None] - window
    if visible is not None:
        allowed &= visible[None, :total]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sel.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_lower_right(n: int, total: int) -> Any:
    """SDPA's lower-right causal bias for ``n`` queries over ``total`` keys (its module, which imports torch's
    compiler, loads on the first call).
    """
    # lazy: the module imports torch's compiler (torch._dynamo, over a second), needed only where this bias is used
    from torch.nn.attention.bias import causal_lower_right as bias

    return bias(n, total)


def layer_blocks(lm: LoadedModel, sel: torch.Tensor, total: int, dtype: torch.dtype, window: int | None,
                 causal_ok: bool, flex_from: int | None = None, tiled: bool = False,
                 rope: str | None = DEFAULT_ROPE, unstored: torch.Tensor | None = None) -> list[Block]:
    """How the selected tokens run through each layer.

    Every position selected and a kernel that masks causally by itself (``causal_ok``): one block,
    no mask — a plain causal prefill, which SDPA runs with its flash kernel. On CUDA, the last ``n``
    positions all selected (cacheblend before its first check, `prefix`): one block under a
    lower-right causal bias, which SDPA also runs with its flash kernel. A selection spread over the
    prompt runs as one block under a `ScatterBias` (FlexAttention) when it attends to at least
    ``flex_from`` keys (`attention_kernel`; None: never); with ``tiled`` (`tiles_on`), under a
    `SortedCausalBias` (tiles of unmasked and masked attention), so its projections and MLP run as one
    matrix product each. Otherwise (a kernel that needs a dense mask) it is cut into position-ordered blocks run in
    order; a block attends only to the positions up to its last token, so the attention reads about
    half the keys it would with one block over all of them. Exact: a block sees the fresh
    rows written by the blocks before it, and no row after it. Each block's rotary embeddings (the model's
    embedding ``rope``, `kvrag.model.families.LayerKind`) are computed here, once per pass. A windowed layer's
    ``unstored`` rows (`unstored_rows`) are masked wherever they are not recomputed.
    """
    n = int(sel.numel())
    like = torch.empty(0, dtype=dtype, device=sel.device)  # the dtype and device of the embeddings

    def block(part: slice, limit: int, mask: torch.Tensor | None) -> Block:
        return part, limit, mask, lm.family.rope(lm.model, rope, like, sel[part][None])

    causal_ok = causal_ok and (window is None or total <= window) and unstored is None  # no mask needed
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
    if causal_ok and tiled:
        return [block(slice(0, n), last, tiled_attention.SortedCausalBias(sel))]
    visible = None
    if unstored is not None:  # every row but the unstored ones the selection does not write afresh
        visible = ~unstored
        visible[sel] = True
    min_tokens = MIN_BLOCK_TOKENS_CUDA if sel.device.type == "cuda" else MIN_BLOCK_TOKENS
    count = max(1, min(ATTENTION_BLOCKS, n // min_tokens))
    bounds = [round(i * n / count) for i in range(count + 1)]
    limits = sel[[b - 1 for b in bounds[1:]]].tolist()
    blocks: list[Block] = []
    for a, b, end in zip(bounds, bounds[1:], limits):
        limit = int(end) + 1
        within = window if window is not None and limit > window else None
        blocks.append(block(slice(a, b), limit, attention_mask(sel[a:b], limit, dtype, within, visible)))
    return blocks


def reading_blocks(lm: LoadedModel, blocks: list[Block], sel: torch.Tensor, window: int | None, causal_ok: bool,
                   readers: int, sink: torch.Tensor) -> list[Block] | None:
    """``blocks`` as one block under a `RecordingBias` that adds the attention of the selection's last ``readers``
    tokens to ``sink`` ``[N]``, where it applies (a kernel that masks causally by itself, a window that masks
    nothing, few enough weights to write out); None where it does not. The loop asks for it where `tiles_on`.
    """
    last = int(sel[-1]) + 1
    if not (causal_ok and (window is None or last <= window)
            and recorded_attention.fits(int(sel.numel()), lm.spec.n_heads, last)):
        return None
    return [(slice(0, int(sel.numel())), last, recorded_attention.RecordingBias(sel, readers, sink), rope_of(blocks))]


def rope_of(blocks: list[Block]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embeddings ``[1, n_sel, R]`` of the whole selection, from its blocks'."""
    if len(blocks) == 1:
        return blocks[0][3]
    return (torch.cat([b[3][0] for b in blocks], dim=1), torch.cat([b[3][1] for b in blocks], dim=1))


def attention_kernel(choice: str, device: torch.device) -> int | None:
    """From how many keys a scattered selection runs under FlexAttention, for `FuseConfig.attention`
    ``choice`` on ``device`` (None: always masked blocks).
    """
    if choice == "flex":
        return 0
    if choice in ("blocks", "tiles") or device.type != "cuda":
        return None
    return FLEX_MIN_KEYS if scatter_attention.flex_works(device) else None


def tiles_on(choice: str, device: torch.device) -> bool:
    """Whether `FuseConfig.attention` ``choice`` runs scattered selections in tiles on ``device`` (`layer_blocks`)."""
    return choice in ("auto", "tiles") and device.type in TILED_DEVICES


def causal_kernel(lm: LoadedModel) -> bool:
    """Whether the model's attention applies a causal mask by itself when given none (SDPA)."""
    return getattr(lm.model.config, "_attn_implementation", None) == "sdpa"
