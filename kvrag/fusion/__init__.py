"""Fusion: turn the prompt's stored chunk caches into one cache with a selective recompute.

Modules, one responsibility each:

- `inputs`: `FusionInput`, its layout (`Segments`, `segments`) and `FusionResult`;
- `selectors`: which positions are recomputed, one `Selector` class per mode, registered by name
  (`register_selector`, `make_selector`, `available_modes`); `FixedSelector` for positions chosen
  outside fusion;
- `placement`: the full cache, prefix and stored chunk rows placed at their positions;
- `attention`: how the selection attends in a layer (blocks, masks, kernel choice), through
  `kernel_mask` masks that run their own kernel: `scatter_attention` (FlexAttention, CUDA),
  `tiled_attention` (unmasked and masked tiles, CPU), `recorded_attention` (a probe pass's layer output and
  the question's reading from the same products);
- `scores`: K/V deviation and the question's attention, which selectors rank by;
- `loop`: `fuse`, the layer loop that runs the model's decoder layers on the selected positions only.

The names below load on first use, so that `kvrag.config` can validate a mode against the
registry without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.lazy import lazy_exports

if TYPE_CHECKING:
    from kvrag.fusion.inputs import FusionInput, FusionResult
    from kvrag.fusion.loop import fuse
    from kvrag.fusion.selectors import (
        Selector,
        available_modes,
        exact_mode,
        make_selector,
        register_selector,
        selector_class,
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
    "exact_mode": "kvrag.fusion.selectors",
    "selector_class": "kvrag.fusion.selectors",
    "make_selector": "kvrag.fusion.selectors",
    "register_selector": "kvrag.fusion.selectors",
    "unregister_selector": "kvrag.fusion.selectors",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "FixedSelector", "FusionInput", "FusionResult", "Selector", "available_modes", "exact_mode", "fuse",
    "make_selector", "register_selector", "selector_class", "unregister_selector",
]
