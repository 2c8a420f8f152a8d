"""Model checks: RoPE self-check refusals, fingerprints, spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_config, tiny_model

from kvrag.errors import UnsupportedModelError
from kvrag.model.loading import _gguf_cache_dir, check_rope, model_fingerprint, wrap_model


def test_dynamic_ntk_rope_is_refused():
    from transformers import LlamaForCausalLM

    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = LlamaForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        check_rope(model)


def test_sequence_dependent_rotary_is_caught_numerically():
    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    original = rotary.forward

    def rescaled(x, position_ids):  # like dynamic NTK without saying so in the config
        cos, sin = original(x, position_ids)
        squeeze = 0.5 if position_ids.max() > 4096 else 1.0
        return cos * squeeze, sin * squeeze

    rotary.forward = rescaled
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        check_rope(model)


def test_attention_that_ignores_the_rotary_module_is_caught():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    original = attn.forward

    def no_rope(hidden_states, position_embeddings, **kwargs):  # keys never rotated
        cos, sin = position_embeddings
        return original(hidden_states, (torch.ones_like(cos), torch.zeros_like(sin)), **kwargs)

    attn.forward = no_rope
    with pytest.raises(UnsupportedModelError, match="re-rotated keys"):
        check_rope(model)


def test_fingerprint_depends_on_weights_and_dtype():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    fa, fb = wrap_model(a, None).fingerprint, wrap_model(b, None).fingerprint
    assert fa != fb
    assert wrap_model(tiny_model("llama", seed=0), None).fingerprint == fa
    half = wrap_model(tiny_model("llama", seed=0).to(torch.bfloat16), None)
    assert half.fingerprint != fa
    assert model_fingerprint(a, wrap_model(a, None).spec) == fa


def test_spec_reports_kv_shape():
    lm = wrap_model(tiny_model("qwen3"), None)
    assert (lm.spec.n_layers, lm.spec.n_kv_heads, lm.spec.head_dim) == (4, 2, 16)
    assert lm.spec.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4


def test_a_gguf_files_conversion_is_named_by_its_content_not_its_path(tmp_path: Path) -> None:
    data = bytes(range(256)) * 20000  # 5 MB: the two ends sampled are apart
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, content in ((a, data), (b, data), (c, data[:-1] + b"x")):
        path.parent.mkdir()
        path.write_bytes(content)
    assert _gguf_cache_dir(a) == _gguf_cache_dir(b)  # the same file in two environments: one conversion
    assert _gguf_cache_dir(c) != _gguf_cache_dir(a)
