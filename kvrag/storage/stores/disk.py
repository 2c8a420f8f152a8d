"""The ``file`` store (alias ``disk``): one file per blob under a root directory.

Contract: blob ``abcdef…`` lives at ``root/ab/abcdef….kvc``; every write is atomic
(`kvrag.storage.atomic.atomic_write_bytes`), so a reader sees the old blob or the new one, never a mix,
and with ``fsync`` it survives a power loss once ``put`` returns. Keys must be lowercase hex.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from kvrag.storage.atomic import atomic_write_bytes
from kvrag.storage.stores.base import ByteStore, register_store


@register_store("file", "disk")
class DiskStore(ByteStore):
    """One file per chunk under ``root/ab/abcdef….kvc``, written atomically."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> DiskStore:
        """A disk store rooted at ``root`` (created if missing); it takes no other options."""
        if root is None:
            raise ValueError(f"the {cls.name!r} store needs a root directory")
        if options:
            raise TypeError(f"the {cls.name!r} store takes no options, got {sorted(options)}")
        return cls(root, fsync=fsync)

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"chunk key must be lowercase hex, got {key!r}")
        return self.root / key[:2] / f"{key}.kvc"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(path, data, fsync=self.fsync)

    def open(self, key: str) -> BinaryIO | None:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
