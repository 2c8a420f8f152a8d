"""Every call into version-sensitive transformers internals lives here, in `kvrag.model.llama_layer`, which
runs Llama-family decoder layers from their parts (`run_decoder_layer` chooses it), and in the families
(`kvrag.model.families`), which say what differs from a Llama in each architecture.

Caches: a model kvrag runs itself (`kvrag.model.native_llama`, ``kvrag_row_cache`` set) grows a `RowCache`, so that
answering with it never imports transformers; every other model a transformers ``DynamicCache``, imported when the
first one is made (`dynamic_cache`, `full_cache`). A fusion's `ScatterCache` serves both: decoder layers only call
its ``update``.

Layout: ``[batch, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from kvrag.model import llama_layer
from kvrag.model.row_cache import RowCache


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as a plain dict (transformers 5 ``rope_parameters``, or 4.x)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return dict(params)


def base_model(model: Any) -> Any:
    return model.model


def rotary(model: Any) -> Any:
    """The model's rotary module: ``rotary(x, position_ids) -> (cos, sin)``, each ``[B, S, R]``."""
    return base_model(model).rotary_emb


def decoder_layers(model: Any) -> Any:
    return base_model(model).layers


def embed_tokens(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return base_model(model).embed_tokens(ids)


def final_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head on hidden states ``[B, S, hidden]`` -> ``[B, S, vocab]`` (float32)."""
    return model.lm_head(base_model(model).norm(hidden)).float()


@functools.cache
def _parameters(forward: Any) -> frozenset[str]:
    """The names a forward method takes."""
    return frozenset(inspect.signature(forward).parameters)


def _cache_keyword(forward: Any) -> str:
    return "cache" if "cache" in _parameters(forward) else "past_key_values"


def with_cache(module: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``module``'s forward: ``cache`` from transformers 5.2x on, where
    ``past_key_values`` warns that it is deprecated, and ``past_key_values`` before.
    """
    return {_cache_keyword(type(module).forward): cache}


def returned_cache(out: Any) -> Any:
    """The cache a model's forward returned (``out.cache``, or ``out.past_key_values`` before transformers 5.2x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` per layer of a transformers cache, each ``[B, H, S, D]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of every layer of a dynamic cache (in place).

    (``DynamicCache.crop``'s argument changed meaning across transformers versions.)
    """
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
        return
    for i in range(len(cache.key_cache)):
        cache.key_cache[i] = cache.key_cache[i][..., :length, :]
        cache.value_cache[i] = cache.value_cache[i][..., :length, :]


def makes_row_cache(model: Any) -> bool:
    """Whether ``model`` (an LM or its base model) grows kvrag's own `RowCache` instead of a transformers cache."""
    return bool(getattr(model, "kvrag_row_cache", False))


def dynamic_cache(model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A cache for ``model`` holding the given per-layer ``(keys, values)`` (``[B, H, S, D]``) themselves, not
    copies: a `RowCache` for a model kvrag runs itself, else a transformers ``DynamicCache``.

    A dynamic layer's ``update`` would concatenate them onto an empty layer: a second copy of the whole cache while
    the first is still held. A dynamic layer only ever concatenates onto its tensors (new tensors), so the given
    ones are never written through it.
    """
    if makes_row_cache(model):
        return RowCache(kv)
    # lazy: transformers costs a cold process 0.6 s to import, and a model kvrag runs itself never needs it
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[..., :0, :], v[..., :0, :], i)  # the layer made and initialised as this version does it
        held: Any = cache.layers[i] if hasattr(cache, "layers") else None
        if held is not None:
            held.keys, held.values = k, v
        else:  # transformers' per-layer lists (before its cache layers)
            lists: Any = cache
            lists.key_cache[i], lists.value_cache[i] = k, v
    return cache


def full_cache(model: Any) -> Any:
    """An empty cache for ``model`` that keeps every row of every layer: given none, a model with windowed layers
    makes one that keeps only their last window.
    """
    return dynamic_cache(model, [])


def first_layer_keys(model: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotated layer-0 keys ``[1, H, S, D]`` of ``ids`` placed at ``positions``, from the model's own forward (stopped
    after layer 0 where it takes ``n_layers``, as kvrag's own models do: a thirtieth of the work for SmolLM2, at every
    cold start).
    """
    with torch.no_grad():
        base = base_model(model)
        first_only = {"n_layers": 1} if "n_layers" in _parameters(type(base).forward) else {}
        out = base(input_ids=ids, position_ids=positions, **with_cache(base, full_cache(base)), use_cache=True,
                   **first_only)
    return cache_layers(returned_cache(out))[0][0]


class ScatterLayer:
    """A cache layer over the full K/V of a sequence that writes fresh rows for selected positions.

    Before the decoder layer runs, `rows` is set to the sequence positions of the selected tokens;
    `update` writes the fresh keys/values there and returns the full tensors (or their first `limit`
    positions, when the selected tokens attend no further), so the selected tokens attend to the
    whole (partly stored, partly fresh) sequence.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values  # [1, H, N, D]
        self.dtype = keys.dtype
        self.rows: torch.Tensor | None = None
        self.limit: int | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, rows = self.full()
        assert rows is not None and key_states.shape[-2] == rows.numel()
        keys.index_copy_(2, rows, key_states.to(self.dtype))
        values.index_copy_(2, rows, value_states.to(self.dtype))
        if self.limit is not None and self.limit < keys.shape[2]:
            return keys[:, :, : self.limit], values[:, :, : self.limit]
        return keys, values

    def full(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The full keys and values ``[1, H, N, D]`` and the selected rows."""
        return self.keys, self.values, self.rows


class ScatterCache:
    """`ScatterLayer`s over the full K/V of ``[prefix][chunks…][suffix]``, updated in place. A decoder layer run on
    its own (transformers' or kvrag's) calls only ``update``, which is all this cache offers it.
    """

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = [ScatterLayer(k, v) for k, v in kv]

    def layer(self, idx: int) -> ScatterLayer:
        return self.layers[idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].update(key_states, value_states)

    def to_dynamic(self, model: Any) -> Any:
        """The full rows as ``model``'s growing cache (`dynamic_cache`), for decoding after the fused pass."""
        return dynamic_cache(model, [layer.full()[:2] for layer in self.layers])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x₂, x₁)`` for the halves ``x₁, x₂`` of the last dimension (the rotary pairing)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys ``[B, H, S, D]`` by ``cos``/``sin`` ``[B, S, R]`` (``R <= D``: partial rotary),
    as the decoder layers do.
    """
    cos, sin = cos[:, None].to(k.dtype), sin[:, None].to(k.dtype)
    rot = cos.shape[-1]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    out = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((out, k_pass), dim=-1) if k_pass.shape[-1] else out


def run_decoder_layer(
    model: Any,
    idx: int,
    hidden: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: ScatterCache,
) -> torch.Tensor:
    """Run decoder layer ``idx`` on the selected tokens' hidden states ``[1, n_sel, hidden]``
    (``rope``: their `kvrag.model.families.position_embeddings`).
    """
    layer = decoder_layers(model)[idx]
    if llama_layer.runs_plain(layer):
        return llama_layer.run(layer, hidden, mask, rope, cache.layer(idx))
    out = layer(
        hidden,
        attention_mask=mask,
        position_ids=positions[None],
        **with_cache(layer, cache),
        use_cache=True,
        position_embeddings=rope,
    )
    return out[0] if isinstance(out, tuple) else out
