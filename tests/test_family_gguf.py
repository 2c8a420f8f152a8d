""".gguf loading for the families whose GGUF files transformers reads: a tiny model written as llama.cpp lays it out
(F32 tensors under llama.cpp's names, SmolLM2's tokenizer), loaded through `load_model`, is the same model in the
same family, and fuses exactly.

Transformers names gpt-oss among the architectures it reads from GGUF, but reads none of its experts' weights (and
no head width): such a file is refused at load in one line, never run with weights that are not the file's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer, tiny_config

from kvrag.config import FuseConfig
from kvrag.errors import UnsupportedModelError
from kvrag.fusion import FusionInput, fuse
from kvrag.indexing.kvgen import prefix_cache
from kvrag.model.loading import load_model

gguf = pytest.importorskip("gguf")


# what a family's GGUF metadata carries (anything else takes the config's default when transformers reads the file)
CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "bos_token_id",
           "eos_token_id", "pad_token_id")
GGUF_ARCH = {"phi3": "PHI3", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "qwen3_moe": "QWEN3MOE", "gpt_oss": "GPT_OSS"}


def _source(arch: str, **extra):
    """A tiny model of ``arch`` with only the settings its GGUF metadata carries changed from the defaults
    (Gemma's soft-caps, query scale and layer types, Qwen3-MoE's expert width are not carried)."""
    import transformers as tf

    if arch == "phi3":
        settings = {k: v for k, v in tiny_config("phi3").to_dict().items()
                    if k not in ("model_type", "partial_rotary_factor", "rope_parameters")}
    else:
        settings = {k: v for k, v in tiny_config(arch).to_dict().items() if k in CARRIED}
        settings.update({k: settings.get(k) if settings.get(k) is not None else v
                         for k, v in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0))})
    if arch == "qwen3_moe":
        settings.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    if arch == "gpt_oss":
        settings.update(num_local_experts=4, num_experts_per_tok=2)
    config = type(tiny_config(arch))(**{**settings, **extra})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _write_gguf(model, path: Path) -> None:
    """``model`` and SmolLM2's tokenizer as an F32 GGUF file, as llama.cpp's converter writes these layers: its
    tensor names, Gemma's norms as 1 + weight, experts stacked per projection (gpt-oss's gate and up apart)."""
    cfg = model.config
    arch = "gemma3" if cfg.model_type == "gemma3_text" else cfg.model_type
    gguf_arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[arch])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf_arch])
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(model.model.layers[0].self_attn.head_dim)
    rope = cfg.rope_parameters
    rope = rope if "rope_theta" in rope else rope["full_attention"]  # Gemma 3: per layer type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _write_tokenizer(writer, cfg)
    names = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensor = weight.detach().float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if ".mlp.experts." in name:
            for gguf_name, part in _expert_tensors(arch, name, tensor):
                writer.add_tensor(gguf_name, part.contiguous().numpy())
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and name.endswith(".sinks"):
            gguf_name = f"blk.{name.split('.')[2]}.attn_sinks.weight"
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _expert_tensors(arch: str, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One layer's stacked expert weights under llama.cpp's names, ``[experts, out, in]``."""
    block, what = f"blk.{name.split('.')[2]}", name.rsplit(".", 1)[1]
    if arch == "qwen3_moe":  # gate_up [E, 2I, H] with the gate first; down [E, H, I]
        if what == "gate_up_proj":
            half = tensor.shape[1] // 2
            return [(f"{block}.ffn_gate_exps.weight", tensor[:, :half]),
                    (f"{block}.ffn_up_exps.weight", tensor[:, half:])]
        return [(f"{block}.ffn_down_exps.weight", tensor)]
    # gpt-oss: gate_up [E, H, 2I] and its bias [E, 2I] interleave the gate and up; down [E, I, H]
    if what == "gate_up_proj":
        return [(f"{block}.ffn_gate_exps.weight", tensor[..., ::2].transpose(1, 2)),
                (f"{block}.ffn_up_exps.weight", tensor[..., 1::2].transpose(1, 2))]
    if what == "gate_up_proj_bias":
        return [(f"{block}.ffn_gate_exps.bias", tensor[..., ::2]), (f"{block}.ffn_up_exps.bias", tensor[..., 1::2])]
    if what == "down_proj":
        return [(f"{block}.ffn_down_exps.weight", tensor.transpose(1, 2))]
    return [(f"{block}.ffn_down_exps.bias", tensor)]


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


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "qwen3_moe"])
def test_a_gguf_file_loads_as_its_family_and_fuses_exactly(arch: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the converted folder goes under ~/.cache/kvrag
    source = _source(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(source, path)
    lm = load_model(str(path), device="cpu")
    assert lm.family.name == source.config.model_type
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


@pytest.mark.parametrize("head_dim", [64, 16])  # 64: the width transformers assumes; 16: one it does not
def test_a_gguf_file_transformers_reads_in_part_is_refused_in_one_line(head_dim: int, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "tiny-gpt-oss.gguf"
    _write_gguf(_source("gpt_oss", head_dim=head_dim), path)
    with pytest.raises(UnsupportedModelError) as refused:
        load_model(str(path), device="cpu")
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "safetensors checkpoint" in message
    assert ("does not read 16 of the gpt_oss model's weights" in message) == (head_dim == 64)
    assert not list((tmp_path / ".cache").rglob("config.json"))  # nothing converted is kept
