"""Selectors: which positions a fusion recomputes, one class per mode, registered by name.

Importing this package registers the built-in modes, in this order: ``full``, ``prefix``, ``reuse``,
``cacheblend``, ``attnlink``, ``probe``. A new mode is one module with a `Selector` subclass
decorated with `register_selector` (see CONTRIBUTING.md). `FixedSelector` (positions chosen
outside fusion) lives in `kvrag.fusion.selectors.fixed` and is not a mode.

Nothing imported here loads torch (see `kvrag.fusion.selectors.base`).
"""

from kvrag.fusion.selectors.base import (
    Selector,
    available_modes,
    exact_mode,
    make_selector,
    register_selector,
    selector_class,
    unregister_selector,
)

# the built-in modes register on import; the order here is `available_modes`' order
# isort: off
from kvrag.fusion.selectors.full import FullSelector
from kvrag.fusion.selectors.prefix import PrefixSelector
from kvrag.fusion.selectors.reuse import ReuseSelector
from kvrag.fusion.selectors.cacheblend import CacheBlendSelector
from kvrag.fusion.selectors.attnlink import AttnLinkSelector
from kvrag.fusion.selectors.probe import ProbeSelector
# isort: on

__all__ = [
    "AttnLinkSelector", "CacheBlendSelector", "FullSelector", "PrefixSelector", "ProbeSelector",
    "ReuseSelector", "Selector", "available_modes", "exact_mode", "make_selector", "register_selector",
    "selector_class", "unregister_selector",
]
