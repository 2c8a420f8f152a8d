"""kvrag's own Llama: a plain Llama checkpoint folder run without importing transformers' modeling code.

Contract: `native_reason(folder)` says why a folder cannot run here (None: it can). It can when its ``config.json``
describes a ``LlamaForCausalLM`` with SiLU, no biases, the default rotary embedding, no sliding window and no
quantisation, and its weights are safetensors; `load_native(folder, dtype)` then builds `NativeLlamaForCausalLM` and
its tokenizer. `cached_hub_folder(repo_id)` finds a hub id's snapshot in the Hugging Face cache, so a model
transformers downloaded once runs natively afterwards (kvrag downloads nothing itself). Importing transformers'
Llama modules costs a cold process about 3 s on a 2-core machine (its configuration module alone imports torch's
compiler and torch.distributed), more than loading the weights; this module imports no transformers at all: its
configuration is the file's fields (`NativeLlamaConfig`), its cache kvrag's `RowCache`, and its tokenizer kvrag's
`NativeTokenizer` wherever that reads the folder as transformers would (else transformers' fast tokenizer).

The module tree, parameter names and their order are transformers' ``LlamaForCausalLM``'s, so a checkpoint loads
the same weights under the same names and `kvrag.model.loading.model_fingerprint` gives the same fingerprint: an
index built with either opens with the other. The forward is the Llama's, computed with the operations of
`kvrag.model.llama_layer` (the same ones kvrag's selective recompute and token steps run); it equals transformers'
forward to float rounding and gives the same greedy tokens (`tests/test_native_models.py`). It takes what kvrag
passes: token ids, positions, a cache to extend (a `RowCache`, or a transformers cache); a padding mask is
refused. Set ``KVRAG_NATIVE_MODELS=0`` to load every model through transformers instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from kvrag.config import switched_off
from kvrag.model import hf_compat, llama_layer
from kvrag.model.cpu_linear import linear
from kvrag.model.native_tokenizer import load_fast_tokenizer
from kvrag.model.row_cache import RowCache

Cache = Any  # a `RowCache` or a transformers cache: anything with ``update(keys, values, idx)``

ENV_SWITCH = "KVRAG_NATIVE_MODELS"
# Tokenizer classes whose fast tokenizer is tokenizer.json as it stands (`PreTrainedTokenizerFast` loads it alike).
_PLAIN_TOKENIZERS = frozenset({"GPT2Tokenizer", "GPT2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"})


class NativeLlamaConfig:
    """A Llama ``config.json``'s fields as attributes, as they stand in the file (a field it lacks is no attribute)."""

    model_type = "llama"

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)
        self._attn_implementation = "sdpa"

    def __getattr__(self, name: str) -> Any:  # a field the file lacks (typed as any field, for readers)
        raise AttributeError(f"config.json has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if not key.startswith("_")}


def _head_dim(config: NativeLlamaConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _read_config(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "config.json").read_text()))


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files (one file, or the shards its index names); empty when it has none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def native_switched_off() -> bool:
    """Whether ``KVRAG_NATIVE_MODELS`` asks for every model to load through transformers."""
    return switched_off(ENV_SWITCH)


