"""kvrag's folder in the user's cache: where what belongs to a model, not to one index, is kept.

Contract: `default_cache_dir()` is ``$KVRAG_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvrag``, else
``~/.cache/kvrag``; it is read at each call (nothing is created here). Under it live the codec states shared by
a model's indexes and passage caches (``codec-states/``) and the default passage cache (``passages/``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "KVRAG_CACHE_DIR"


def default_cache_dir() -> Path:
    """Kvrag's folder in the user's cache (see the module contract)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "kvrag"
