"""Experiment: kvrag's plain decoder layer run as two ``torch.compile``d regions around its attention.

A selective recompute on a GPU pays for a layer mostly in kernel launches and the Python around them. Here the
layer's work before its attention (norm, q/k/v projections, per-head norms, rotary embeddings) and after it
(output projection, residual, norm, gated MLP, residual) each run as one compiled function (weights as
arguments, so one compilation serves every layer; token counts dynamic), the cache writes and the attention
(`llama_layer.attend`) eager between them. Measured on an H200 it made the short passes slower, not faster
(benchmarks/gpu-compiled-layers), so kvrag does not ship it; this script keeps the measurement repeatable.

    python benchmarks/experiments/compiled_layer.py on -v bench speed --arch llama-3.1-8b --codec int8 ...
    python benchmarks/experiments/compiled_layer.py off -v bench speed ...   (the same, eager)

The first argument (``on`` or ``off``) chooses; the rest are `kvrag`'s command line.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvrag.model import llama_layer

if TYPE_CHECKING:
    from kvrag.model.hf_compat import ScatterLayer

log = logging.getLogger("kvrag.experiments.compiled_layer")

def run(layer: Any, hidden: torch.Tensor, mask: Any, rope: tuple[torch.Tensor, torch.Tensor],
        scatter: ScatterLayer) -> torch.Tensor:
    """`llama_layer.run`, its work before and after the attention compiled."""
    attn, mlp = layer.self_attn, layer.mlp
    rot = llama_layer.rotation(*rope, hidden.dtype)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    queries, keys, values = _projections()(
        hidden, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
        attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
        attn.v_proj.weight, attn.v_proj.bias, *_norm_args(q_norm), *_norm_args(k_norm),
        rot.cos, rot.sin, rot.half, attn.head_dim)
    keys, values = scatter.update(keys, values)
    out = llama_layer.attend(queries, keys, values, mask, attn.scaling)
    norm = layer.post_attention_layernorm
    return _output_and_mlp()(
        out, hidden, attn.o_proj.weight, attn.o_proj.bias, norm.weight, norm.variance_epsilon,
        mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
        mlp.down_proj.weight, mlp.down_proj.bias)


def _norm_args(norm: Any) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (norm.weight, norm.variance_epsilon)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _heads(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None,
           eps: float, head_dim: int) -> torch.Tensor:
    x = F.linear(h, weight, bias).view(1, h.shape[1], -1, head_dim)
    if norm is not None:
        x = _rms(x, norm, eps)
    return x.transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((_rotate(x[..., :rot], cos, sin, half), x[..., rot:]), dim=-1)
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), sin)


def _project(hidden: torch.Tensor, norm: torch.Tensor, eps: float, q_w: torch.Tensor, q_b: torch.Tensor | None,
             k_w: torch.Tensor, k_b: torch.Tensor | None, v_w: torch.Tensor, v_b: torch.Tensor | None,
             qn: torch.Tensor | None, qn_eps: float, kn: torch.Tensor | None, kn_eps: float,
             cos: torch.Tensor, sin: torch.Tensor, half: int, head_dim: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries and keys and the values ``[1, heads, n, D]`` of the layer input ``hidden``."""
    h = _rms(hidden, norm, eps)
    queries = _rotate(_heads(h, q_w, q_b, qn, qn_eps, head_dim), cos, sin, half)
    keys = _rotate(_heads(h, k_w, k_b, kn, kn_eps, head_dim), cos, sin, half)
    return queries, keys, _heads(h, v_w, v_b, None, 0.0, head_dim)


def _finish(attended: torch.Tensor, hidden: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
            norm: torch.Tensor, eps: float, gate_w: torch.Tensor, gate_b: torch.Tensor | None, up_w: torch.Tensor,
            up_b: torch.Tensor | None, down_w: torch.Tensor, down_b: torch.Tensor | None) -> torch.Tensor:
    """The layer's output from its attention's ``[1, heads, n, D]`` and its input ``hidden``."""
    out = attended.transpose(1, 2).reshape(*hidden.shape[:-1], -1)
    hidden = hidden + F.linear(out, o_w, o_b)
    h = _rms(hidden, norm, eps)
    gated = F.silu(F.linear(h, gate_w, gate_b)) * F.linear(h, up_w, up_b)
    return hidden + F.linear(gated, down_w, down_b)


@functools.cache
def _projections() -> Any:
    log.info("compiling the decoder layer's projections (once per process)")
    return torch.compile(_project, dynamic=True, fullgraph=True)


@functools.cache
def _output_and_mlp() -> Any:
    return torch.compile(_finish, dynamic=True, fullgraph=True)


def main(argv: list[str]) -> int:
    """``on``/``off``, then `kvrag`'s command line, run with plain layers compiled or eager."""
    from kvrag.cli import main as kvrag_main

    if not argv or argv[0] not in ("on", "off"):
        raise SystemExit("usage: compiled_layer.py on|off KVRAG-ARGS... (on: plain layers compiled)")
    if argv[0] == "on":
        llama_layer.run = run
    return kvrag_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
