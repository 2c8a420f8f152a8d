"""Decoder layers run from their parts (`kvrag.model.llama_layer`) against the layers' own forward."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, tiny_config, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvrag.config import FuseConfig
from kvrag.fusion import FusionInput, fuse
from kvrag.fusion import attention as attn
from kvrag.fusion.scatter_attention import ScatterBias, ScatterPlan
from kvrag.fusion.tiled_attention import SortedCausalBias
from kvrag.model import families, hf_compat, llama_layer

TOTAL = 96


def _masks(sel: torch.Tensor, kind: str, dtype: torch.dtype):
    """The mask `attn.layer_blocks` would give a block of ``sel`` of each kind."""
    if kind == "causal":
        return None
    if kind == "dense":
        return attn.attention_mask(sel, TOTAL, dtype, None)
    if kind == "lower-right":
        return attn.causal_lower_right(int(sel.numel()), TOTAL)
    if kind == "tiled":
        return SortedCausalBias(sel)
    return ScatterBias(ScatterPlan.build(sel, TOTAL))


def _selection(kind: str, device: str) -> torch.Tensor:
    if kind == "causal":
        return torch.arange(TOTAL, device=device)
    if kind == "lower-right":
        return torch.arange(TOTAL - 9, TOTAL, device=device)
    return torch.tensor([2, 7, 8, 30, 31, 32, 60, 88, 94, 95], device=device)


def _both(model, kind: str, dtype: torch.dtype, device: str, seed: int = 0):
    """Every layer run by `llama_layer.run` and by its own forward on the same inputs; outputs and caches."""
    layers = hf_compat.decoder_layers(model)
    spec = model.config
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_heads = spec.num_key_value_heads
    head_dim = getattr(spec, "head_dim", None) or spec.hidden_size // spec.num_attention_heads
    sel = _selection(kind, device)
    hidden = torch.randn(1, sel.numel(), spec.hidden_size, generator=gen, device=device, dtype=dtype)
    rope = families.position_embeddings(model, hidden, sel)
    results = []
    for plain in (True, False):
        stored = [tuple(torch.randn(1, kv_heads, TOTAL, head_dim, generator=torch.Generator(device=device)
                                    .manual_seed(seed + 1 + i), device=device, dtype=dtype) for _ in "kv")
                  for i in range(len(layers))]
        cache = hf_compat.ScatterCache(stored)
        outs = []
        with torch.no_grad():
            for idx, layer in enumerate(layers):
                assert llama_layer.runs_plain(layer)
                cache.layer(idx).rows = sel
                mask = _masks(sel, kind, dtype)
                if plain:
                    outs.append(llama_layer.run(layer, hidden, mask, rope, cache.layer(idx)))
                else:
                    out = layer(hidden, attention_mask=mask, position_ids=sel[None], past_key_values=cache,
                                use_cache=True, position_embeddings=rope)
                    outs.append(out[0] if isinstance(out, tuple) else out)
        results.append((outs, [cache.layer(i).full()[:2] for i in range(len(layers))]))
    return results


def _largest_difference(a, b) -> float:
    (outs, caches), (ref_outs, ref_caches) = a, b
    diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref_outs)]
    diffs += [(t.float() - r.float()).abs().max().item()
              for pair, ref in zip(caches, ref_caches) for t, r in zip(pair, ref)]
    return max(diffs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["causal", "dense", "lower-right", "scatter", "tiled"])
def test_every_layer_from_its_parts_gives_what_its_own_forward_gives(arch, kind):
    plain, own = _both(tiny_model(arch), kind, torch.float32, "cpu")
    assert _largest_difference(plain, own) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("kind", ["causal", "dense", "lower-right", "scatter"])
def test_on_cuda_in_bfloat16_every_layer_agrees_with_its_own_forward(arch, kind):
    model = tiny_model(arch).to("cuda", torch.bfloat16)
    plain, own = _both(model, kind, torch.bfloat16, "cuda")
    assert _largest_difference(plain, own) <= 0.05  # a few bf16 roundings of values of order 1


@pytest.mark.parametrize("partial", [False, True])
def test_rotation_equals_the_models_rotary_embedding(partial):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 9, 16, generator=gen)
    angles = torch.randn(1, 9, 4 if partial else 8, generator=gen)
    rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())  # [1, 9, R]
    got = llama_layer.Rope(rope, torch.float32).rotate(x)
    assert (got - hf_compat.apply_rope(x, *rope)).abs().max().item() <= 1e-6


def test_rms_norm_equals_the_models_norm():
    layer = hf_compat.decoder_layers(tiny_model("llama"))[0]
    with torch.no_grad():
        layer.input_layernorm.weight.normal_()
        x = torch.randn(2, 5, layer.input_layernorm.weight.numel())
        assert (llama_layer.rms_norm(layer.input_layernorm, x) - layer.input_layernorm(x)).abs().max() <= 1e-6


@pytest.mark.parametrize("change", [dict(hidden_act="gelu"), dict(attn="eager"), dict(hooked=True)])
def test_layers_that_are_not_plain_run_their_own_forward(change):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    if "hidden_act" in change:
        config.hidden_act = change["hidden_act"]
    model = AutoModelForCausalLM.from_config(config, attn_implementation=change.get("attn", "sdpa"))
    layers = hf_compat.decoder_layers(model)
    if change.get("hooked"):  # as accelerate marks the modules of a device map
        for layer in layers:
            layer.mlp.down_proj._hf_hook = object()
    assert not any(llama_layer.runs_plain(layer) for layer in layers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", [FuseConfig(mode="cacheblend", ratio=0.3), FuseConfig(mode="probe", ratio=0.3)])
def test_fusion_runs_every_layer_from_its_parts_with_the_same_result(monkeypatch, arch, config):
    from test_fuse import _setup

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=7)
    calls = []
    run = llama_layer.run
    monkeypatch.setattr(llama_layer, "run", lambda layer, *a: calls.append(id(layer)) or run(layer, *a))
    fast = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    assert len(set(calls)) == lm.spec.n_layers
    assert not llama_layer._latest.ropes  # the rotations it kept are dropped when it ends
    monkeypatch.setattr(llama_layer, "runs_plain", lambda layer: False)
    reference = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    assert torch.equal(fast.selected, reference.selected)
    assert (fast.logits - reference.logits).abs().max().item() <= 1e-5
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(fast.cache), hf_compat.cache_layers(reference.cache)):
        assert (k - rk).abs().max().item() <= 1e-5 and (v - rv).abs().max().item() <= 1e-5


class _Created(TorchDispatchMode):
    """Records the element count of every tensor whose memory an operator allocates: not views of its inputs, and
    nothing for operators that write into a tensor they were given (``silu_``, ``mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.numels += [t.numel() for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given]
        return out


def test_a_layer_allocates_two_intermediate_tensors_of_its_mlp_not_four():
    """The gated MLP runs its activation and its product in place: of its ``[1, n, intermediate]`` tensors only the
    gate's and the up projection's outputs are allocated (a long prefill's largest tensors), and the layer's output
    is its own forward's."""
    model = tiny_model("llama")
    layer, spec = hf_compat.decoder_layers(model)[0], model.config
    n, head_dim = TOTAL, spec.hidden_size // spec.num_attention_heads
    sel = torch.arange(n)
    hidden = torch.randn(1, n, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    rope = families.position_embeddings(model, hidden, sel)
    outs = []
    for plain in (True, False):
        cache = hf_compat.ScatterCache([tuple(torch.zeros(1, spec.num_key_value_heads, n, head_dim) for _ in "kv")])
        cache.layer(0).rows = sel
        with torch.no_grad(), _Created() as created:
            if plain:
                outs.append(llama_layer.run(layer, hidden, None, rope, cache.layer(0)))
            else:
                outs.append(layer(hidden, attention_mask=None, position_ids=sel[None], past_key_values=cache,
                                  use_cache=True, position_embeddings=rope))
        if plain:
            assert created.numels.count(n * spec.intermediate_size) == 2
    own = outs[1][0] if isinstance(outs[1], tuple) else outs[1]
    assert (outs[0] - own).abs().max().item() <= 1e-5
