"""Exactness and behaviour of the fusion layer loop on tiny random models of every family."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ARCHS, reference_generate, tiny_model

from kvrag.config import FuseConfig
from kvrag.fusion import FixedSelector, FusionInput, fuse, make_selector
from kvrag.fusion.selectors import ProbeSelector
from kvrag.indexing.kvgen import chunk_caches, prefix_cache
from kvrag.model import families, hf_compat
from kvrag.model.loading import apply_rope, rope_at, unapply_rope, wrap_model

CHUNK_LENS = (23, 17, 31, 12)


def _setup(arch: str, seed: int = 0, lens=CHUNK_LENS):
    lm = wrap_model(tiny_model(arch), None, arch)
    gen = torch.Generator().manual_seed(seed)
    vocab = lm.spec.vocab_size
    prefix = prefix_cache(lm, torch.randint(3, vocab, (6,), generator=gen).tolist())
    chunks = [torch.randint(3, vocab, (n,), generator=gen) for n in lens]
    kv = dict(chunk_caches(lm, prefix, [c.tolist() for c in chunks], batch_tokens=64))
    suffix = torch.randint(3, vocab, (7,), generator=gen)
    return lm, prefix, chunks, [kv[i] for i in range(len(chunks))], suffix


def _reference_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(ids[None]).logits[0, -1].float()


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    return _setup(request.param)


def test_full_equals_plain_forward(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    result = fuse(lm, FusionInput(prefix, chunks, [None] * len(chunks), suffix), FuseConfig(mode="full"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4
    assert result.n_selected == [ids.numel()] * lm.spec.n_layers


@pytest.mark.parametrize("mode", ["cacheblend", "probe", "full"])
def test_recomputing_every_token_over_stored_caches_equals_full_prefill(setup, mode):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    config = FuseConfig(mode=mode, ratio=1.0)
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4
    # the fused cache equals the cache of a plain forward pass, layer by layer
    with torch.no_grad():
        ref_cache = hf_compat.cache_layers(lm.model(ids[None], use_cache=True).past_key_values)
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(result.cache), ref_cache):
        assert (k - rk).abs().max().item() <= 1e-4
        assert (v - rv).abs().max().item() <= 1e-4


def test_rerotated_stored_keys_equal_keys_computed_at_new_position(setup):
    lm, prefix, chunks, kv, suffix = setup
    # chunk 2 placed right after the prefix: its keys must equal a prefill of [prefix][chunk 2]
    ids = torch.cat([prefix.ids, chunks[2]])
    with torch.no_grad():
        ref = hf_compat.cache_layers(lm.model(ids[None], use_cache=True).past_key_values)
    p, n = prefix.length, chunks[2].numel()
    stored_k = kv[2][0]  # [L, H, n, D] pre-RoPE
    cos, sin = rope_at(lm.model, torch.arange(p, p + n), stored_k)
    moved = apply_rope(stored_k, cos, sin)
    for layer, (rk, _) in enumerate(ref):
        assert (moved[layer] - rk[0, :, p:]).abs().max().item() <= 1e-4


def test_rope_round_trip_any_offset(setup):
    lm = setup[0]
    k = torch.randn(2, lm.spec.n_kv_heads, 9, lm.spec.head_dim)
    for offset in (0, 100, 3000):
        cos, sin = rope_at(lm.model, torch.arange(offset, offset + 9), k)
        assert (unapply_rope(apply_rope(k, cos, sin), cos, sin) - k).abs().max().item() <= 1e-4


def test_reuse_of_a_single_chunk_at_offset_zero_equals_full(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, chunks[0], suffix])
    result = fuse(lm, FusionInput(prefix, chunks[:1], kv[:1], suffix), FuseConfig(mode="reuse"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4
    assert result.n_selected == [suffix.numel()] * lm.spec.n_layers


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.5])
def test_cacheblend_keeps_ratio_of_chunk_tokens_plus_suffix(setup, ratio):
    lm, prefix, chunks, kv, suffix = setup
    config = FuseConfig(mode="cacheblend", ratio=ratio, options={"check_layers": (1, 2)})
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    chunk_tokens = sum(c.numel() for c in chunks)
    after_first = chunk_tokens - chunks[0].numel()
    assert result.n_selected[0] == after_first + suffix.numel()  # every candidate up to check 1
    assert result.n_selected[-1] == math.ceil(ratio * chunk_tokens) + suffix.numel()
    assert result.n_selected == sorted(result.n_selected, reverse=True)  # gradual filtering


def test_attnlink_and_prefix_selection_counts(setup):
    lm, prefix, chunks, kv, suffix = setup
    inp = FusionInput(prefix, chunks, kv, suffix)
    link = fuse(lm, inp, FuseConfig(mode="attnlink", options={"link_tokens": 5}))
    assert link.n_selected[0] == 5 * (len(chunks) - 1) + suffix.numel()
    pre = fuse(lm, inp, FuseConfig(mode="prefix"))
    assert pre.n_selected[0] == sum(c.numel() for c in chunks[1:]) + suffix.numel()


def test_a_fixed_selection_recomputes_exactly_those_positions(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    inp = FusionInput(prefix, chunks, kv, suffix)
    reuse = FusionInput(prefix, chunks, kv, suffix)
    start = prefix.length + chunks[0].numel()
    every = torch.arange(start, ids.numel() - suffix.numel())
    exact = fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(every))
    assert (exact.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4  # the stale rows, all fresh
    picked = torch.tensor([start + 2, start + 9, start + 20])
    some = fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(picked))
    assert some.n_selected == [3 + suffix.numel()] * lm.spec.n_layers
    assert some.selected[:3].tolist() == picked.tolist()
    none = fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(torch.zeros(0, dtype=torch.long)))
    plain = fuse(lm, reuse, FuseConfig(mode="reuse"))
    assert torch.equal(none.logits, plain.logits)
    with pytest.raises(ValueError, match="must lie in"):
        fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(torch.tensor([ids.numel()])))


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy", "tensor", "int32 tensor"])
def test_a_fixed_selection_takes_any_sequence_of_positions(kind):
    import numpy as np

    from kvrag.fusion.inputs import segments

    lm, prefix, chunks, kv, suffix = _setup("llama")
    inp = FusionInput(prefix, chunks, kv, suffix)
    picked = [prefix.length + 30, prefix.length + 2, prefix.length + 41]  # any order
    given = {"list": picked, "tuple": tuple(picked), "numpy": np.array(picked),
             "tensor": torch.tensor(picked), "int32 tensor": torch.tensor(picked, dtype=torch.int32)}[kind]
    selector = FixedSelector(given)
    mask = selector.initial(segments(inp))
    assert mask.dtype == torch.bool
    assert torch.equal(mask.nonzero().squeeze(1)[:3], torch.tensor(sorted(picked)))
    result = fuse(lm, inp, FuseConfig(mode="reuse"), selector)
    reference = fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(torch.tensor(picked)))
    assert torch.equal(result.logits, reference.logits) and torch.equal(result.selected, reference.selected)
    assert FixedSelector([]).initial(segments(inp)).sum() == suffix.numel()  # only the forced tokens


def test_every_registered_mode_builds_its_selector_and_names_are_unique():
    from kvrag.fusion import Selector, available_modes, make_selector, register_selector
    from kvrag.fusion.selectors import ReuseSelector

    for mode in available_modes():
        assert isinstance(make_selector(FuseConfig(mode=mode)), Selector)
    with pytest.raises(ValueError, match="already registered"):
        register_selector("reuse")(type("Other", (ReuseSelector,), {}))
    register_selector("reuse")(ReuseSelector)  # the same class again changes nothing
    with pytest.raises(ValueError, match="identifier"):
        register_selector("cache@blend")
    with pytest.raises(TypeError, match="Selector subclasses"):
        register_selector("not_a_selector")(int)
    assert "not_a_selector" not in available_modes()


def test_missing_chunk_cache_is_recomputed_exactly(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, chunks[0], chunks[1], suffix])
    # chunk 0 exact from its cache, chunk 1 has no cache -> recomputed: reuse is then exact
    result = fuse(lm, FusionInput(prefix, chunks[:2], [kv[0], None], suffix), FuseConfig(mode="reuse"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4


def _deviation(lm, inp, config, ref_cache) -> float:
    result = fuse(lm, inp, config)
    err = 0.0
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(result.cache), ref_cache):
        err += float((k - rk).pow(2).sum() + (v - rv).pow(2).sum())
    return err


def test_kv_deviation_is_each_tokens_change_relative_to_the_fresh_rows_scale():
    from kvrag.fusion.scores import kv_deviation

    fresh_k = torch.ones(1, 2, 3, 4)  # each token's squared K norm: 8
    fresh_v = torch.full((1, 2, 3, 4), 2.0)  # each token's squared V norm: 32
    stored_k, stored_v = fresh_k.clone(), fresh_v.clone()
    stored_k[0, 0, 1, 0] = 3.0  # token 1: squared K change 4, relative 0.5
    stored_v[0, 1, 2] = 0.0  # token 2: squared V change 16, relative 0.5
    stored_v[0, 0, 2, 0] = 4.0  # token 2: another 4, relative 0.125
    dev = kv_deviation((stored_k, stored_v), (fresh_k, fresh_v))
    assert dev.tolist() == pytest.approx([0.0, 0.5, 0.625])


def test_kv_deviation_from_full_shrinks_as_ratio_grows():
    ratios = (0.1, 0.3, 0.6, 1.0)
    totals = [0.0] * len(ratios)
    for seed in range(3):
        lm, prefix, chunks, kv, suffix = _setup("llama", seed=seed)
        ids = torch.cat([prefix.ids, *chunks, suffix])
        with torch.no_grad():
            ref = hf_compat.cache_layers(lm.model(ids[None], use_cache=True).past_key_values)
        inp = FusionInput(prefix, chunks, kv, suffix)
        for i, r in enumerate(ratios):
            totals[i] += _deviation(lm, inp, FuseConfig(mode="cacheblend", ratio=r), ref)
    assert all(a >= b - 1e-9 for a, b in zip(totals, totals[1:])), totals  # (equal up to float rounding at the end)
    assert totals[-1] <= 1e-6 < totals[0]


def test_generation_from_fused_cache_matches_hf_generate(setup):
    from kvrag.config import GenerateConfig
    from kvrag.generation.decode import decode_tokens

    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode="full"))
    ours = list(decode_tokens(lm.model, result.cache, result.logits, result.n_tokens,
                              GenerateConfig(max_new_tokens=6), set()))
    ref = reference_generate(lm, ids[None], max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, ids.numel():].tolist()


def test_the_fused_cache_holds_the_layers_fusion_wrote_not_copies(monkeypatch):
    """`FusionResult.cache` hands transformers the per-layer K/V the layer loop wrote, not copies of them (one
    full-size cache at the end of a fusion, not two); decoding after it concatenates, so they are never written."""
    from kvrag.config import GenerateConfig
    from kvrag.fusion import placement
    from kvrag.generation.decode import decode_tokens

    lm, prefix, chunks, kv, suffix = _setup("llama")
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    prefixed_layers = placement.prefixed_layers

    def keep(*args):
        written.extend(prefixed_layers(*args))
        return written

    monkeypatch.setattr(placement, "prefixed_layers", keep)
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode="cacheblend"))
    held = hf_compat.cache_layers(result.cache)
    assert len(held) == len(written) == lm.spec.n_layers
    assert all(k is wk and v is wv for (k, v), (wk, wv) in zip(held, written))
    before = [(k.clone(), v.clone()) for k, v in written]
    list(decode_tokens(lm.model, result.cache, result.logits, result.n_tokens, GenerateConfig(max_new_tokens=4),
                       set()))
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(written, before))
    assert hf_compat.cache_layers(result.cache)[0][0].shape[2] > result.n_tokens  # the decoded tokens' rows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_suffix_attention_matches_the_models_attention_weights(arch):
    from kvrag.fusion.inputs import segments
    from kvrag.fusion.scores import question_attention, suffix_attention

    lm, prefix, chunks, kv, suffix = _setup(arch)
    lm.model.config._attn_implementation = "eager"
    ids = torch.cat([prefix.ids, *chunks, suffix])
    with torch.no_grad():
        out = lm.model(ids[None], use_cache=True, output_attentions=True, output_hidden_states=True)
    lm.model.config._attn_implementation = "sdpa"
    seg = segments(FusionInput(prefix, chunks, kv, suffix))
    layers = hf_compat.cache_layers(out.past_key_values)
    sel = torch.arange(ids.numel())
    for idx in (0, 2):
        scatter = hf_compat.ScatterLayer(*layers[idx])
        rope = families.position_embeddings(lm.model, out.hidden_states[idx], sel)
        with torch.no_grad():
            ours = suffix_attention(lm, idx, out.hidden_states[idx], sel, scatter, seg, rope)
        ref = out.attentions[idx][0, :, -suffix.numel():].sum(dim=(0, 1))
        assert (ours - ref).abs().max().item() <= 1e-4
        # weighed by each key's value norm in the KV head that serves the query head
        n_s = suffix.numel()
        with torch.no_grad():
            weighed = question_attention(lm, idx, out.hidden_states[idx][:, -n_s:], sel[-n_s:],
                                         (rope[0][:, -n_s:], rope[1][:, -n_s:]), sel, scatter, weigh_values=True)
        norms = layers[idx][1][0].norm(dim=-1)  # [H_kv, N]
        heads = out.attentions[idx].shape[1]
        kv_head = torch.arange(heads) // (heads // norms.shape[0])
        ref = (out.attentions[idx][0, :, -n_s:] * norms[kv_head][:, None]).sum(dim=(0, 1))
        assert (weighed - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("config", [FuseConfig(mode="cacheblend", ratio=0.3), FuseConfig(mode="probe", ratio=0.3),
                                    FuseConfig(mode="attnlink", options={"link_tokens": 5}), FuseConfig(mode="prefix")])
def test_selected_tokens_run_in_causal_blocks_exactly(monkeypatch, arch, config):
    """Blocks of selected tokens that attend only up to their last position change nothing."""
    from kvrag.fusion import attention as attn

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=5)
    monkeypatch.setattr(attn, "ATTENTION_BLOCKS", 1)
    one = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    monkeypatch.setattr(attn, "ATTENTION_BLOCKS", 4)
    monkeypatch.setattr(attn, "MIN_BLOCK_TOKENS", 4)
    assert len(attn.layer_blocks(lm, one.selected, one.n_tokens, torch.float32, None, False)) == 4
    blocked = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    assert (blocked.logits - one.logits).abs().max().item() <= 1e-4
    assert torch.equal(blocked.selected, one.selected)
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(blocked.cache), hf_compat.cache_layers(one.cache)):
        assert (k - rk).abs().max().item() <= 1e-4 and (v - rv).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("config", [FuseConfig(mode="cacheblend", ratio=0.3), FuseConfig(mode="prefix")])
def test_a_selection_of_the_last_positions_runs_under_a_lower_right_causal_bias_exactly(monkeypatch, arch, config):
    """The bias SDPA applies by itself gives what the explicit masks give (the CUDA path, run here on the CPU)."""
    from torch.nn.attention.bias import CausalBias, causal_lower_right

    from kvrag.fusion import attention as attn

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=6)
    masked = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    monkeypatch.setattr(attn, "LOWER_RIGHT_DEVICES", {"cuda", "cpu"})
    tail = torch.arange(prefix.length + len(chunks[0]), masked.n_tokens)
    (blk,) = attn.layer_blocks(lm, tail, masked.n_tokens, torch.float32, None, True)
    assert isinstance(blk[2], CausalBias) and blk[1] == masked.n_tokens
    assert isinstance(attn.layer_blocks(lm, tail[1:], masked.n_tokens, torch.float32, None, True)[0][2], CausalBias)
    assert not isinstance(attn.layer_blocks(lm, tail[:-1], masked.n_tokens, torch.float32, None, True)[0][2],
                          CausalBias)  # not ending at the last position
    made = []
    monkeypatch.setattr(attn, "causal_lower_right", lambda *size: made.append(size) or causal_lower_right(*size))
    biased = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    assert made  # fusion took the biased path
    assert (biased.logits - masked.logits).abs().max().item() <= 1e-4
    assert biased.n_selected == masked.n_selected
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(biased.cache), hf_compat.cache_layers(masked.cache)):
        assert (k - rk).abs().max().item() <= 1e-4 and (v - rv).abs().max().item() <= 1e-4


def test_blocks_with_every_token_selected_equal_full_prefill_under_a_sliding_window(monkeypatch):
    import transformers as tf
    from conftest import _COMMON

    from kvrag.fusion import attention as attn

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=300, sliding_window=16, **_COMMON)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    lm = wrap_model(model, None, "mistral-window")
    gen = torch.Generator().manual_seed(1)
    prefix = prefix_cache(lm, torch.randint(3, 300, (6,), generator=gen).tolist())
    chunks = [torch.randint(3, 300, (n,), generator=gen) for n in (20, 25)]
    suffix = torch.randint(3, 300, (7,), generator=gen)
    monkeypatch.setattr(attn, "MIN_BLOCK_TOKENS", 4)
    result = fuse(lm, FusionInput(prefix, chunks, [None, None], suffix), FuseConfig(mode="full"))
    ids = torch.cat([prefix.ids, *chunks, suffix])
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("ratio", "probe_to"), [(0.1, 1.0), (0.4, 1.0), (0.4, 0.75)])
def test_probe_recomputes_the_chunk_tokens_the_question_attends_to_most(ratio, probe_to):
    """The probe's choice equals a ranking by the model's own attention weights: the question run
    with eager attention over the ``reuse`` cache, summed over the upper half of the layers (below
    ``probe_to``'s layer, where the probe pass stops). The selector keeps that reading (``attention``)
    and its choice (``picked``)."""
    lm, prefix, chunks, kv, suffix = _setup("llama", seed=2)
    inp = FusionInput(prefix, chunks, kv, suffix)
    config = FuseConfig(mode="probe", ratio=ratio, options={"probe_from": 0.5, "probe_to": probe_to})
    selector = ProbeSelector(config)
    result = fuse(lm, inp, config, selector)
    total = prefix.length + sum(c.numel() for c in chunks)
    reused = fuse(lm, inp, FuseConfig(mode="reuse")).cache
    hf_compat.crop_cache(reused, total)
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = lm.model(suffix[None], position_ids=torch.arange(total, total + suffix.numel())[None],
                           past_key_values=reused, use_cache=True, output_attentions=True)
    finally:
        lm.model.config._attn_implementation = "sdpa"
    stop = math.ceil(probe_to * lm.spec.n_layers)
    upper = range(lm.spec.n_layers // 2, stop)
    attention = sum(out.attentions[i][0].sum(dim=(0, 1)) for i in upper)  # [N]
    first = prefix.length + chunks[0].numel()
    n_chunk = sum(c.numel() for c in chunks)
    keep = math.ceil(ratio * n_chunk)
    expected = (attention[first:total].topk(keep).indices + first).sort().values
    chosen = result.selected[result.selected < total]
    assert torch.equal(chosen, expected)
    assert torch.equal(selector.picked.sort().values, expected)
    assert selector.attention is not None
    torch.testing.assert_close(selector.attention[first:total], attention[first:total].float(), rtol=1e-4, atol=1e-6)
    # the question runs twice (probe, then with the chosen tokens) through the probe's layers, once above
    n_layers = lm.spec.n_layers
    assert result.n_selected == [keep + 2 * suffix.numel()] * stop + [keep + suffix.numel()] * (n_layers - stop)
    assert (result.probe_logits is None) == (stop < n_layers)
    fixed = fuse(lm, inp, FuseConfig(mode="reuse"), FixedSelector(selector.picked))
    assert torch.equal(fixed.logits, result.logits)  # the main pass over the chosen tokens, whatever the probe ran


def test_probe_recomputes_a_chunk_without_cache_whole():
    lm, prefix, chunks, kv, suffix = _setup("qwen2", seed=3)
    kv = [kv[0], None, kv[2], kv[3]]
    result = fuse(lm, FusionInput(prefix, chunks, kv, suffix), FuseConfig(mode="probe", ratio=0.2))
    start = prefix.length + chunks[0].numel()
    missing = torch.arange(start, start + chunks[1].numel())
    assert torch.isin(missing, result.selected).all()
    candidates = sum(c.numel() for c in chunks)
    assert result.selected.numel() == missing.numel() + math.ceil(0.2 * candidates) + suffix.numel()


def test_probe_with_one_chunk_runs_like_reuse_and_is_exact(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, chunks[0], suffix])
    result = fuse(lm, FusionInput(prefix, chunks[:1], kv[:1], suffix), FuseConfig(mode="probe"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4
    assert result.selected.tolist() == list(range(ids.numel() - suffix.numel(), ids.numel()))
    assert result.n_selected == [suffix.numel()] * lm.spec.n_layers  # nothing to choose: no probe pass


@pytest.mark.parametrize("probe_from", [-0.1, 1.0])
def test_probe_from_outside_its_range_is_a_clear_error(probe_from):
    with pytest.raises(ValueError, match=r"probe_from must be in \[0, 1\)"):
        make_selector(FuseConfig(mode="probe", options={"probe_from": probe_from}))


@pytest.mark.parametrize("probe_to", [0.33, 0.2, 1.5])
def test_probe_to_at_or_below_probe_from_or_above_one_is_a_clear_error(probe_to):
    with pytest.raises(ValueError, match=r"probe_to must be in \(probe_from, 1\]"):
        make_selector(FuseConfig(mode="probe", options={"probe_to": probe_to}))


def test_a_probe_reads_at_least_one_layer():
    selector = make_selector(FuseConfig(mode="probe", options={"probe_from": 0.5, "probe_to": 0.51}))
    assert selector.probe_until(4) == 3 and selector.probe_until(30) == 16


def test_probe_without_any_stored_cache_recomputes_once(setup):
    lm, prefix, chunks, kv, suffix = setup
    ids = torch.cat([prefix.ids, *chunks, suffix])
    result = fuse(lm, FusionInput(prefix, chunks, [None] * len(chunks), suffix), FuseConfig(mode="probe"))
    assert (result.logits - _reference_logits(lm, ids)).abs().max().item() <= 1e-4
    assert result.n_selected == [ids.numel() - prefix.length] * lm.spec.n_layers


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", [FuseConfig(mode="cacheblend", ratio=0.3), FuseConfig(mode="probe", ratio=0.3),
                                    FuseConfig(mode="attnlink", options={"link_tokens": 5})])
def test_a_scattered_selection_runs_in_one_call_per_layer_exactly(monkeypatch, arch, config):
    """`FuseConfig.attention` ``flex`` (one decoder call per layer under a `ScatterBias`; here the
    unfused FlexAttention the CPU runs) gives what the masked blocks give."""
    import dataclasses

    from kvrag.fusion import attention as attn
    from kvrag.fusion.scatter_attention import ScatterBias

    lm, prefix, chunks, kv, suffix = _setup(arch, seed=7)
    blocks = fuse(lm, FusionInput(prefix, chunks, kv, suffix), dataclasses.replace(config, attention="blocks"))
    biases = []
    real = attn.layer_blocks

    def spy(*args):
        out = real(*args)
        biases.extend(b[2] for b in out if isinstance(b[2], ScatterBias))
        return out

    monkeypatch.setattr(attn, "layer_blocks", spy)
    scattered = fuse(lm, FusionInput(prefix, chunks, kv, suffix), dataclasses.replace(config, attention="flex"))
    assert biases
    assert (scattered.logits - blocks.logits).abs().max().item() <= 1e-4
    assert torch.equal(scattered.selected, blocks.selected) and scattered.n_selected == blocks.n_selected
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(scattered.cache), hf_compat.cache_layers(blocks.cache)):
        assert (k - rk).abs().max().item() <= 1e-4 and (v - rv).abs().max().item() <= 1e-4


def test_attention_kernel_choice_and_when_a_selection_runs_under_flex_attention():
    from kvrag.fusion import attention as attn

    assert attn.attention_kernel("auto", torch.device("cpu")) is None  # masked blocks on the CPU
    assert attn.attention_kernel("blocks", torch.device("cpu")) is None
    assert attn.attention_kernel("flex", torch.device("cpu")) == 0
    lm = wrap_model(tiny_model("llama"), None, "llama")
    sel = torch.tensor([3, 9, 20, 40])
    (only,) = attn.layer_blocks(lm, sel, 45, torch.float32, None, True, 41)
    assert type(only[2]).__name__ == "ScatterBias" and only[1] == 41
    short = attn.layer_blocks(lm, sel, 45, torch.float32, None, True, 42)  # attends to fewer keys than that
    windowed = attn.layer_blocks(lm, sel, 45, torch.float32, 16, True, 0)  # the window hides keys: masks
    assert all(type(b[2]).__name__ != "ScatterBias" for b in short + windowed)


def test_fuse_config_rejects_an_unknown_attention_kernel():
    with pytest.raises(ValueError, match="attention"):
        FuseConfig(attention="dense")


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_keys_values_are_the_rows_the_decoder_layer_writes(arch):
    lm, prefix, chunks, kv, suffix = _setup(arch, seed=7)
    ids = torch.cat([prefix.ids, *chunks, suffix])
    with torch.no_grad():
        out = lm.model(ids[None], use_cache=True, output_hidden_states=True)
        ref = hf_compat.cache_layers(out.past_key_values)
        rows = torch.tensor([0, 5, 17, ids.numel() - 1])
        for idx in range(lm.spec.n_layers):
            hidden = out.hidden_states[idx][:, rows]
            keys, values = families.layer_keys_values(
                lm.model, idx, hidden, families.position_embeddings(lm.model, hidden, rows))
            assert keys.shape == values.shape == (1, lm.spec.n_kv_heads, rows.numel(), lm.spec.head_dim)
            assert (keys - ref[idx][0][:, :, rows]).abs().max().item() <= 1e-5
            assert (values - ref[idx][1][:, :, rows]).abs().max().item() <= 1e-5


def _narrowed_after_each_check(lm, inp: FusionInput, config: FuseConfig):
    """CacheBlend's loop as first written: a check layer runs on every selected token, and only the
    layers after it run on the kept ones. Logits and per-layer K/V."""
    from kvrag.fusion.attention import layer_blocks
    from kvrag.fusion.inputs import segments
    from kvrag.fusion.placement import open_feed, place_layer, prefixed_layers
    from kvrag.fusion.scores import token_scores
    from kvrag.fusion.selectors import make_selector

    seg, selector = segments(inp), make_selector(config)
    ids = torch.cat([inp.prefix.ids, *inp.chunk_ids, inp.suffix_ids])
    cache = hf_compat.ScatterCache(prefixed_layers(lm, inp, seg))
    feed = open_feed(lm, inp, seg, torch.float32)
    cos, sin = rope_at(lm.model, torch.arange(seg.prefix_len, seg.suffix_start), cache.layer(0).full()[0])
    sel = selector.initial(seg).nonzero().squeeze(1)
    hidden = hf_compat.embed_tokens(lm.model, ids[sel])[None]
    with torch.no_grad():
        for idx in range(lm.spec.n_layers):
            layer = cache.layer(idx)
            place_layer(layer, feed.layer(idx), seg, cos, sin)
            stored = tuple(t[:, :, sel].clone() for t in layer.full()[:2])
            layer.rows = sel
            ((_, _, mask, rope),) = layer_blocks(lm, sel, seg.total, torch.float32, None, False, 0)
            out = hf_compat.run_decoder_layer(lm.model, idx, hidden, mask, sel, rope, cache)
            if selector.checks(idx):
                fresh = tuple(t[:, :, sel] for t in layer.full()[:2])
                scores = token_scores(lm, selector.check_score, idx, hidden, sel, layer, seg, stored, fresh, rope)
                keep = selector.narrow(idx, sel, scores, seg)
                sel, out = sel[keep], out[:, keep]
            hidden = out
        logits = hf_compat.final_logits(lm.model, hidden[:, -1:])[0, -1]
    return logits, [layer.full()[:2] for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("score", ["kv", "attention", "kv_attention"])
def test_cacheblend_narrowing_before_a_check_layers_body_changes_no_result(arch, score):
    """A check layer's attention and MLP run on the kept tokens alone; the dropped ones keep the fresh K/V
    rows their projections give, so the result is that of running the layer on all of them first."""
    lm, prefix, chunks, kv, suffix = _setup(arch, seed=8)
    inp = FusionInput(prefix, chunks, kv, suffix)
    config = FuseConfig(mode="cacheblend", ratio=0.2, options={"check_layers": (1, 2), "score": score})
    result = fuse(lm, inp, config)
    logits, layers = _narrowed_after_each_check(lm, inp, config)
    assert (result.logits - logits).abs().max().item() <= 1e-4
    for (k, v), (rk, rv) in zip(hf_compat.cache_layers(result.cache), layers):
        assert (k - rk).abs().max().item() <= 1e-4 and (v - rv).abs().max().item() <= 1e-4
    chunk_tokens = sum(c.numel() for c in chunks)
    first = math.ceil(min(1.0, 0.2 * config.options.get("first_ratio_scale", 2.0)) * chunk_tokens - 1e-9)
    # layer 0 runs every candidate; check layer 1's body already runs on the first cut only
    assert result.n_selected[:3] == [chunk_tokens - chunks[0].numel() + suffix.numel(),
                                     first + suffix.numel(), math.ceil(0.2 * chunk_tokens) + suffix.numel()]


def test_a_mode_owns_its_options():
    with pytest.raises(ValueError, match=r"'cacheblend' takes no option 'link_tokens' \(its options: check_layers, "
                                         r"first_ratio_scale, score\)"):
        make_selector(FuseConfig(mode="cacheblend", options={"link_tokens": 4}))
    with pytest.raises(ValueError, match=r"'reuse' takes no option 'x' \(its options: none\)"):
        make_selector(FuseConfig(mode="reuse", options={"x": 1}))
    with pytest.raises(ValueError, match="link_tokens must be an int >= 0"):
        make_selector(FuseConfig(mode="attnlink", options={"link_tokens": -1}))
    assert make_selector(FuseConfig(mode="attnlink", options={"link_tokens": 7})).link_tokens == 7
    config = FuseConfig(mode="attnlink").with_options(link_tokens=7)
    assert config == FuseConfig(mode="attnlink", options={"link_tokens": 7})
    assert hash(config) == hash(FuseConfig("attnlink"))  # hashable: the options are left out of the hash
    with pytest.raises(TypeError):
        config.options["link_tokens"] = 8  # type: ignore[index]  # a config stays frozen
