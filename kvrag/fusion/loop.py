"""`fuse`: the selective-recompute layer loop.

The sequence is ``[prefix][chunk 1]…[chunk k][suffix]`` of N tokens. Its full K/V is assembled from
the prefix cache and the chunks' stored pre-RoPE caches rotated to their new positions
(`kvrag.fusion.placement`); the model's own decoder layers then run on the *selected* tokens only,
writing their fresh K/V rows into the full cache (`hf_compat.ScatterCache`). A selector
(`kvrag.fusion.selectors`) chooses the tokens before layer 0 and may narrow them before any layer or
choose them after a probe pass. Selecting every token reproduces a full prefill exactly.

Layout: per layer ``[1, kv_heads, N, head_dim]``; hidden states of the selection ``[1, n_sel, hidden]``.
"""

from __future__ import annotations

import time
from itertools import zip_longest

import torch

from kvrag.config import FuseConfig
from kvrag.fusion import attention as attn
from kvrag.fusion import placement, slicing
from kvrag.fusion.inputs import FusionInput, FusionResult, Segments, segments
from kvrag.fusion.scores import question_attention, token_scores
from kvrag.fusion.selectors import Selector, make_selector
from kvrag.loading.feed import ChunkFeed
from kvrag.model import LoadedModel, hf_compat, llama_layer
from kvrag.model.families import LayerKind
from kvrag.model.rope import Rope, layer_ropes


def fuse(lm: LoadedModel, inp: FusionInput, config: FuseConfig, selector: Selector | None = None) -> FusionResult:
    """Run the selective-recompute layer loop and return the fused cache and last-token logits.

    Stored chunk layers are placed into the cache just before their layer runs, so a `ChunkFeed`
    input loads later layers while earlier ones are recomputed. A probing selector (``probe``) runs
    the loop twice: the question alone through the layers it reads (`Selector.probe_until`) while
    those stored layers arrive, then its chosen tokens over the cache, placing the layers the probe
    did not reach as they come.

    Args:
        lm: the model the caches were computed with.
        inp: the prefix cache, the chunks (token ids and stored caches or a feed) and the suffix.
        config: the fusion settings; ``config.mode`` names the selector.
        selector: replaces the one ``config.mode`` names (e.g. a `FixedSelector`).

    Returns:
        The fused cache over all N tokens, the last token's logits and what was recomputed.
    """
    slicing.boundary()  # the work before the fusion is a slice of its own
    t0 = time.perf_counter()
    seg = segments(inp)
    selector = make_selector(config) if selector is None else selector
    device = lm.device
    ids = torch.cat([inp.prefix.ids.to(device)] + [c.to(device) for c in inp.chunk_ids]
                    + [inp.suffix_ids.to(device)])  # [N]
    layers = placement.prefixed_layers(lm, inp, seg)
    cache = hf_compat.ScatterCache(layers)
    feed = placement.open_feed(lm, inp, seg, layers[0][0].dtype)
    loop = _LayerLoop(lm, ids, seg, cache, selector, selector.check_score,
                      attn.attention_kernel(config.attention, device),
                      attn.tiles_on(config.attention, device))
    sel = selector.initial(seg).nonzero().squeeze(1).to(device)  # [n_sel] sorted positions
    try:
        with torch.no_grad():
            placing = None
            if feed is not None:
                positions = torch.arange(seg.prefix_len, seg.suffix_start, device=device)
                placing = (feed, layer_ropes(lm.model, lm.family, positions, layers[0][0]))
            probe_counts: list[int] = []
            probe_logits = None
            n_layers = lm.spec.n_layers
            probe_from, probed = selector.probe_from(seg, n_layers), 0  # probed: the layers the probe ran and placed
            if probe_from is not None:
                probed = selector.probe_until(n_layers)
                attention = torch.zeros(seg.total, dtype=torch.float32, device=device)  # [N]
                probe_hidden, _, probe_counts = loop.run(sel, placing, attention, probe_from, stop=probed)
                if probed == n_layers:
                    probe_logits = lm.family.logits(lm.model, probe_hidden[:, -1:])[0, -1]
                sel = selector.choose(attention.cpu(), seg).nonzero().squeeze(1).to(device)
            hidden, sel, n_selected = loop.run(sel, placing, placed=probed)
            n_selected = [a + b for a, b in zip_longest(probe_counts, n_selected, fillvalue=0)]
            logits = lm.family.logits(lm.model, hidden[:, -1:])[0, -1]
    finally:
        llama_layer.forget_rotations()
        if feed is not None:
            feed.close()
    return FusionResult(cache.to_dynamic(lm.model), logits, seg.total, n_selected,
                        time.perf_counter() - t0, sel, feed.wait_s if feed is not None else 0.0, probe_logits)


