"""Every model family beyond Llama's on a tiny random model of each: the registry finds it, recomputing every token
through fusion gives transformers' own forward, stored keys move exactly (partial rotary, NoPE layers, several
rotary embeddings), windowed layers see their window, and what cannot be exact is refused in one line."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import ARCHS, FAMILIES, tiny_config, tiny_model
from test_fuse import _reference_logits, _setup

from kvrag.config import FuseConfig
from kvrag.errors import UnsupportedModelError
from kvrag.fusion import FusionInput, fuse
from kvrag.model import hf_compat
from kvrag.model.families import Family, LayerKind, UntestedFamily, family_of, register_family
from kvrag.model.loading import wrap_model
from kvrag.model.rope import layer_ropes, rotate_layers

TOLERANCE = 1e-4  # what the Llama family meets (tests/test_fuse.py)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    return _setup(request.param)


def _reference_cache(lm, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K/V of the plain forward over ``ids``, all rows (windowed layers' too)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = lm.model(ids[None], use_cache=True, **hf_compat.with_cache(lm.model, DynamicCache()))
    return hf_compat.cache_layers(hf_compat.returned_cache(out))


def test_every_family_is_found_by_its_model_type():
    found = {arch: family_of(tiny_config(arch)) for arch in ARCHS + FAMILIES}
    assert all(family.tested and not isinstance(family, UntestedFamily) for family in found.values())
    assert found["gemma2"].attn_implementation() == found["gpt_oss"].attn_implementation() == "eager"
    assert found["llama"].attn_implementation() == found["gemma3"].attn_implementation() == "sdpa"


def test_a_model_type_is_registered_once():
    class Again(Family):
        model_types = ("llama",)

    with pytest.raises(ValueError, match="'llama' is already registered"):
        register_family(Again)


def test_an_unregistered_model_type_runs_as_a_llama_with_a_warning(caplog):
    import transformers as tf

    settings = {k: v for k, v in tiny_config("llama").to_dict().items() if k != "model_type"}
    model = tf.AutoModelForCausalLM.from_config(tf.OlmoConfig(**settings), attn_implementation="sdpa")
    with caplog.at_level(logging.WARNING, logger="kvrag.model.loading"):
        lm = wrap_model(model.eval(), None)
    assert isinstance(lm.family, UntestedFamily) and "'olmo' is untested" in caplog.text


def test_layer_kinds_follow_each_configs_windows_and_rotary_embeddings():
    kinds = {arch: family_of(tiny_config(arch)).kinds for arch in FAMILIES}
    alternating = (LayerKind(16, "default"), LayerKind(None, "default")) * 2
    assert kinds["gemma2"] == kinds["gpt_oss"] == alternating
    assert kinds["gemma3"] == (LayerKind(16, "sliding_attention"), LayerKind(None, "full_attention")) * 2
    assert [kind.rope for kind in kinds["smollm3"]] == ["default", "default", None, "default"]
    assert all(kind == LayerKind(None, "default") for arch in ("granite", "olmo2", "phi3", "mixtral", "qwen3_moe")
               for kind in kinds[arch])


def test_full_equals_the_plain_forward(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])  # 96 tokens: six windows of the windowed families
    result = fuse(lm, FusionInput(prefix, chunks, [None] * len(chunks), suffix), FuseConfig(mode="full"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= TOLERANCE
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(result.cache), _reference_cache(lm, ids)):
        assert (k - rk).abs().max().item() <= TOLERANCE and (v - rv).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("mode", ["cacheblend", "probe"])
def test_recomputing_every_token_over_stored_caches_equals_the_plain_forward(setup, mode):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode=mode, ratio=1.0))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= TOLERANCE


def test_one_stored_chunk_right_after_the_prefix_is_exact_as_it_is(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, chunks[0], suffix])
    result = fuse(lm, FusionInput(prefix, chunks[:1], kv[:1], suffix), FuseConfig(mode="reuse"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= TOLERANCE
    assert result.n_selected == [suffix.numel()] * lm.spec.n_layers


def test_stored_keys_moved_to_a_new_position_equal_keys_computed_there(setup):
    lm, prefix, chunks, kv, suffix = setup
    # chunk 2 was stored after the prefix at positions p..: placed there again, every layer's keys are the forward's
    p, n = prefix.length, chunks[2].numel()
    ropes = layer_ropes(lm.model, lm.family, torch.arange(p, p + n), kv[2][0])
    moved = rotate_layers(kv[2][0], ropes)  # [L, H, n, D]
    for layer, (rk, _) in enumerate(_reference_cache(lm, torch.cat([prefix.ids, chunks[2]]))):
        assert (moved[layer] - rk[0, :, p:]).abs().max().item() <= TOLERANCE, layer
    # 40 positions later: layer 0's keys depend on the token and its position alone
    ids = torch.cat([prefix.ids, torch.full((40,), 7), chunks[2]])
    later = rotate_layers(kv[2][0], layer_ropes(lm.model, lm.family, torch.arange(p + 40, p + 40 + n), kv[2][0]))
    assert (later[0] - _reference_cache(lm, ids)[0][0][0, :, p + 40:]).abs().max().item() <= TOLERANCE


def test_every_layers_keys_move_between_positions_as_its_own_projections_compute_them(setup):
    """Per layer (rotary, partial rotary, NoPE, local or global embedding): keys the layer computes at positions
    ``a``, un-rotated there and rotated to ``b``, equal the keys it computes at ``b``."""
    lm = setup[0]
    hidden = torch.randn(1, 9, lm.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    at_a, at_b = torch.arange(3, 12), torch.arange(700, 709)
    ropes_a, ropes_b = (layer_ropes(lm.model, lm.family, pos, hidden) for pos in (at_a, at_b))
    with torch.no_grad():
        for idx, kind in enumerate(lm.family.kinds):
            keys_a, keys_b = (lm.family.keys_values(lm.model, idx, hidden, lm.family.rope(lm.model, kind.rope,
                                                                                           hidden, pos[None]))[0]
                              for pos in (at_a, at_b))
            stored = rotate_layers(keys_a[0][None], [ropes_a[idx]], inverse=True)  # one layer: [1, H, n, D]
            moved = rotate_layers(stored, [ropes_b[idx]])
            assert (moved[0] - keys_b[0]).abs().max().item() <= 1e-5, idx
            if kind.rope is None:  # a NoPE layer's keys carry no position
                assert torch.equal(stored[0], keys_a[0])


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_layers_projections_are_the_rows_the_decoder_layer_writes(arch):
    lm, prefix, chunks, kv, suffix = _setup(arch, seed=7)
    ids = torch.cat([prefix.ids, *chunks, suffix])
    with torch.no_grad():
        out = lm.model(ids[None], output_hidden_states=True)
        ref = _reference_cache(lm, ids)
        rows = torch.tensor([0, 5, 17, ids.numel() - 1])
        for idx, kind in enumerate(lm.family.kinds):
            hidden = out.hidden_states[idx][:, rows]
            keys, values = lm.family.keys_values(lm.model, idx, hidden,
                                                 lm.family.rope(lm.model, kind.rope, hidden, rows[None]))
            assert keys.shape == values.shape == (1, lm.spec.n_kv_heads, rows.numel(), lm.spec.head_dim)
            assert (keys - ref[idx][0][:, :, rows]).abs().max().item() <= 1e-5
            assert (values - ref[idx][1][:, :, rows]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_a_windowed_layer_attends_only_to_its_window(arch):
    """Changing a token far outside every window leaves the windowed layers' rows after it alone, and the
    fusion of the changed prompt still equals the plain forward."""
    lm, prefix, chunks, kv, suffix = _setup(arch)
    ids = torch.cat([prefix.ids, *chunks, suffix])
    changed = ids.clone()
    changed[8] = (changed[8] + 1) % lm.spec.vocab_size
    first_layer = _reference_cache(lm, ids)[0], _reference_cache(lm, changed)[0]
    assert lm.family.kinds[0].window == 16
    assert torch.equal(first_layer[0][0][:, :, 8 + 16:], first_layer[1][0][:, :, 8 + 16:])  # layer 0: windowed
    assert not torch.equal(first_layer[0][0][:, :, 8], first_layer[1][0][:, :, 8])
    result = fuse(lm, FusionInput(prefix, chunks, [None] * len(chunks), suffix), FuseConfig(mode="full"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= TOLERANCE


def _phi3_longrope(max_positions: int):
    import transformers as tf

    config = tiny_config("phi3")
    factors = [1.0 + i / 8 for i in range(4)]  # one per rotary frequency: head 16, half of it rotary
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors,
                              "long_factor": [2 * f for f in factors], "original_max_position_embeddings": 256,
                              "partial_rotary_factor": 0.5}
    config.original_max_position_embeddings = 256
    config.max_position_embeddings = max_positions
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_longrope_is_fused_within_its_original_context_and_refused_past_it():
    from kvrag.indexing.kvgen import chunk_caches, prefix_cache

    lm = wrap_model(_phi3_longrope(256), None)
    gen = torch.Generator().manual_seed(0)
    prefix = prefix_cache(lm, torch.randint(3, lm.spec.vocab_size, (6,), generator=gen).tolist())
    chunks = [torch.randint(3, lm.spec.vocab_size, (n,), generator=gen) for n in (23, 17)]
    kv = dict(chunk_caches(lm, prefix, [c.tolist() for c in chunks]))
    suffix = torch.randint(3, lm.spec.vocab_size, (7,), generator=gen)
    result = fuse(lm, FusionInput(prefix, chunks, [kv[0], kv[1]], suffix), FuseConfig(mode="cacheblend", ratio=1.0))
    ids = torch.cat([prefix.ids, *chunks, suffix])
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= TOLERANCE
    with pytest.raises(UnsupportedModelError, match="longrope.*max_position_embeddings=256") as refused:
        wrap_model(_phi3_longrope(4096), None)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("change", ["softcap under sdpa", "bidirectional", "dynamic"])
def test_what_cannot_be_exact_is_refused_in_one_line(change):
    import transformers as tf

    config = tiny_config("gemma3")
    if change == "softcap under sdpa":
        config.attn_logit_softcapping = 50.0
    elif change == "bidirectional":
        config.use_bidirectional_attention = True
    else:
        config = tiny_config("olmo2")
        config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(UnsupportedModelError, match={"softcap under sdpa": "eager", "bidirectional": "both ways",
                                                     "dynamic": "dynamic"}[change]) as refused:
        wrap_model(model, None)
    assert "\n" not in str(refused.value)


def test_the_tiny_models_load_with_the_attention_their_family_needs():
    assert tiny_model("gemma2").config._attn_implementation == "eager"
    assert tiny_model("smollm3").config._attn_implementation == "sdpa"


def test_contributings_worked_family_is_granites_module():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    guide = (root / "CONTRIBUTING.md").read_text()
    section = guide[guide.index("## Adding a model family"):]
    shown = section[section.index("```python\n") + len("```python\n"):section.index("```\n\nImport")]
    module = (root / "kvrag" / "model" / "families" / "granite.py").read_text()
    assert shown == module[module.index("from __future__"):]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_questions_attention_that_ranks_tokens_is_the_layers_own(arch):
    """Scale, soft-cap, sinks and windows as the layer applies them: the weights equal transformers' eager ones."""
    from kvrag.fusion.inputs import segments
    from kvrag.fusion.scores import suffix_attention

    lm, prefix, chunks, kv, suffix = _setup(arch)
    ids = torch.cat([prefix.ids, *chunks, suffix])
    implementation = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "eager"  # the implementation that returns its weights
    try:
        from transformers import DynamicCache

        with torch.no_grad():
            out = lm.model(ids[None], output_attentions=True, output_hidden_states=True,
                           **hf_compat.with_cache(lm.model, DynamicCache()))
    finally:
        lm.model.config._attn_implementation = implementation
    seg = segments(FusionInput(prefix, chunks, kv, suffix))
    layers = hf_compat.cache_layers(hf_compat.returned_cache(out))
    sel = torch.arange(ids.numel())
    for idx, kind in enumerate(lm.family.kinds):
        hidden = out.hidden_states[idx]
        with torch.no_grad():
            ours = suffix_attention(lm, idx, hidden, sel, hf_compat.ScatterLayer(*layers[idx]), seg,
                                    lm.family.rope(lm.model, kind.rope, hidden, sel[None]))
        reference = out.attentions[idx][0, :, -suffix.numel():].sum(dim=(0, 1))
        assert (ours - reference).abs().max().item() <= 1e-4, idx
