"""`one_token`: a decoding step of one answer with each decoder layer in two compiled calls around its attention.

Contract: ``one_token(model, cache, token, position)`` returns the step's last-token logits ``[1, vocab]`` (float32)
and extends ``cache`` by the token's key/value row, as `kvrag.generation.step_batch.forward_steps` does, or returns
None, having touched nothing, where the step is not one it takes. It takes steps of a model whose every decoder
layer `kvrag.model.llama_layer` runs from its parts (no window, one rotary embedding over the whole head; biases and
per-head query and key norms, as Qwen2's and Qwen3's, included), in float32 on the CPU, over a cache of growing
layers with one row of batch, in a process where kvrag's numba kernels serve
(`kvrag.model.cpu_linear.kernel_threads`). The embedding, the final norm and the LM head stay the family's own; each
layer runs in `kvrag.model.layer_step_kernel` (about 30 torch operations a layer replaced by two calls around
torch's attention), its row written into the cache layer's room (`kvrag.generation.cache_room`). The logits equal
the torch path's to float rounding (`tests/test_layer_steps.py`).

The layers' weights are read once per model into the kernel's form (NumPy views of the same memory, no copy) and
read again when the model's first weight is no longer the same tensor (moved, reloaded). Set
``KVRAG_CPU_KERNELS=0`` to run every step through torch. numba compiles the kernels once per machine (and again after
an upgrade of kvrag), about 7 s on 2 cores, during the first step that takes them: a warning says so.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvrag.generation.cache_room import appendable, grown, room
from kvrag.model import hf_compat, llama_layer
from kvrag.model.cpu_linear import kernel_threads
from kvrag.model.families import family_of
from kvrag.model.row_cache import RowCache

KERNEL_MODULE = "kvrag.model.layer_step_kernel"  # imports numba: loaded on the first step it takes
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))

log = logging.getLogger(__name__)
_NONE = torch.empty(0)  # an absent bias or head norm, as the kernel reads it
_kernel: ModuleType | None = None
_loading = threading.Lock()


@dataclass(frozen=True)
class _Plan:
    """A model's layers in the kernel's form: per layer the `kvrag.model.layer_step_kernel` weights tuple."""

    weights: tuple[tuple[np.ndarray, ...], ...]
    heads: int
    scale: float
    eps: float  # the layers' RMS norms'
    head_eps: float  # the per-head query and key norms' (0 where there are none)
    first: int  # where the model's first q weight was when the plan was made (elsewhere: a stale plan)


@torch.no_grad()
def one_token(model: Any, cache: Any, token: int, position: int) -> torch.Tensor | None:
    """The step's logits ``[1, vocab]`` with ``cache`` extended, or None where the step is not this module's."""
    plan = _plan(model)
    if plan is None or not appendable(cache) or len(cache.layers) != len(plan.weights):
        return None
    threads = kernel_threads()
    first = cache.layers[0].keys
    if threads is None or first.shape[0] != 1 or first.dtype != torch.float32 or first.device.type != "cpu":
        return None
    family = family_of(model.config)
    ids = torch.tensor([[token]])
    hidden = family.embed(model, ids)  # [1, 1, hidden]
    cos, sin = family.rope(model, family.kinds[0].rope, hidden, torch.tensor([[position]]))
    head_dim = first.shape[-1]
    if hidden.dtype != torch.float32 or cos.shape[-1] != head_dim:
        return None
    kernel = _kernel if _kernel is not None else _load_kernel()
    state = hidden.reshape(-1).clone()
    residual, cos_row, sin_row = state.numpy(), cos.reshape(-1).float().numpy(), sin.reshape(-1).float().numpy()
    queries = torch.empty(1, plan.heads, 1, head_dim)
    for layer, weights in zip(cache.layers, plan.weights):
        n = layer.keys.shape[-2]
        keys, values = room(layer, 1)
        kernel.before_attention(residual, weights, cos_row, sin_row, keys[0].numpy(), values[0].numpy(), n,
                                plan.eps, plan.head_eps, queries.numpy().reshape(-1), threads)
        keys, values = grown(layer, n + 1)
        attended = llama_layer.attend(queries, keys, values, None, plan.scale)
        kernel.after_attention(residual, weights, attended.reshape(-1).numpy(), plan.eps, threads)
    return family.logits(model, state.view(1, 1, -1))[:, -1].float()


def compile_ahead(model: Any) -> bool:
    """Compile the kernels now where ``model``'s steps would take them and numba's cache on this machine lacks them,
    by one step over a one-row cache of zeros (``kvrag index`` calls it, so that a fresh install's first answer does
    not pay the compilation); whether it compiled.
    """
    plan = _plan(model)
    if plan is None or kernel_threads() is None or importlib.import_module(KERNEL_MODULE).compiled_here():
        return False
    attn = hf_compat.decoder_layers(model)[0].self_attn
    head_dim = int(attn.head_dim)
    shape = (1, attn.k_proj.weight.shape[0] // head_dim, 1, head_dim)
    cache = RowCache([(torch.zeros(shape), torch.zeros(shape)) for _ in plan.weights])
    return one_token(model, cache, 0, 1) is not None


def _plan(model: Any) -> _Plan | None:
    """The model's `_Plan`, made on first use and again whenever its first weight moved; None where the model, as
    its weights are now, has none (remembered as the weight's address, checked again once it moves).
    """
    known = getattr(model, "_kvrag_layer_steps", None)
    layers = hf_compat.decoder_layers(model)
    where = layers[0].self_attn.q_proj.weight.data_ptr()
    if isinstance(known, _Plan) and known.first == where:
        return known
    if known == where:
        return None
    made = _made_plan(model, layers)
    model._kvrag_layer_steps = made if made is not None else where
    return made


def _made_plan(model: Any, layers: Any) -> _Plan | None:
    family = family_of(model.config)
    if (len({kind.rope for kind in family.kinds}) != 1 or any(kind.window is not None for kind in family.kinds)
            or not all(llama_layer.runs_plain(layer) for layer in layers)):
        return None
    weights: list[tuple[np.ndarray, ...]] = []
    eps: set[float] = set()
    head_eps: set[float] = set()
    for layer in layers:
        attn = layer.self_attn
        modules = [getattr(getattr(layer, part), name) for part, name in _PROJECTIONS]
        head_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        if (head_norms[0] is None) != (head_norms[1] is None):
            return None
        tensors = [layer.input_layernorm.weight, *(m.weight for m in modules[:4]),
                   layer.post_attention_layernorm.weight, *(m.weight for m in modules[4:]),
                   *(_NONE if getattr(m, "bias", None) is None else m.bias for m in modules),
                   *(_NONE if norm is None else norm.weight for norm in head_norms)]
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return None
        weights.append(tuple(t.detach().numpy() for t in tensors))
        eps.update(float(norm.variance_epsilon) for norm in (layer.input_layernorm, layer.post_attention_layernorm))
        head_eps.update(float(norm.variance_epsilon) for norm in head_norms if norm is not None)
    scales = {float(layer.self_attn.scaling) for layer in layers}
    if len(eps) != 1 or len(scales) != 1 or len(head_eps) > 1:
        return None
    first = layers[0].self_attn
    heads = first.q_proj.weight.shape[0] // int(first.head_dim)
    return _Plan(tuple(weights), heads, scales.pop(), eps.pop(), head_eps.pop() if head_eps else 0.0,
                 first.q_proj.weight.data_ptr())


def _load_kernel() -> ModuleType:
    global _kernel
    with _loading:
        if _kernel is None:
            module = importlib.import_module(KERNEL_MODULE)
            if not module.compiled_here():
                log.warning("compiling kvrag's decoding kernels for this machine (once, about 10 s)")
            _kernel = module
    return _kernel
