"""An index's fitted codec state: loaded for opening, verifying and repairing it, saved and marked once fitted.

Contract: an index keeps its codec state in its ``codec/`` folder (`IndexLayout.codec_state`), or, when its
manifest says ``codec.state == "shared"`` (the default for new indexes), references there the model's state
shared in the user's cache folder (`kvrag.storage.shared_state`; states no index references any more are removed
after each fit). `load_codec_state` raises `IndexCorruptError`
for a damaged state, or a shared one that is missing or changed (`kvrag repair` fits it again and recomputes the
caches); a state that is missing or half-written while no chunk cache is stored is no error (a build was killed
before its first cache, and the next build fits it again). `save_fitted` saves a state just fitted where the index
keeps it (each index fits its own: a state fitted on other text coded `examples/docs` 11 % larger and changed its
demo answer), and
`mark_fitted` records that a build finished fitting it; `codec_ready` says whether a build may store caches with
the codec (it needs no fitting, or its state is fitted or marked so).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvrag.errors import IndexCorruptError
from kvrag.storage import shared_state
from kvrag.storage.index_layout import IndexLayout

log = logging.getLogger(__name__)

SHARED, IN_INDEX = "shared", "index"  # where an index keeps its codec state (its manifest's ``codec.state``)


def state_kept(manifest: dict[str, Any]) -> str:
    """Where the index with ``manifest`` keeps its codec state: `SHARED` or `IN_INDEX` (indexes from before)."""
    return SHARED if (manifest.get("codec") or {}).get("state") == SHARED else IN_INDEX


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
        ref = shared_state.read_ref(state_dir)
        if ref is not None:
            shared_state.load(codec, *ref)
            shared_state.note_user(state_dir, *ref)  # (indexes built before users were recorded)
            return
        codec.load_state(state_dir)
    except (ValueError, OSError) as exc:
        if not layout.has_blobs() and not layout.fitted_marker.is_file():
            log.info("codec state in %s was not finished (%s); the next build fits it again", state_dir, exc)
            return
        raise IndexCorruptError(state_dir, f"is damaged: {str(exc).splitlines()[0]}", path) from None


def save_fitted(codec: Any, state_dir: Path, fingerprint: str, kept: str) -> None:
    """Save the state ``codec`` was just fitted with where the index keeps it (``kept``: `SHARED` or `IN_INDEX`)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if kept == SHARED:
        digest = shared_state.publish(codec, fingerprint)
        shared_state.write_ref(state_dir, shared_state.state_name(codec, fingerprint), digest)
        shared_state.collect()  # states that deleted or refitted indexes left behind
    else:
        codec.save_state(state_dir)


def mark_fitted(state_dir: Path) -> None:
    """Record that the codec state in ``state_dir`` is fitted (`IndexLayout.FITTED`)."""
    (state_dir / IndexLayout.FITTED).touch()


def codec_ready(codec: Any, state_dir: Path) -> bool:
    """Whether ``codec`` needs no fitting, or its state in ``state_dir`` is fitted (or marked so)."""
    return not codec.needs_fit or bool(getattr(codec, "fitted", (state_dir / IndexLayout.FITTED).is_file()))
