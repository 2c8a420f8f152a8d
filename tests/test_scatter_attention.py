"""Attention for scattered queries (`kvrag.fusion.scatter_attention`) against dense masked SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvrag.fusion import scatter_attention as sa

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _case(n_keys: int, n_queries: int, heads: int, kv_heads: int, dim: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.randperm(n_keys - 40, generator=gen)[: n_queries - 8] + 20  # scattered, then a tail
    positions = torch.cat([spread.sort().values, torch.arange(n_keys - 8, n_keys)]).to(device)
    q = torch.randn(1, heads, positions.numel(), dim, generator=gen).to(device, dtype)
    k = torch.randn(1, kv_heads, n_keys, dim, generator=gen).to(device, dtype)
    v = torch.randn(1, kv_heads, n_keys, dim, generator=gen).to(device, dtype)
    return positions, q, k, v


def _dense(positions, q, k, v):
    """The reference: every key for every query, float32, the causal pattern as a boolean mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    visible = torch.arange(k.shape[2], device=k.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=visible[None, None])


def _report(out, ref) -> tuple[float, float]:
    diff = (out.float() - ref).abs()
    print(f"max {diff.max().item():.2e} mean {diff.mean().item():.2e}")
    return diff.max().item(), diff.mean().item()


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_scatter_attention_equals_dense_masked_attention(kv_heads):
    positions, q, k, v = _case(700, 160, 8, kv_heads, 32, torch.float32, "cpu")
    plan = sa.ScatterPlan.build(positions, 700)
    worst, mean = _report(sa.scatter_attention(q, k, v, plan), _dense(positions, q, k, v))
    assert worst <= 1e-5 and mean <= 1e-6


def test_a_scatter_bias_given_to_sdpa_runs_the_plan():
    positions, q, k, v = _case(300, 48, 4, 4, 16, torch.float32, "cpu", seed=1)
    bias = sa.ScatterBias(sa.ScatterPlan.build(positions, 300))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / math.sqrt(16))
    assert _report(out, _dense(positions, q, k, v))[0] <= 1e-5
    with pytest.raises(ValueError, match="is_causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)


def test_keys_past_the_plan_are_never_read():
    positions, q, k, v = _case(200, 40, 2, 2, 16, torch.float32, "cpu", seed=2)
    plan = sa.ScatterPlan.build(positions, 200)
    poisoned_k = torch.cat([k, torch.full_like(k[:, :, :5], float("nan"))], dim=2)
    poisoned_v = torch.cat([v, torch.full_like(v[:, :, :5], float("nan"))], dim=2)
    out = sa.scatter_attention(q, poisoned_k, poisoned_v, plan)
    assert _report(out, _dense(positions, q, k, v))[0] <= 1e-5


def test_scatter_attention_rejects_a_query_count_the_plan_does_not_hold():
    plan = sa.ScatterPlan.build(torch.tensor([1, 4, 9]), 10)
    with pytest.raises(ValueError, match="queries"):
        sa.scatter_attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), plan)


def test_flex_check_fails_softly_without_triton(monkeypatch):
    monkeypatch.setattr(sa, "HAS_TRITON", False)  # as if triton were not installed
    sa.flex_works.cache_clear()
    try:
        assert sa.flex_works(torch.device("cpu")) is False
    finally:
        sa.flex_works.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_scatter_attention_equals_dense_masked_attention(dtype):
    assert sa.flex_works(torch.device("cuda"))
    positions, q, k, v = _case(4096, 900, 32, 8, 128, dtype, "cuda", seed=3)
    plan = sa.ScatterPlan.build(positions, 4096)
    worst, mean = _report(sa.scatter_attention(q, k, v, plan), _dense(positions, q, k, v))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert worst <= tol and mean <= tol / 10