def run_layer(lm: LoadedModel, layer_idx: int, hidden: torch.Tensor, sel: torch.Tensor, blocks: list[attn.Block],
              cache: hf_compat.ScatterCache) -> torch.Tensor:
    """One decoder layer over the selected tokens, block by block; the layer's output hidden states. An installed
    `kvrag.fusion.slicing.Slicer` may run other work between blocks (nothing here depends on it).
    """
    scatter = cache.layer(layer_idx)
    outs = []
    for part, limit, mask, rope in blocks:
        scatter.rows, scatter.limit = sel[part], limit
        outs.append(hf_compat.run_decoder_layer(lm.model, layer_idx, hidden[:, part], mask, sel[part], rope, cache))
        slicing.ran(int(scatter.rows.numel()), lm.spec.n_layers)  # may run other answers' steps before the next
    scatter.rows, scatter.limit = sel, None
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class _LayerLoop:
    """One pass of the selected tokens through every decoder layer, writing their rows into the cache.

    Layers of one `LayerKind` (window and rotary embedding, from the model's family) share their blocks.
    """

    def __init__(self, lm: LoadedModel, ids: torch.Tensor, seg: Segments, cache: hf_compat.ScatterCache,
                 selector: Selector, score: str, flex_from: int | None = None, tiled: bool = False) -> None:
        self.lm, self.ids, self.seg, self.cache = lm, ids, seg, cache
        self.selector, self.score, self.flex_from, self.tiled = selector, score, flex_from, tiled
        self.kinds, self.causal_ok = lm.family.kinds, attn.causal_kernel(lm)
        self.unstored = {kind.window: attn.unstored_rows(seg, kind.window, lm.device) for kind in self.kinds}

    def blocks(self, sel: torch.Tensor, dtype: torch.dtype) -> dict[LayerKind, list[attn.Block]]:
        """`attn.layer_blocks` for ``sel`` under this loop's model and kernel, per kind of layer."""
        return {kind: attn.layer_blocks(self.lm, sel, self.seg.total, dtype, kind.window, self.causal_ok,
                                        self.flex_from, self.tiled, kind.rope, self.unstored[kind.window])
                for kind in dict.fromkeys(self.kinds)}

    def run(
        self, sel: torch.Tensor, placing: tuple[ChunkFeed, list[Rope]] | None,
        attention: torch.Tensor | None = None, attention_from: int = 0, stop: int | None = None, placed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Run ``sel`` (sorted positions) through the layers below ``stop`` (all by default); the last hidden
        states, the final selection and the per-layer counts.

        ``placing`` (feed, each layer's (cos, sin)) writes each stored layer from ``placed`` up into the cache
        before it runs (the layers below are there already).
        ``attention`` ``[N]`` accumulates the suffix's attention over all positions at the layers
        from ``attention_from`` up.
        """
        lm, seg, selector = self.lm, self.seg, self.selector
        hidden = lm.family.embed(lm.model, self.ids[sel])[None]  # [1, n_sel, hidden]
        blocks = self.blocks(sel, hidden.dtype)
        n_suffix = seg.total - seg.suffix_start
        if attention is not None:  # the question's rotary embeddings, for its queries at every layer
            q_ropes = {kind.rope: lm.family.rope(lm.model, kind.rope, hidden, sel[-n_suffix:][None])
                       for kind in self.kinds}
        reading = self.reading(blocks, sel, n_suffix, attention)
        n_selected = []
        for layer_idx in range(lm.spec.n_layers if stop is None else stop):
            scatter, kind = self.cache.layer(layer_idx), self.kinds[layer_idx]
            if placing is not None and layer_idx >= placed:
                feed, ropes = placing
                placement.place_layer(scatter, feed.layer(layer_idx), seg, *ropes[layer_idx])
            if selector.checks(layer_idx):
                keep = self.narrow(layer_idx, sel, hidden, scatter, attn.rope_of(blocks[kind]))
                if keep is not None:
                    sel, hidden = sel[keep], hidden[:, keep]
                    blocks = self.blocks(sel, hidden.dtype)
                    reading = self.reading(blocks, sel, n_suffix, attention)
            n_selected.append(int(sel.numel()))
            hidden_in = hidden
            reads = attention is not None and layer_idx >= attention_from
            read = reading.get(kind) if reads else None
            hidden = run_layer(lm, layer_idx, hidden, sel, read or blocks[kind], self.cache)
            if reads and not read:
                assert attention is not None
                attention += question_attention(lm, layer_idx, hidden_in[:, -n_suffix:], sel[-n_suffix:],
                                                q_ropes[kind.rope], None, scatter)
        return hidden, sel, n_selected

    def reading(self, blocks: dict[LayerKind, list[attn.Block]], sel: torch.Tensor, readers: int,
                attention: torch.Tensor | None) -> dict[LayerKind, list[attn.Block] | None]:
        """`attn.reading_blocks` for this pass per kind of layer (none without an ``attention`` to accumulate,
        or without tiles).
        """
        if attention is None or not self.tiled:
            return {}
        return {kind: attn.reading_blocks(self.lm, kind_blocks, sel, kind.window, self.causal_ok, readers, attention)
                for kind, kind_blocks in blocks.items()}

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
        fresh = self.lm.family.keys_values(self.lm.model, layer_idx, hidden_in, rope)
        keys[:, :, sel] = fresh[0].to(keys.dtype)
        values[:, :, sel] = fresh[1].to(values.dtype)
        score = token_scores(self.lm, self.score, layer_idx, hidden_in, sel, scatter, self.seg, stored, fresh, rope)
        keep = self.selector.narrow(layer_idx, sel.cpu(), score.cpu(), self.seg)
        if keep is None or keep.numel() == sel.numel():
            return None
        return keep.to(sel.device)
