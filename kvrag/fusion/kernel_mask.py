"""`KernelMask`: an attention mask that stands for a whole attention kernel.

A decoder layer hands its ``attention_mask`` to ``scaled_dot_product_attention``. A stand-in is an empty tensor
of a subclass that intercepts that call and runs its own kernel instead (`attend`), so a layer's own forward,
which knows nothing of it, runs that kernel unchanged. `kvrag.fusion.scatter_attention.ScatterBias` (FlexAttention)
and `kvrag.fusion.tiled_attention.SortedCausalBias` (tiles on the CPU) are stand-ins.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.nn.functional as F

_KernelMask = TypeVar("_KernelMask", bound="KernelMask")


class KernelMask(torch.Tensor):
    """An empty tensor on ``device`` whose SDPA call runs `attend`; subclasses set what it needs in ``__init__``."""

    def __new__(cls: type[_KernelMask], device: torch.device, *args: Any) -> _KernelMask:
        """An empty tensor of this class on ``device`` (``args``: what ``__init__`` takes)."""
        return torch.Tensor._make_subclass(cls, torch.empty(0, device=device), False)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """The attention ``[1, Hq, n, D]`` the stand-in means (``key``/``value`` may carry the query heads)."""
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _intercept(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _intercept(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: KernelMask,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    if dropout_p or is_causal:
        raise ValueError(f"a {type(attn_mask).__name__} stands for the whole mask: dropout and is_causal must be off")
    return attn_mask.attend(query, key, value, scale)
