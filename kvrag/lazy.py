"""Names a package exports without importing the modules that define them until first use.

A package whose modules pull in torch, transformers or a web framework lists its exports as
``{name: module}`` and sets ``__getattr__ = lazy_exports(__name__, exports)`` (PEP 562): importing the package
stays cheap, and ``package.Name`` imports ``module`` the first time it is read. The name is then set on the
package, so later reads (a codec's kernels, read once per chunk and layer) are plain attribute lookups.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that reads each name of ``exports`` from its module."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
