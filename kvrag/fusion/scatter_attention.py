"""Causal attention for queries at scattered positions, in one call per layer (FlexAttention).

Selective recompute runs a few tokens spread over the prompt (sorted positions ``p``) through a
decoder layer over the full cache: query ``i`` may see keys ``0..p[i]``. A dense additive mask
states that, but SDPA then runs its slowest kernel over every key for every query. Here the
decoder layer gets a `ScatterBias` instead of a mask; it intercepts the layer's
``scaled_dot_product_attention`` call and runs FlexAttention (compiled on CUDA) with a block mask
built once per selection: key blocks no query of a block may see are skipped, and only the blocks
on the diagonal are masked element by element.

On a GPU without a working Triton the fusion loop keeps its masked blocks instead (`flex_works`).

Layout: ``[batch, heads, seq, head_dim]`` (keys may carry the query heads, repeated, as transformers
passes them when it is given a mask).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.fusion.kernel_mask import KernelMask

try:  # FlexAttention came with torch 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # the fusion loop keeps its masked blocks (`flex_works`)
    create_block_mask = flex_attention = None  # type: ignore[assignment]
# compiled FlexAttention runs Triton kernels; whether it is installed, without importing it (0.2 s) on every start
HAS_TRITON = importlib.util.find_spec("triton") is not None

log = logging.getLogger(__name__)


@dataclass
class ScatterPlan:
    """Queries at sorted ``positions`` ``[n]`` attending to the first ``keys`` positions, and the
    block mask that says so; built once per selection and reused by every layer until it changes.
    """

    positions: torch.Tensor
    keys: int
    block_mask: Any

    @classmethod
    def build(cls, positions: torch.Tensor, keys: int) -> ScatterPlan:
        if create_block_mask is None:
            raise ImportError("FlexAttention needs torch 2.5 or later")

        def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= positions[q_idx]

        mask = create_block_mask(visible, None, None, int(positions.numel()), keys, device=positions.device)
        return cls(positions, keys, mask)


class ScatterBias(KernelMask):
    """Passed as a decoder layer's ``attention_mask``: its SDPA call runs `scatter_attention`."""

    plan: ScatterPlan

    def __new__(cls, plan: ScatterPlan) -> ScatterBias:
        return super().__new__(cls, plan.positions.device)

    def __init__(self, plan: ScatterPlan) -> None:
        self.plan = plan

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """`scatter_attention` under this stand-in's plan."""
        return scatter_attention(query, key, value, self.plan, scale)


def scatter_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ScatterPlan,
                      scale: float | None = None) -> torch.Tensor:
    """Attention ``[1, Hq, n, D]`` of ``query`` (at ``plan.positions``) over ``key``/``value``
    ``[1, H, >= plan.keys, D]`` (``H`` the query heads or the KV heads), causal by position.
    """
    if query.shape[2] != plan.positions.numel():
        raise ValueError(f"{query.shape[2]} queries but the plan holds {plan.positions.numel()} positions")
    key, value = key[:, :, : plan.keys], value[:, :, : plan.keys]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _flex(query.device.type)(query, key, value, block_mask=plan.block_mask, scale=scale,
                                    enable_gqa=key.shape[1] != query.shape[1])


@functools.cache
def _flex(device_type: str) -> Any:
    """FlexAttention, compiled on CUDA (elsewhere its unfused reference, which the tests use)."""
    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


@functools.cache
def flex_works(device: torch.device) -> bool:
    """Whether compiled FlexAttention runs on ``device`` and agrees with SDPA (checked once: a tiny
    call, which also compiles the kernel). False, with a warning, where Triton is missing or fails.
    """
    if not HAS_TRITON or flex_attention is None:
        log.warning("FlexAttention needs triton; scattered selections run as masked blocks")
        return False
    try:
        positions = torch.tensor([3, 40, 41, 90, 127], device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, 64, device=device, generator=gen, dtype=torch.bfloat16)
                   for n in (5, 128, 128))
        out = scatter_attention(q, k, v, ScatterPlan.build(positions, 128))
        visible = torch.arange(128, device=device)[None, :] <= positions[:, None]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible)
        error = (out.float() - ref).abs().max().item()
    except Exception as exc:  # noqa: BLE001 (any compiler failure means: do without it)
        log.warning("FlexAttention failed on %s (%s: %s); scattered selections run as masked blocks",
                    device, type(exc).__name__, exc)
        return False
    if not error <= 3e-2:
        log.warning("FlexAttention differs from SDPA by %.3g on %s; scattered selections run as masked blocks",
                    error, device)
        return False
    return True
