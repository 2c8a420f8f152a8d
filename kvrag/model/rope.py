"""RoPE helpers: the model's rotary embeddings per layer, moving keys between positions, and the self-check.

Stored keys are *pre-RoPE*: the model's rotated keys un-rotated at the positions they were computed at. RoPE is
a per-position rotation (times an optional scalar ``attention_scaling``), so un-rotating and re-rotating at new
positions through the model's own rotary module is exact up to float rounding for every static RoPE variant
(default, linear, llama3, yarn, longrope below its original context) and partial rotary. Each layer rotates with
its family's rotary embedding (`Family.layer_kinds`): a model may have several (Gemma 3: local and global), and a
layer without positional encoding (SmolLM3's NoPE layers) has the identity, so its keys move unchanged.

Layout: keys ``[..., kv_heads, seq, head_dim]``; a whole cache ``[layers, kv_heads, seq, head_dim]``; rotary
``(cos, sin)`` ``[B, S, R]`` (``R <= head_dim``: partial rotary).
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.errors import UnsupportedModelError
from kvrag.model import hf_compat
from kvrag.model.families import Family, family_of
from kvrag.model.hf_compat import apply_rope, rotate_half

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [B, S, R]


def rope_at(model: Any, positions: torch.Tensor, like: torch.Tensor, layer: int = 0) -> Rope:
    """The ``(cos, sin)`` ``[B, S, R]`` decoder layer ``layer`` rotates with at ``positions`` (``[S]`` or
    ``[B, S]``), in ``like``'s dtype and device and in `apply_rope`'s form.
    """
    family = family_of(model.config)
    pos = positions if positions.dim() == 2 else positions[None]
    return family.full_width(family.rope(model, family.kinds[layer].rope, like, pos))


def layer_ropes(model: Any, family: Family, positions: torch.Tensor, like: torch.Tensor) -> list[Rope]:
    """Per decoder layer, its ``(cos, sin)`` at ``positions`` (``[S]`` or ``[B, S]``) in `apply_rope`'s form;
    layers with the same rotary embedding share one pair (the same tensors).
    """
    pos = positions if positions.dim() == 2 else positions[None]
    made: dict[str | None, Rope] = {}
    for kind in family.kinds:
        if kind.rope not in made:
            made[kind.rope] = family.full_width(family.rope(model, kind.rope, like, pos))
    return [made[kind.rope] for kind in family.kinds]


def unapply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (divides out ``attention_scaling``, since cos² + sin² = scale²)."""
    cos, sin = cos[:, None].to(torch.float32), sin[:, None].to(torch.float32)
    rot = cos.shape[-1]
    k_rot, k_pass = k[..., :rot].to(torch.float32), k[..., rot:]
    scale_sq = cos * cos + sin * sin
    out = ((k_rot * cos - rotate_half(k_rot) * sin) / scale_sq).to(k.dtype)
    return torch.cat((out, k_pass), dim=-1) if k_pass.shape[-1] else out


def _by_rope(ropes: list[Rope]) -> list[tuple[list[int], Rope]]:
    """The layers of each distinct ``(cos, sin)`` pair in ``ropes`` (pairs told apart by identity)."""
    groups: dict[int, tuple[list[int], Rope]] = {}
    for idx, rope in enumerate(ropes):
        groups.setdefault(id(rope[0]), ([], rope))[0].append(idx)
    return list(groups.values())


def rotate_layers(keys: torch.Tensor, ropes: list[Rope], inverse: bool = False) -> torch.Tensor:
    """Keys of every layer ``[L, H, n, D]`` rotated by their layer's ``(cos, sin)`` ``[1, n, R]`` from
    `layer_ropes` (un-rotated with ``inverse``); one call where every layer shares one pair.
    """
    groups = _by_rope(ropes)
    turn = unapply_rope if inverse else apply_rope
    if len(groups) == 1:
        return turn(keys, *groups[0][1])
    out = torch.empty_like(keys)
    for layers, (cos, sin) in groups:
        index = torch.tensor(layers, device=keys.device)
        out[index] = turn(keys[index], cos, sin)
    return out


def _check_rope_is_pointwise(model: Any, family: Family, device: torch.device) -> None:
    """cos/sin at a position must not depend on the other positions in the same call."""
    probe = torch.zeros(1, 1, device=device)
    far = torch.cat([torch.arange(8), torch.tensor([family.far_position()])]).to(device)
    for key in {kind.rope for kind in family.kinds}:
        alone = family.rope(model, key, probe, torch.arange(8, device=device)[None])[0]
        mixed = family.rope(model, key, probe, far[None])[0][:, :8]
        if not torch.allclose(alone.float(), mixed.float(), atol=1e-5):
            raise UnsupportedModelError(
                "the model's rotary embedding changes with the positions in the call (dynamic scaling), "
                "so cached keys cannot be moved to new positions"
            )


def check_rope(model: Any, offset: int | None = None) -> None:
    """Refuse models whose keys cannot be moved to new positions (`UnsupportedModelError`, one line).

    Checks the family's refusal (e.g. a RoPE type that depends on the sequence length), that cos/sin at a
    position do not depend on the other positions of the call, and that layer-0 keys computed at ``offset``
    equal keys computed at 0, un-rotated and re-rotated at ``offset``.
    """
    family = family_of(model.config)
    reason = family.refusal()
    if reason is not None:
        raise UnsupportedModelError(reason)
    device = next(model.parameters()).device
    _check_rope_is_pointwise(model, family, device)
    ids = torch.arange(1, 9, device=device)[None] % model.config.vocab_size
    offset = offset if offset is not None else min(1000, model.config.max_position_embeddings // 2)
    k0 = hf_compat.first_layer_keys(model, ids, torch.arange(8, device=device)[None])
    k1 = hf_compat.first_layer_keys(model, ids, torch.arange(offset, offset + 8, device=device)[None])
    cos0, sin0 = rope_at(model, torch.arange(8, device=device), k0)
    cos1, sin1 = rope_at(model, torch.arange(offset, offset + 8, device=device), k0)
    moved = apply_rope(unapply_rope(k0, cos0, sin0), cos1, sin1)
    tol = 1e-3 if k0.dtype == torch.float32 else 5e-2
    err = (moved.float() - k1.float()).abs().max().item() / max(1.0, k1.float().abs().max().item())
    if err > tol:
        raise UnsupportedModelError(
            f"re-rotated keys differ from keys computed at position {offset} (relative error "
            f"{err:.2e} > {tol}); this model's position encoding is not supported"
        )
