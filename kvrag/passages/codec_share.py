"""A codec's fitted state kept once per model in a passage cache's store, shared by every process using it.

Contract: a state is named by `kvrag.storage.shared_state.state_name` (the codec and the model).

- `load_shared_state` loads the stored state into ``codec`` and returns its digest, or None when none is stored
  yet (or the codec needs no fitting: its digest is then ``"none"``).
- `publish_state` stores the state ``codec`` was just fitted with, unless another process stored one first, and
  loads whichever is stored, so that every writer codes with the same state; it returns that state's digest.
- The state travels as one zip of the files `Codec.save_state` writes (each with its CRC); the digest (sha256 of
  the zip) goes into every passage key, so a refitted state never decodes another's blobs. The store is an
  `LRUDiskStore` or `LRURedisStore` (``get_state``/``put_state``, outside the byte bound).
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from kvrag.codec import Codec
from kvrag.storage.shared_state import state_name


def _bundle(codec: Codec) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        codec.save_state(Path(folder))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
            for path in sorted(Path(folder).iterdir()):
                bundle.write(path, path.name)
        return out.getvalue()


def _unbundle(codec: Codec, data: bytes) -> str:
    """Load the zipped state into ``codec`` (zip CRCs and the codec's own checks); its digest."""
    with tempfile.TemporaryDirectory() as folder, zipfile.ZipFile(io.BytesIO(data)) as bundle:
        for name in bundle.namelist():
            if "/" in name or name.startswith("."):
                raise ValueError(f"a codec state holds an unexpected file {name!r}")
            (Path(folder) / name).write_bytes(bundle.read(name))  # read() checks the CRC
        codec.load_state(Path(folder))
    return hashlib.sha256(data).hexdigest()[:16]


def load_shared_state(store: Any, codec: Codec, fingerprint: str) -> str | None:
    """Load the stored state into ``codec``; its digest, ``"none"`` for a codec without state, None if not stored."""
    if not codec.needs_fit:
        return "none"
    data = store.get_state(state_name(codec, fingerprint))
    return None if data is None else _unbundle(codec, data)


def publish_state(store: Any, codec: Codec, fingerprint: str) -> str:
    """Store ``codec``'s fitted state unless one is stored already, then load the stored one; its digest."""
    stored = store.put_state(state_name(codec, fingerprint), _bundle(codec))
    return _unbundle(codec, stored)
