"""kvrag's own BERT encoder: a plain BERT checkpoint folder run without importing transformers' modeling code.

Contract: `native_bert_reason(folder)` says why a folder cannot run here (None: it can): its ``config.json`` must
describe a BERT with absolute positions and the exact GELU, its weights must be safetensors and its tokenizer a
``tokenizer.json``. `NativeBert.load(folder)` then gives the encoder: ``model(input_ids=, attention_mask=,
token_type_ids=)`` returns an object whose ``last_hidden_state`` is transformers' ``BertModel``'s to float rounding
(`tests/test_native_models.py`); the pooler is not run. It exists for the default embedder (all-MiniLM-L6-v2,
`kvrag.mean_pooled`): transformers' BERT modules import torch's compiler and torch.distributed, about 2.5 s of a
cold ``kvrag ask`` on a 2-core machine. ``KVRAG_NATIVE_MODELS=0`` loads it through transformers instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvrag.model.native_llama import ENV_SWITCH, native_switched_off


def native_bert_reason(folder: str | Path) -> str | None:
    """Why ``folder`` does not run as a native BERT (one phrase), or None when it does."""
    if native_switched_off():
        return f"{ENV_SWITCH} is off"
    root = Path(folder)
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json"
    checks = {
        "not a BERT": cfg.get("model_type") != "bert",
        "an activation other than the exact GELU": cfg.get("hidden_act", "gelu") != "gelu",
        "relative positions": cfg.get("position_embedding_type", "absolute") != "absolute",
        "a decoder": bool(cfg.get("is_decoder") or cfg.get("add_cross_attention")),
        "no model.safetensors": not (root / "model.safetensors").is_file(),
        "no tokenizer.json": not (root / "tokenizer.json").is_file(),
    }
    return next((reason for reason, failed in checks.items() if failed), None)


@dataclass
class BertConfig:
    """The few sizes the forward reads (``hidden_size`` as transformers' config names it)."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    layer_norm_eps: float


@dataclass
class BertOutput:
    """The encoder's output, as transformers' models name it."""

    last_hidden_state: torch.Tensor


def _layer_names(i: int) -> list[str]:
    at = f"encoder.layer.{i}."
    return [at + part + suffix for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                                            "attention.output.dense", "attention.output.LayerNorm",
                                            "intermediate.dense", "output.dense", "output.LayerNorm")
            for suffix in (".weight", ".bias")]


class NativeBert:
    """A BERT encoder over its checkpoint's tensors; see the module docstring."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config, self.w = config, weights

    @classmethod
    def load(cls, folder: str | Path) -> NativeBert:
        """The encoder of a folder `native_bert_reason` accepts, in float32 on the CPU.

        Raises:
            ValueError: the checkpoint lacks a tensor the config implies.
        """
        root = Path(folder)
        cfg = json.loads((root / "config.json").read_text())
        config = BertConfig(int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"]),
                            float(cfg.get("layer_norm_eps", 1e-12)))
        weights = {name.removeprefix("bert."): t.float() for name, t in load_file(root / "model.safetensors").items()}
        needed = [f"embeddings.{part}.weight" for part in ("word_embeddings", "position_embeddings",
                                                           "token_type_embeddings", "LayerNorm")]
        needed += ["embeddings.LayerNorm.bias"] + [n for i in range(config.num_hidden_layers) for n in _layer_names(i)]
        missing = [name for name in needed if name not in weights]
        if missing:
            raise ValueError(f"the checkpoint in {root} is not a BERT as its config.json describes (no {missing[0]})")
        return cls(config, weights)

    def to(self, device: torch.device | str) -> NativeBert:
        """The encoder with its weights on ``device``."""
        self.w = {name: t.to(device) for name, t in self.w.items()}
        return self

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                            self.config.layer_norm_eps)

    def _dense(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None, **_: Any) -> BertOutput:
        """Last hidden states ``[B, n, hidden]`` of ``input_ids`` ``[B, n]`` (padding where the mask is 0)."""
        w, (b, n) = self.w, input_ids.shape
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        positions = torch.arange(n, device=input_ids.device)
        x = (F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
             + F.embedding(types, w["embeddings.token_type_embeddings.weight"])
             + F.embedding(positions, w["embeddings.position_embeddings.weight"])[None])
        x = self._norm("embeddings.LayerNorm", x)
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # [B, 1, 1, n]
        heads = self.config.num_attention_heads
        for i in range(self.config.num_hidden_layers):
            at = f"encoder.layer.{i}."
            q, k, v = (self._dense(at + "attention.self." + part, x).view(b, n, heads, -1).transpose(1, 2)
                       for part in ("query", "key", "value"))
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, -1)
            x = self._norm(at + "attention.output.LayerNorm", self._dense(at + "attention.output.dense", attended) + x)
            inner = F.gelu(self._dense(at + "intermediate.dense", x))
            x = self._norm(at + "output.LayerNorm", self._dense(at + "output.dense", inner) + x)
        return BertOutput(last_hidden_state=x)
