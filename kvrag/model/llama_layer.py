"""Decoder layers of the Llama family run from their parts, with fewer kernels than their own forward.

A selective recompute runs every decoder layer once per pass over a few selected tokens, so on a GPU
a layer costs mostly its kernel launches and the Python around them, not its arithmetic. (Counted on the
CPU for a tiny Llama, a fusion runs about as many tensor operations either way; the saving is mostly the
Python of the layer's own forward, and on CUDA the rotary and norm kernels and the copies of grouped keys.) A layer of
`PLAIN_DECODER_LAYERS` (pre-norm attention with q/k/v/o projections and optional per-head q/k norms,
a residual, pre-norm gated MLP, a residual) is run here from its own weights:

- RMS norms through ``F.rms_norm`` (fused where torch has a kernel for it; the layer's: six elementwise ops);
- rotary embeddings as ``x * cos + roll(x) * sin±`` (the layer's: five kernels per tensor), with the
  signed sine computed once per block;
- the fresh key/value rows written into the cache with ``index_copy_``;
- attention over the grouped key/value heads without copying them per query head, where the kernel
  takes them (no mask, a lower-right causal bias, a `ScatterBias`, a dense mask on the CPU); on CUDA
  a dense mask keeps the copies, since the kernel that takes a dense mask has no grouped heads;
- the gated MLP through ``F.silu``, its activation and product in place (a long prefill's largest tensors are the
  MLP's ``[1, n, intermediate]``: two of them live at once, not three);
- every projection through `kvrag.model.cpu_linear.linear` (``F.linear``, or a kernel that reads the weights at
  the memory's speed for the few rows of a decoding step on the CPU).

The operations and their order are the layer's own, so the results agree with it to float rounding
(checked for every tiny architecture in ``tests/test_llama_layer.py``). Layers of other classes, and
layers whose norm or activation is not the plain one or that carry accelerate's hooks, run their own forward
(`runs_plain`).

Layout: hidden states ``[1, n, hidden]``; heads ``[1, heads, n, head_dim]``.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvrag.model.cpu_linear import linear


class RowWriter(Protocol):
    """Where a layer's fresh key/value rows go: `update` stores them and returns the whole keys and values the
    layer's queries attend to (a fusion's `kvrag.model.hf_compat.ScatterLayer`, or one layer of a cache that grows).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


