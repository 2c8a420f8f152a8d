"""Attention for sorted scattered queries in tiles (`kvrag.fusion.tiled_attention`) against dense masked SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHS, tiny_model
from test_scatter_attention import _case, _dense, _report

from kvrag.config import FuseConfig
from kvrag.fusion import FusionInput, fuse
from kvrag.fusion import attention as attn
from kvrag.fusion.tiled_attention import SortedCausalBias, sorted_causal_attention
from kvrag.model import hf_compat
from kvrag.model.loading import wrap_model


@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("tile", [None, 7, 1000])
def test_tiles_equal_dense_masked_attention(kv_heads, tile):
    positions, q, k, v = _case(700, 160, 8, kv_heads, 32, torch.float32, "cpu")
    worst, mean = _report(sorted_causal_attention(q, k, v, positions, tile=tile), _dense(positions, q, k, v))
    assert worst <= 1e-5 and mean <= 1e-6


def test_tiles_in_bfloat16_stay_close_to_float32():
    positions, q, k, v = _case(500, 90, 4, 2, 32, torch.bfloat16, "cpu", seed=3)
    assert _report(sorted_causal_attention(q, k, v, positions, tile=32), _dense(positions, q, k, v))[0] <= 3e-2


def test_every_position_from_the_first_is_a_causal_prefill():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 300, 16, generator=gen) for h in (6, 2, 2))
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (sorted_causal_attention(q, k, v, torch.arange(300), tile=64) - causal).abs().max().item() <= 1e-5


def test_keys_past_the_last_position_are_never_read():
    positions, q, k, v = _case(200, 40, 2, 2, 16, torch.float32, "cpu", seed=2)
    poisoned_k = torch.cat([k, torch.full_like(k[:, :, :5], float("nan"))], dim=2)
    poisoned_v = torch.cat([v, torch.full_like(v[:, :, :5], float("nan"))], dim=2)
    out = sorted_causal_attention(q, poisoned_k, poisoned_v, positions, tile=16)
    assert _report(out, _dense(positions, q, k, v))[0] <= 1e-5


def test_a_sorted_causal_bias_given_to_sdpa_runs_the_tiles():
    positions, q, k, v = _case(300, 48, 4, 4, 16, torch.float32, "cpu", seed=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=SortedCausalBias(positions), scale=1 / math.sqrt(16))
    assert _report(out, _dense(positions, q, k, v))[0] <= 1e-5
    with pytest.raises(ValueError, match="is_causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=SortedCausalBias(positions), is_causal=True)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="positions"):
        sorted_causal_attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8),
                                torch.tensor([1, 4, 9]))
    with pytest.raises(ValueError, match="group"):
        sorted_causal_attention(torch.zeros(1, 3, 3, 8), torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8),
                                torch.tensor([1, 4, 9]))


def test_tiles_are_the_cpu_default_and_blocks_stay_on_request(monkeypatch):
    cpu = torch.device("cpu")
    assert attn.tiles_on("auto", cpu) and attn.tiles_on("tiles", cpu)
    assert not attn.tiles_on("blocks", cpu) and not attn.tiles_on("flex", cpu)
    assert not attn.tiles_on("auto", torch.device("cuda")) and not attn.tiles_on("tiles", torch.device("cuda"))
    lm = wrap_model(tiny_model("llama"), None, "llama")
    sel = torch.tensor([3, 9, 10, 40, 41, 44])
    (only,) = attn.layer_blocks(lm, sel, 45, torch.float32, None, True, tiled=True)
    assert isinstance(only[2], SortedCausalBias) and only[1] == 45 and only[0] == slice(0, 6)
    monkeypatch.setattr(attn, "MIN_BLOCK_TOKENS", 2)
    assert all(type(b[2]) is torch.Tensor for b in attn.layer_blocks(lm, sel, 45, torch.float32, None, True))
    # a kernel that needs a dense mask (eager attention) gets masked blocks even when tiles are on
    eager = attn.layer_blocks(lm, sel, 45, torch.float32, None, False, tiled=True)
    assert all(type(b[2]) is torch.Tensor for b in eager)
    with pytest.raises(ValueError, match="attention"):
        FuseConfig(attention="tile")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plain", [True, False])
def test_fusion_with_tiles_gives_what_masked_blocks_give(monkeypatch, arch, plain):
    from test_fuse import _setup

    from kvrag.model import llama_layer

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=5)
    if not plain:  # the layers' own forward, which hands the stand-in to its SDPA call
        monkeypatch.setattr(llama_layer, "runs_plain", lambda layer: False)
    spy = []
    real = attn.layer_blocks
    monkeypatch.setattr(attn, "layer_blocks", lambda *a, **k: spy.append(real(*a, **k)) or spy[-1])
    monkeypatch.setattr(attn, "MIN_BLOCK_TOKENS", 4)
    tiled = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode="probe", ratio=0.3))
    assert any(isinstance(b[2], SortedCausalBias) for made in spy for b in made)
    spy.clear()
    blocks = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode="probe", ratio=0.3, attention="blocks"))
    assert not any(isinstance(b[2], SortedCausalBias) for made in spy for b in made)
    assert max(len(made) for made in spy) > 1  # the masked blocks it is compared with
    assert torch.equal(tiled.selected, blocks.selected)
    assert (tiled.logits - blocks.logits).abs().max().item() <= 1e-5
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(tiled.cache), hf_compat.cache_layers(blocks.cache)):
        assert (k - rk).abs().max().item() <= 1e-5 and (v - rv).abs().max().item() <= 1e-5


def test_recorded_attention_gives_the_layer_output_and_the_question_reading():
    from kvrag.fusion.recorded_attention import recorded_attention

    positions, q, k, v = _case(400, 30, 8, 2, 16, torch.float32, "cpu", seed=6)
    sink = torch.zeros(400)
    out = recorded_attention(q, k, v, positions, 8, sink)
    assert _report(out, _dense(positions, q, k, v))[0] <= 1e-5
    groups = 4
    weights = (q[:, :, -8:] @ k.repeat_interleave(groups, 1).transpose(-1, -2) / 4).masked_fill(
        torch.arange(400)[None, :] > positions[-8:, None], float("-inf")).softmax(-1)
    assert (sink - weights.sum(dim=(0, 1, 2))).abs().max().item() <= 1e-5
    assert sink.sum().item() == pytest.approx(8 * 8, rel=1e-5)  # each reader's weights sum to one per head


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plain", [True, False])
def test_a_probe_reading_its_attention_in_the_layer_reads_what_it_read_apart(monkeypatch, arch, plain):
    from test_fuse import _setup

    from kvrag.fusion.selectors import ProbeSelector
    from kvrag.model import llama_layer

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=9)
    if not plain:
        monkeypatch.setattr(llama_layer, "runs_plain", lambda layer: False)
    from kvrag.fusion.recorded_attention import RecordingBias

    calls = []
    attend = RecordingBias.attend
    monkeypatch.setattr(RecordingBias, "attend", lambda self, *a: calls.append(1) or attend(self, *a))
    results = []
    for config in (FuseConfig(mode="probe", ratio=0.3), FuseConfig(mode="probe", ratio=0.3, attention="blocks")):
        selector = ProbeSelector(config)
        results.append((fuse(lm, FusionInput(prefix, chunks, kv, suffix), config, selector), selector.attention))
    (together, read), (apart, reference) = results
    reading = lm.spec.n_layers - int(ProbeSelector.Options().probe_from * lm.spec.n_layers)
    assert len(calls) == reading  # the probe's reading layers
    assert read is not None and reference is not None
    assert (read - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
    assert torch.equal(together.selected, apart.selected)
    assert (together.logits - apart.logits).abs().max().item() <= 1e-5
    assert (together.probe_logits - apart.probe_logits).abs().max().item() <= 1e-5
