"""How a check layer or a probe ranks tokens: K/V deviation and the question's attention.

Shapes: K/V rows ``[1, kv_heads, n, head_dim]``; layer inputs ``[1, n, hidden]``; rotary embeddings
``(cos, sin)`` ``[1, n, R]``; scores ``[n]`` float32, higher is kept. `token_scores` picks the score
`Selector.check_score` names (``cacheblend``'s ``score`` option).
"""

from __future__ import annotations

import torch

from kvrag.fusion.inputs import Segments
from kvrag.model import LoadedModel, hf_compat
from kvrag.model.prefix import KV


def token_scores(
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
    layer's sliding window if it has one), with the layer's own scale, soft-cap and attention sinks
    (`kvrag.model.families.ScoreRule`). The products run in the model's dtype (accumulated in float32 by the
    matrix kernels), the softmax in float32.
    """
    q = lm.family.queries(lm.model, layer_idx, hidden_q, q_rope)  # [1, H_q, n_q, D]
    keys, values, _ = layer.full()
    if key_pos is not None:
        keys = keys[:, :, key_pos]  # [1, H_kv, n_keys, D]
    rule = lm.family.score_rule(lm.model, layer_idx)
    weights = causal_weights(q, keys, q_pos, key_pos, rule.scale, lm.family.kinds[layer_idx].window, rule.cap,
                             rule.sinks)
    if weigh_values:
        chosen = values if key_pos is None else values[:, :, key_pos]
        weights = weights * chosen.float().norm(dim=-1)[:, :, None, None]
    return weights.sum(dim=(0, 1, 2, 3))


def causal_weights(query: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor | None,
                   scale: float, window: int | None = None, cap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights ``[1, H_kv, groups, n_q, n_keys]`` (float32) of queries ``[1, H_q, n_q, D]`` at sorted
    ``q_pos`` over ``keys`` ``[1, H_kv, n_keys, D]`` at ``key_pos`` (None: positions ``0..n_keys-1``), each query
    seeing the keys at or before its position (and within ``window``); logits soft-capped at ``cap``, and each
    head's softmax also spread over its sink logit (``sinks`` ``[H_q]``), whose weight is dropped. The products
    run in the keys' dtype, the softmax in float32.
    """
    kv_heads, n_q = keys.shape[1], q_pos.numel()
    groups = query.shape[1] // kv_heads
    rows = query.reshape(1, kv_heads, groups * n_q, -1).to(keys.dtype)  # heads of one KV group side by side
    scores = (rows @ keys.transpose(-1, -2)).float().mul_(scale).view(1, kv_heads, groups, n_q, -1)
    if cap is not None:
        scores = torch.tanh(scores / cap).mul_(cap)
    if key_pos is None and window is None:  # every query sees the keys before the first: mask only the rest
        first = int(q_pos[0])
        later = torch.arange(first, keys.shape[2], device=keys.device)
        scores[..., first:].masked_fill_(later[None, :] > q_pos[:, None], float("-inf"))
        return _softmax(scores, sinks)
    if key_pos is None:
        key_pos = torch.arange(keys.shape[2], device=keys.device)
    hidden = key_pos[None, :] > q_pos[:, None]  # [n_q, n_keys]
    if window is not None:
        hidden |= key_pos[None, :] <= q_pos[:, None] - window
    return _softmax(scores.masked_fill_(hidden, float("-inf")), sinks)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the keys of ``scores`` ``[1, H_kv, groups, n_q, n_keys]``, each head's also over its sink."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(1, scores.shape[1], scores.shape[2], 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