# Decoder layers whose forward is: pre-norm attention with q/k/v/o projections (and optional per-head q/k norms) plus
# a residual, then pre-norm MLP plus a residual.
PLAIN_DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "NativeDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                                  "Qwen3DecoderLayer"})
_SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' module for ``x * sigmoid(x)``
_RMS_NORMS = frozenset({"LlamaRMSNorm", "NativeRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def runs_plain(layer: Any) -> bool:
    """Whether `run` takes ``layer`` (checked once per layer and remembered on it)."""
    known = getattr(layer, "_kvrag_runs_plain", None)
    if known is None:
        known = type(layer).__name__ in PLAIN_DECODER_LAYERS and _plain_parts(layer)
        layer._kvrag_runs_plain = known
    return bool(known)


def _plain_parts(layer: Any) -> bool:
    """Whether a layer of a `PLAIN_DECODER_LAYERS` class has the plain norms, activation and attention."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm,
             *(n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None)]
    return (all(type(n).__name__ in _RMS_NORMS for n in norms)
            and type(getattr(mlp, "act_fn", None)).__name__ in _SILU
            and getattr(attn.config, "_attn_implementation", None) == "sdpa"
            # accelerate's hooks (device maps, offloading) move weights in before a module's forward
            and not any(hasattr(m, "_hf_hook") for m in layer.modules()))


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A model's RMS norm module applied to ``x``: normalised in float32, cast back, scaled by its weight."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


class Rope:
    """A block's rotary ``(cos, sin)`` ``[1, n, D]`` in the form `rotate` applies: ``sin±`` is the sine with its
    first half negated, so that ``rotate_half(x) * sin == roll(x, D/2) * sin±`` exactly.
    """

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> None:
        cos, sin = rope
        half = sin.shape[-1] // 2
        self.source = rope
        self.cos = cos[:, None].to(dtype)  # [1, 1, n, D]
        self.sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None].to(dtype)
        self.half = half

    def rotate(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[1, heads, n, D]`` rotated (what the layer's ``apply_rotary_pos_emb`` gives), into ``out``
        when given (e.g. the rows of a cache); with partial rotary embeddings (``R < D``) its last ``D - R``
        features pass unrotated.
        """
        rot = self.cos.shape[-1]
        if rot != x.shape[-1]:
            whole = torch.cat((self.rotate(x[..., :rot]), x[..., rot:]), dim=-1)
            return whole if out is None else out.copy_(whole)
        return torch.addcmul(x * self.cos, torch.roll(x, self.half, dims=-1), self.sin, out=out)


_latest = threading.local()  # per thread, the few `Rope`s last asked for (`rotation`)
_KEPT_ROPES = 4


def rotation(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> Rope:
    """The `Rope` of ``(cos, sin)`` in ``dtype``, built once while the same tensors come back: a fusion asks for
    its placed chunks' and each block's every layer.
    """
    kept: list[Rope] = getattr(_latest, "ropes", None) or []
    for made in kept:
        if made.source[0] is cos and made.source[1] is sin and made.cos.dtype == dtype:
            return made
    made = Rope((cos, sin), dtype)
    _latest.ropes = [made, *kept[: _KEPT_ROPES - 1]]
    return made


def forget_rotations() -> None:
    """Drop this thread's kept `Rope`s (and the tensors they hold), e.g. when a fusion ends."""
    _latest.ropes = []


def heads(proj: Any, norm: Any, h: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Projection ``proj`` of the normed layer input ``h`` ``[B, n, hidden]`` split into heads ``[B, heads, n, D]``
    (the per-head ``norm`` applied where the model has one).
    """
    x = linear(h, proj.weight, proj.bias).view(h.shape[0], h.shape[1], -1, head_dim)  # [B, n, heads, D]
    if norm is not None:
        x = rms_norm(norm, x) if type(norm).__name__ in _RMS_NORMS else norm(x)
    return x.transpose(1, 2)


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any, scale: float) -> torch.Tensor:
    """SDPA of ``queries`` over the grouped ``keys``/``values`` under ``mask`` (None: causal over all of them)."""
    groups = queries.shape[1] // keys.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=queries.shape[2] > 1, scale=scale,
                                              enable_gqa=groups > 1)
    if groups > 1 and type(mask) is torch.Tensor and queries.device.type == "cuda":
        keys, values = (t.repeat_interleave(groups, dim=1) for t in (keys, values))
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def run(layer: Any, hidden: torch.Tensor, mask: Any, rope: tuple[torch.Tensor, torch.Tensor],
        scatter: RowWriter) -> torch.Tensor:
    """Decoder layer ``layer`` (`runs_plain`) on ``hidden`` ``[B, n, hidden]`` at the positions whose rotary
    embeddings are ``rope``; their fresh key/value rows go into ``scatter`` (a `ScatterLayer`'s ``rows`` set by the
    caller).
    """
    hidden = hidden + _attention(layer, rms_norm(layer.input_layernorm, hidden), mask, rope, scatter)
    return hidden + _mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, hidden))


def _attention(layer: Any, h: torch.Tensor, mask: Any, rope: tuple[torch.Tensor, torch.Tensor],
               scatter: RowWriter) -> torch.Tensor:
    """The attention block's output ``[1, n, hidden]`` for the normed input ``h`` (its queries and heads' output
    freed when it returns, before the MLP allocates).
    """
    attn = layer.self_attn
    rot = rotation(*rope, h.dtype)
    d = attn.head_dim
    queries = rot.rotate(heads(attn.q_proj, getattr(attn, "q_norm", None), h, d))
    keys = rot.rotate(heads(attn.k_proj, getattr(attn, "k_norm", None), h, d))
    keys, values = scatter.update(keys, heads(attn.v_proj, None, h, d))
    out = attend(queries, keys, values, mask, attn.scaling).transpose(1, 2).reshape(*h.shape[:-1], -1)
    return linear(out, attn.o_proj.weight, attn.o_proj.bias)


def _mlp(mlp: Any, h: torch.Tensor) -> torch.Tensor:
    """The gated MLP of the normed input ``h`` ``[1, n, hidden]``: ``down(silu(gate(h)) * up(h))``, the activation
    and the product in place, so that two ``[1, n, intermediate]`` tensors are live at once instead of three.
    """
    gated = F.silu(linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias), inplace=True)
    gated.mul_(linear(h, mlp.up_proj.weight, mlp.up_proj.bias))
    return linear(gated, mlp.down_proj.weight, mlp.down_proj.bias)
