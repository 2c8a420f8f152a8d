"""An index's fitted codec state: loaded for opening, verifying and repairing it, and marked once fitted.

Contract: `load_codec_state` raises `IndexCorruptError` for a damaged state; a state that is missing or
half-written while no chunk cache is stored is no error (a build was killed before its first cache, and the next
build fits it again). `mark_fitted` records that a build finished fitting the state; `codec_ready` says whether a
build may store caches with the codec (it needs no fitting, or its state is fitted or marked so).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvrag.errors import IndexCorruptError
from kvrag.storage.index_layout import IndexLayout

log = logging.getLogger(__name__)


def load_codec_state(codec: Any, path: Path) -> None:
    """Load the fitted state of ``codec`` from the index at ``path`` (its `IndexLayout.codec_state`)."""
    layout = IndexLayout.of(path)
    state_dir = layout.codec_state
    present = state_dir.is_dir() and any(state_dir.iterdir())
    if not present:
        if layout.has_blobs():
            raise IndexCorruptError(state_dir, "is missing, but chunk caches coded with it are stored", path)
        return
    try:
        codec.load_state(state_dir)
    except (ValueError, OSError) as exc:
        if not layout.has_blobs() and not layout.fitted_marker.is_file():
            log.info("codec state in %s was not finished (%s); the next build fits it again", state_dir, exc)
            return
        raise IndexCorruptError(state_dir, f"is damaged: {str(exc).splitlines()[0]}", path) from None


def mark_fitted(state_dir: Path) -> None:
    """Record that the codec state in ``state_dir`` is fitted (`IndexLayout.FITTED`)."""
    (state_dir / IndexLayout.FITTED).touch()


def codec_ready(codec: Any, state_dir: Path) -> bool:
    """Whether ``codec`` needs no fitting, or its state in ``state_dir`` is fitted (or marked so)."""
    return not codec.needs_fit or bool(getattr(codec, "fitted", (state_dir / IndexLayout.FITTED).is_file()))