def cached_hub_folder(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The folder of the Hugging Face cache's snapshot of ``repo_id`` (its main revision) when its ``config.json`` is
    there, else None. Nothing is downloaded: a model transformers fetched once runs natively from then on.
    """
    if repo_id.count("/") != 1 or Path(repo_id).exists():
        return None
    from huggingface_hub import try_to_load_from_cache  # lazy: a local folder never needs the hub's client

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    except ValueError:  # not a valid repository id
        return None
    return Path(found).parent if isinstance(found, str) else None


def native_reason(folder: str | Path) -> str | None:
    """Why ``folder`` does not run as a native Llama (one phrase), or None when it does."""
    if native_switched_off():
        return f"{ENV_SWITCH} is off"
    root = Path(folder)
    try:
        cfg = _read_config(root)
        tokenizer_class = json.loads((root / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return "no readable config.json and tokenizer_config.json"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    weights = _weight_files(root)
    checks = {
        "not a LlamaForCausalLM": cfg.get("model_type") != "llama" or cfg.get("architectures") != ["LlamaForCausalLM"],
        "an activation other than SiLU": cfg.get("hidden_act", "silu") != "silu",
        "biases": bool(cfg.get("attention_bias") or cfg.get("mlp_bias")),
        "a rotary embedding other than the default": rope.get("rope_type", rope.get("type", "default")) != "default",
        "tensor-parallel slices": cfg.get("pretraining_tp", 1) != 1,
        "quantised weights": "quantization_config" in cfg,
        "a sliding window": cfg.get("sliding_window") is not None or cfg.get("layer_types") is not None,
        "no safetensors weights": not weights or not all(f.is_file() for f in weights),
        "no tokenizer.json of a plain fast tokenizer": (tokenizer_class not in _PLAIN_TOKENIZERS
                                                        or not (root / "tokenizer.json").is_file()),
    }
    return next((reason for reason, failed in checks.items() if failed), None)


class NativeRMSNorm(nn.Module):
    """RMS norm in float32, cast back, scaled by its weight (`llama_layer.rms_norm`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return llama_layer.rms_norm(self, x)


class _Linear(nn.Linear):
    """A bias-free ``nn.Linear`` made on the meta device and left uninitialised: its weight is the checkpoint's.

    (Initialising on meta runs torch's reference ops, which import its compiler: a second of a cold start.)
    """

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out, bias=False, device="meta")

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class _Embedding(nn.Embedding):
    """An ``nn.Embedding`` made on the meta device and left uninitialised, as `_Linear`."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__(n, dim, device="meta")

    def reset_parameters(self) -> None:
        pass


class NativeAttention(nn.Module):
    """The q/k/v/o projections of one layer and what `llama_layer` reads beside them."""

    def __init__(self, config: NativeLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim ** -0.5
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // kv_heads
        self.q_proj = _Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = _Linear(config.hidden_size, kv_heads * self.head_dim)
        self.v_proj = _Linear(config.hidden_size, kv_heads * self.head_dim)
        self.o_proj = _Linear(config.num_attention_heads * self.head_dim, config.hidden_size)


class NativeMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: NativeLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = nn.SiLU()


class NativeDecoderLayer(nn.Module):
    """Pre-norm attention and a residual, then a pre-norm gated MLP and a residual (`llama_layer`'s plain layer)."""

    def __init__(self, config: NativeLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = NativeAttention(config, layer_idx)
        self.mlp = NativeMLP(config)
        self.input_layernorm = NativeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = NativeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Cache | None = None,
                **_: Any) -> torch.Tensor:
        """``hidden`` ``[B, n, hidden]`` through the layer (`llama_layer.run`); its key/value rows are appended to
        ``cache``.
        """
        assert position_embeddings is not None and cache is not None
        return llama_layer.run(self, hidden, attention_mask, position_embeddings,
                               _AppendedRows(cache, self.self_attn.layer_idx))


@dataclass
class _AppendedRows:
    """Layer ``idx`` of a cache as a `llama_layer.RowWriter`: the rows are appended."""

    cache: Cache
    idx: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(key_states, value_states, self.idx)


class NativeRotary(nn.Module):
    """The default rotary embedding: ``(cos, sin)`` ``[B, S, D]`` of positions ``[B, S]``, computed in float32."""

    def __init__(self, config: NativeLlamaConfig) -> None:
        super().__init__()
        dim = _head_dim(config)
        base = float(hf_compat.rope_parameters(config)["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: Any = self.inv_freq  # a buffer
        inv = inv_freq.to(x.device)[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@dataclass
class NativeOutput:
    """What a forward returns: the last hidden states (the base model) or logits (the LM), and the cache."""

    last_hidden_state: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None

    @property
    def past_key_values(self) -> Cache | None:
        return self.cache


def _causal_mask(n: int, past: int, device: torch.device) -> torch.Tensor | None:
    """``n`` queries after ``past`` cached rows: None where SDPA's own causal rule is the right one (no rows before,
    or one query), else a boolean ``[1, 1, n, past + n]`` mask, lower-right aligned.
    """
    if past == 0 or n == 1:
        return None
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]


class NativeLlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and the rotary embedding (transformers' ``LlamaModel``'s names)."""

    kvrag_row_cache = True  # grows a `RowCache` (`kvrag.model.hf_compat.dynamic_cache`)

    def __init__(self, config: NativeLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NativeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = NativeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = NativeRotary(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: Cache | None = None,
                use_cache: bool = True, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, n_layers: int | None = None, **_: Any) -> NativeOutput:
        """The last hidden states of ``input_ids`` ``[B, n]`` after ``cache``'s rows (which it extends;
        ``past_key_values`` is the same argument under transformers' older name). ``n_layers``: run only the first
        that many decoder layers (the cache then holds their rows only), for what needs no more.
        """
        cache = past_key_values if cache is None else cache
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("kvrag's native Llama takes no padding mask; pad on the right and read each row's own "
                             "positions, or load the model through transformers (KVRAG_NATIVE_MODELS=0)")
        cache = RowCache() if cache is None else cache
        past, n = cache.get_seq_length(), input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=input_ids.device)[None]
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(hidden, position_ids)
        mask = _causal_mask(n, past, hidden.device)
        for layer in self.layers[:n_layers]:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, cache=cache)
        return NativeOutput(last_hidden_state=self.norm(hidden), cache=cache)


class NativeLlamaForCausalLM(nn.Module):
    """A Llama with its LM head (transformers' ``LlamaForCausalLM``'s names); see the module docstring."""

    kvrag_row_cache = True

    def __init__(self, config: NativeLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = NativeLlamaModel(config)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not implemented: raises NotImplementedError, naming what to use instead of transformers' ``generate``."""
        raise NotImplementedError(f"kvrag's native Llama has no transformers generate(): answer through kvrag "
                                  f"(KVRag.answer, PassageCache.answer_prompt), or set {ENV_SWITCH}=0 to load the "
                                  f"model through transformers")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: Cache | None = None,
                use_cache: bool = True, logits_to_keep: int = 0, past_key_values: Cache | None = None,
                **kwargs: Any) -> NativeOutput:
        """Logits ``[B, n, vocab]`` of ``input_ids`` (the last ``logits_to_keep`` positions' where it is > 0)."""
        cache = past_key_values if cache is None else cache
        out = self.model(input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
        assert out.last_hidden_state is not None
        hidden = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        return NativeOutput(logits=self.lm_head(hidden), cache=out.cache)


def _load_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    return weights


def load_native(folder: str | Path, dtype: torch.dtype) -> tuple[NativeLlamaForCausalLM, Any]:
    """The model (in ``dtype``, on the CPU, in eval mode) and tokenizer of a folder `native_reason` accepts.

    Raises:
        ValueError: the weights do not match the config (a missing or extra tensor, another shape).
    """
    root = Path(folder)
    config = NativeLlamaConfig(**_read_config(root))
    model = NativeLlamaForCausalLM(config)
    weights = {name: tensor.to(dtype) for name, tensor in _load_weights(_weight_files(root)).items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        weights.pop("lm_head.weight", None)
    expected = {name for name, _ in model.named_parameters()} - ({"lm_head.weight"} if tied else set())
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        raise ValueError(f"the checkpoint in {root} does not hold a Llama's weights as its config.json describes "
                         f"(missing {missing[:2]}, unexpected {extra[:2]})")
    try:
        model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as exc:  # a tensor of another shape than the config gives
        raise ValueError(f"the checkpoint in {root} has weights of other shapes than its config.json: "
                         f"{str(exc).splitlines()[-1].strip()}") from None
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), load_fast_tokenizer(root)
