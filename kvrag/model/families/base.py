"""`Family`: what fusion needs from one architecture, read from its config, and the registry that finds it.

A family is one class registered under the config ``model_type``s it covers (`register_family`); `family_of`
instantiates it for a config. The base class describes a Llama-shaped model (pre-norm attention with q/k/v/o
projections, one rotary embedding, at most one sliding window for every layer); a family overrides what differs:

- `eager_reason`: why SDPA cannot run its attention exactly (a logit soft-cap, attention sinks), so that
  `attn_implementation` gives ``eager`` for its layers; None (the default) keeps SDPA;
- `layer_kinds`: per layer, its window and the name of its rotary embedding (None: no positional encoding);
- `rope`: the ``(cos, sin)`` of a named rotary embedding, as the layers take it, and `full_width`: the same in the
  form `kvrag.model.hf_compat.apply_rope` takes (gpt-oss's layers take half-width pairs);
- `embed` and `logits`: the embedding and LM-head steps of the model's forward (multipliers, soft-caps);
- `queries` and `keys_values`: a layer's projections alone, exactly as the layer computes them, and
  `score_rule`: how it weighs them (scale, soft-cap, sinks), for the question's attention that ranks tokens;
- `refusal`: a one-line reason the model cannot be fused exactly, or None.

Layout: hidden states ``[1, n, hidden]``; heads ``[1, heads, n, head_dim]``; rotary ``(cos, sin)`` ``[B, S, R]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvrag.model import hf_compat, llama_layer

DEFAULT_ROPE = "default"
_POSITION_DEPENDENT_ROPE = ("dynamic",)  # frequencies rescaled with the length of every call


@dataclass(frozen=True)
class ScoreRule:
    """How a layer turns query-key products into attention weights:
    ``softmax(cap · tanh(q·k · scale / cap))``, each head's softmax also spread over its sink logit.
    """

    scale: float
    cap: float | None = None  # attention logit soft-cap (Gemma)
    sinks: torch.Tensor | None = None  # [n_heads]: one learned logit per head (gpt-oss)


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer attends: what it sees and how its keys carry their positions."""

    window: int | None  # a query sees the keys of the last ``window`` positions (its own included); None: all
    rope: str | None  # the family's name for the layer's rotary embedding; None: no positional encoding (NoPE)


