"""`IndexLayout`: the files of an index folder, named in this one place.

Contract: an index folder holds

- ``manifest.json``: the model, codec, prompt layout and build settings, with its checksum;
- ``chunks.sqlite``: the chunk rows (texts, token counts, store keys, digests) and a copy of the manifest;
- ``vectors.faiss``: the embeddings, FAISS row ``i`` being chunk row ``i``;
- ``index.lock``: the lock writers of the chunk rows and vectors hold (``flock``);
- ``writer.lock``: one writer per index (build, add, repair): a second one waits for the first;
- ``codec/``: the fitted codec state, with a ``fitted`` marker once a build finished fitting it;
- ``chunks/``: the chunk caches of the default local store (``chunks/<2 hex>/<key>.kvc``).

Every module that builds, opens, verifies, repairs or measures an index asks an `IndexLayout` for these paths.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvrag.atomic_files import exclusive_lock


@dataclass(frozen=True)
class IndexLayout:
    """The paths of the index folder ``root``."""

    root: Path

    MANIFEST: ClassVar[str] = "manifest.json"
    DB: ClassVar[str] = "chunks.sqlite"
    VECTORS: ClassVar[str] = "vectors.faiss"
    INDEX_LOCK: ClassVar[str] = "index.lock"
    WRITER_LOCK: ClassVar[str] = "writer.lock"
    CODEC: ClassVar[str] = "codec"
    FITTED: ClassVar[str] = "fitted"
    CHUNKS: ClassVar[str] = "chunks"

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> IndexLayout:
        """The layout of the index folder ``path``."""
        return cls(Path(path))

    @property
    def manifest(self) -> Path:
        """``manifest.json``."""
        return self.root / self.MANIFEST

    @property
    def db(self) -> Path:
        """``chunks.sqlite``."""
        return self.root / self.DB

    @property
    def vectors(self) -> Path:
        """``vectors.faiss``."""
        return self.root / self.VECTORS

    @property
    def index_lock(self) -> Path:
        """``index.lock``."""
        return self.root / self.INDEX_LOCK

    @property
    def codec_state(self) -> Path:
        """The folder of the fitted codec state."""
        return self.root / self.CODEC

    @property
    def fitted_marker(self) -> Path:
        """Written once a build has finished fitting the codec state."""
        return self.codec_state / self.FITTED

    @property
    def chunks(self) -> Path:
        """The default local store's folder of chunk caches."""
        return self.root / self.CHUNKS

    def has_blobs(self) -> bool:
        """Whether the local store holds any chunk cache."""
        return next(self.chunks.glob("*/*.kvc"), None) is not None

    @contextlib.contextmanager
    def writer_lock(self) -> Iterator[None]:
        """Hold the index's writer lock: a second writer waits until the first ends."""
        with exclusive_lock(self.root / self.WRITER_LOCK):
            yield
