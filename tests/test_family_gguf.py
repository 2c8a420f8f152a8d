""".gguf loading for the families whose GGUF files transformers reads: a tiny model written as llama.cpp lays it out
(F32 tensors under llama.cpp's names, SmolLM2's tokenizer), loaded through `load_model`, is the same model in the
same family, and fuses exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer, tiny_config

from kvrag.config import FuseConfig
from kvrag.fusion import FusionInput, fuse
from kvrag.indexing.kvgen import prefix_cache
from kvrag.model.loading import load_model

gguf = pytest.importorskip("gguf")


def _source(arch: str):
    """A tiny model of ``arch`` with only the settings its GGUF metadata carries changed from the defaults."""
    import transformers as tf

    if arch == "phi3":
        config = tf.Phi3Config(**{k: v for k, v in tiny_config("phi3").to_dict().items()
                                  if k not in ("model_type", "partial_rotary_factor", "rope_parameters")})
    else:  # gemma2: its soft-caps, query scale and layer types are not in GGUF metadata: the defaults
        config = tf.Gemma2Config(**{k: v for k, v in tiny_config("gemma2").to_dict().items()
                                    if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "max_position_embeddings", "sliding_window", "bos_token_id",
                                             "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _write_gguf(model, path: Path) -> None:
    """``model`` and SmolLM2's tokenizer as an F32 GGUF file (what llama.cpp's converter writes for these layers)."""
    cfg, arch = model.config, model.config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(model.model.layers[0].self_attn.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _write_tokenizer(writer, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3 if arch == "phi3" else gguf.MODEL_ARCH.GEMMA2,
                                     cfg.num_hidden_layers)
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensor = weight.detach().float()
        if arch == "gemma2" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's norms as 1 + weight
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tokenizer(writer, cfg) -> None:
    tokenizer = make_tokenizer()
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [""] * len(spec["model"]["vocab"])
    for token, i in spec["model"]["vocab"].items():
        tokens[i] = token
    special = {a["id"] for a in spec.get("added_tokens", [])}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_unk_token_id(0)
    writer.add_chat_template(tokenizer.chat_template)


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_a_gguf_file_loads_as_its_family_and_fuses_exactly(arch: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the converted folder goes under ~/.cache/kvrag
    source = _source(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(source, path)
    lm = load_model(str(path), device="cpu")
    assert lm.family.name == arch
    assert lm.model.config._attn_implementation == lm.family.attn_implementation()
    ids = torch.randint(3, lm.spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = source(ids[None]).logits[0, -1]
        assert (lm.model(ids[None]).logits[0, -1] - reference).abs().max().item() <= 1e-4
    prefix = prefix_cache(lm, ids[:6].tolist())
    chunks = [ids[6:40], ids[40:63]]
    result = fuse(lm, FusionInput(prefix, chunks, [None, None], ids[63:]), FuseConfig(mode="full"))
    assert (result.logits - reference).abs().max().item() <= 1e-4
    if arch == "phi3":  # transformers reads a Gemma GGUF's tokenizer as SentencePiece, which SmolLM2's is not
        text = "Who commands beta station?"
        assert lm.tokenizer(text).input_ids == make_tokenizer()(text).input_ids