class Family:
    """A Llama-shaped model; subclasses override what their architecture does differently."""

    model_types: ClassVar[tuple[str, ...]] = ()
    tested: ClassVar[bool] = True  # kvrag's tests check this family on a tiny model (False: the fallback)

    def __init__(self, config: Any) -> None:
        self.config = config
        self.kinds: tuple[LayerKind, ...] = tuple(self.layer_kinds())
        assert len(self.kinds) == config.num_hidden_layers

    @property
    def name(self) -> str:
        return str(self.config.model_type)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window (None: it sees every position); a stored chunk cache keeps a windowed
        layer's last ``window`` rows only.
        """
        return tuple(kind.window for kind in self.kinds)

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def attn_implementation(self) -> str:
        """The attention implementation the layers must run with for fusion to be exact (`eager_reason`)."""
        return "sdpa" if self.eager_reason() is None else "eager"

    def layer_kinds(self) -> list[LayerKind]:
        """Per layer: its window (from ``layer_types`` where the config has them) and its rotary embedding."""
        cfg = self.config
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        types = getattr(cfg, "layer_types", None)
        if types is None:
            return [LayerKind(window, DEFAULT_ROPE)] * cfg.num_hidden_layers
        return [LayerKind(window if kind == "sliding_attention" else None, DEFAULT_ROPE) for kind in types]

    def rope_parameters(self) -> list[dict[str, Any]]:
        """The parameters of each of the model's rotary embeddings."""
        return [hf_compat.rope_parameters(self.config)]

    def refusal(self) -> str | None:
        """Why this model cannot be fused exactly (one line), or None."""
        for params in self.rope_parameters():
            reason = _rope_refusal(self.config, params)
            if reason is not None:
                return reason
        wanted = self.attn_implementation()
        running = getattr(self.config, "_attn_implementation", None)
        if wanted == "eager" and running not in (None, "eager"):
            return (f"{self.name} layers need attention_implementation='eager' to be exact ({self.eager_reason()}); "
                    f"this model runs {running!r}")
        return None

    def far_position(self) -> int:
        """A position past the model's context: a rotary embedding whose values at the first positions change
        when a call also holds this one rescales with the sequence length (`kvrag.model.rope.check_rope`).
        """
        return 4 * int(self.config.max_position_embeddings)

    def eager_reason(self) -> str | None:
        """Why SDPA cannot run this model's attention exactly, so its layers run eager attention (None: it can)."""
        return None

    def rope(self, model: Any, key: str | None, like: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, S, R]`` of rotary embedding ``key`` at ``positions`` ``[B, S]``, in ``like``'s
        dtype and device; the identity (cos 1, sin 0) for a layer without positional encoding.
        """
        if key is None:
            shape = (*positions.shape, self.head_dim)
            return (torch.ones(shape, dtype=like.dtype, device=like.device),
                    torch.zeros(shape, dtype=like.dtype, device=like.device))
        return self.rotary(model, key, like, positions.to(like.device))

    def full_width(self, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope`` (as `rope` gives it) in `apply_rope`'s form: ``x · cos + rotate_half(x) · sin``."""
        return rope

    def rotary(self, model: Any, key: str, like: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary module for embedding ``key`` (one for the whole model here)."""
        return hf_compat.rotary(model)(like, positions)

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        """The input of the first decoder layer for token ``ids``: ``[..., hidden]``."""
        return hf_compat.embed_tokens(model, ids)

    def logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the last layer's output ``[B, S, hidden]`` -> ``[B, S, vocab]`` (float32)."""
        return hf_compat.final_logits(model, hidden)

    def score_rule(self, model: Any, idx: int) -> ScoreRule:
        """How decoder layer ``idx`` weighs its keys: its attention's own scale (``scaling``)."""
        attn = hf_compat.decoder_layers(model)[idx].self_attn
        return ScoreRule(float(getattr(attn, "scaling", self.head_dim ** -0.5)))

    def attention_input(self, layer: Any, hidden: torch.Tensor) -> torch.Tensor:
        """What the attention's projections read: the layer input ``[1, n, hidden]`` through its pre-norm."""
        return layer.input_layernorm(hidden)

    def projections(self, layer: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries ``[1, n_heads, n, D]``, rotated keys and values ``[1, n_kv_heads, n, D]`` of
        layer ``layer`` for its attention input ``h``.
        """
        attn, d = layer.self_attn, self.head_dim
        queries = llama_layer.heads(attn.q_proj, getattr(attn, "q_norm", None), h, d)
        keys = llama_layer.heads(attn.k_proj, getattr(attn, "k_norm", None), h, d)
        values = llama_layer.heads(attn.v_proj, None, h, d)
        rope = self.full_width(rope)
        return hf_compat.apply_rope(queries, *rope), hf_compat.apply_rope(keys, *rope), values

    def queries(self, model: Any, idx: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """Rotated queries ``[1, n_heads, n, D]`` decoder layer ``idx`` computes for its input ``hidden``."""
        layer = hf_compat.decoder_layers(model)[idx]
        return self.projections(layer, self.attention_input(layer, hidden), rope)[0]

    def keys_values(self, model: Any, idx: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated keys and the values ``[1, n_kv_heads, n, D]`` decoder layer ``idx`` writes to its cache
        for its input ``hidden`` at the positions of ``rope``, without running the rest of the layer.
        """
        layer = hf_compat.decoder_layers(model)[idx]
        _, keys, values = self.projections(layer, self.attention_input(layer, hidden), rope)
        return keys, values


def _rope_refusal(config: Any, params: dict[str, Any]) -> str | None:
    """Why rotary parameters ``params`` cannot move cached keys (one line), or None."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _POSITION_DEPENDENT_ROPE:
        return (f"RoPE type {rope_type!r} rescales frequencies with the sequence length, so cached keys cannot be "
                "moved to new positions; use a model with static RoPE (default, linear, llama3, yarn)")
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if original is None or config.max_position_embeddings > original:
            return (f"RoPE type 'longrope' switches to its long factors past {original} tokens, so cached keys "
                    f"cannot be moved; it is static only up to there: set max_position_embeddings={original} "
                    f"(now {config.max_position_embeddings}) to fuse with its short factors")
    return None


_Registered = TypeVar("_Registered", bound=type[Family])
_FAMILIES: dict[str, type[Family]] = {}


def register_family(cls: _Registered) -> _Registered:
    """Register ``cls`` under each of its ``model_types`` (a class decorator); a type is registered once."""
    for model_type in cls.model_types:
        if model_type in _FAMILIES:
            raise ValueError(f"model_type {model_type!r} is already registered to {_FAMILIES[model_type].__name__}")
        _FAMILIES[model_type] = cls
    return cls


def registered_families() -> dict[str, type[Family]]:
    """Every registered ``model_type`` and its family, in registration order."""
    return dict(_FAMILIES)


class UntestedFamily(Family):
    """A model type no family is registered for: run as a Llama-shaped model, with a warning at load."""

    tested = False


def family_of(config: Any) -> Family:
    """The family of ``config`` (by ``model_type``; `UntestedFamily` for a type no family registers)."""
    return _FAMILIES.get(config.model_type, UntestedFamily)(config)


def layer_queries(model: Any, idx: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotated queries ``[1, n_heads, n, D]`` that decoder layer ``idx`` computes for ``hidden``
    (its input, ``[1, n, hidden]``) whose positions have the `position_embeddings` ``rope`` (as its
    family computes them: `Family.queries`).
    """
    return family_of(model.config).queries(model, idx, hidden, rope)


def layer_keys_values(
    model: Any, idx: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated keys and the values ``[1, n_kv_heads, n, D]`` decoder layer ``idx`` writes to its
    cache for ``hidden`` (its input, ``[1, n, hidden]``) at the positions of ``rope``, without
    running the rest of the layer (`Family.keys_values`).
    """
    return family_of(model.config).keys_values(model, idx, hidden, rope)


def position_embeddings(model: Any, like: torch.Tensor, positions: torch.Tensor, layer: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary ``(cos, sin)`` ``[1, n, R]`` decoder layer ``layer`` takes for ``positions`` ``[n]``, in
    ``like``'s dtype and device (its family's rotary embedding for that layer).
    """
    family = family_of(model.config)
    return family.rope(model, family.kinds[layer].rope, like, positions[None])
