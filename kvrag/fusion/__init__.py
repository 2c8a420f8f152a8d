"""Fusion: turn the prompt's stored chunk caches into one cache with a selective recompute.

Modules, one responsibility each:

- `inputs`: `FusionInput`, its layout (`Segments`, `segments`) and `FusionResult`;
- `selectors`: which positions are recomputed, one `Selector` class per mode, registered by name
  (`register_selector`, `make_selector`, `available_modes`); `FixedSelector` for positions chosen
  outside fusion;
- `placement`: the full cache, prefix and stored chunk rows placed at their positions;
- `attention`: how the selection attends in a layer (blocks, masks, kernel choice);
  `scatter_attention`: the FlexAttention path;
- `scores`: K/V deviation and the question's attention, which selectors rank by;
- `loop`: `fuse`, the layer loop that runs the model's decoder layers on the selected positions only.

The names below load on first use, so that `kvrag.config` can validate a mode against the
registry without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrag.fusion.inputs import FusionInput, FusionResult
    from kvrag.fusion.loop import fuse
    from kvrag.fusion.selectors import (
        Selector,
        available_modes,
        make_selector,
        register_selector,
        unregister_selector,
    )
    from kvrag.fusion.selectors.fixed import FixedSelector

_LAZY = {
    "fuse": "kvrag.fusion.loop",
    "FusionInput": "kvrag.fusion.inputs",
    "FusionResult": "kvrag.fusion.inputs",
    "Selector": "kvrag.fusion.selectors",
    "FixedSelector": "kvrag.fusion.selectors.fixed",
    "available_modes": "kvrag.fusion.selectors",
    "make_selector": "kvrag.fusion.selectors",
    "register_selector": "kvrag.fusion.selectors",
    "unregister_selector": "kvrag.fusion.selectors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvrag.fusion' has no attribute {name!r}")


__all__ = [
    "FixedSelector", "FusionInput", "FusionResult", "Selector", "available_modes", "fuse", "make_selector",
    "register_selector", "unregister_selector",
]
