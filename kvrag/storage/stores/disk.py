"""The ``file`` store (alias ``disk``): one file per blob under a root directory.

Contract: blob ``abcdef…`` lives at ``root/ab/abcdef….kvc``; every write is atomic
(`kvrag.storage.atomic.atomic_write_bytes`), so a reader sees the old blob or the new one, never a mix,
and with ``fsync`` it survives a power loss once ``put`` returns. Keys must be lowercase hex.
Symbolic links are never followed: a blob that is a link reads as absent (and a ``put`` replaces the
link, not its target), and a ``put`` into a folder that is a link raises `IndexCorruptError`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from kvrag.errors import IndexCorruptError
from kvrag.sizes import parse_bytes
from kvrag.storage.atomic import atomic_write_bytes
from kvrag.storage.stores.base import ByteStore, register_store


@register_store("file", "disk")
class DiskStore(ByteStore):
    """One file per chunk under ``root/ab/abcdef….kvc``, written atomically; ``?max_bytes=`` (a size) opens
    the bounded kind, ``bounded-file`` (`kvrag.storage.stores.bounded_disk.BoundedDiskStore`).
    """

    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {"max_bytes": parse_bytes}
    bounded: ClassVar[str] = "bounded-file"

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
        for folder in (self.root, path.parent):
            if folder.is_symlink():
                raise IndexCorruptError(folder, "is a link; kvrag does not write through links",
                                        fix=f"replace it with a real folder inside {self.root.parent}")
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(path, data, fsync=self.fsync)

    def open(self, key: str) -> BinaryIO | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # ELOOP: the blob is a link, which is never followed
            if self._path(key).is_symlink():
                return None
            raise exc
        return os.fdopen(fd, "rb")

    def contains(self, key: str) -> bool:
        path = self._path(key)
        return path.is_file() and not path.is_symlink()

    def nbytes(self, key: str) -> int:
        """The blob's size from its file's metadata (0 when absent or a link); not a read."""
        try:
            st = os.stat(self._path(key), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> Iterator[str]:
        """The keys of the blobs under the root (links and foreign files left out)."""
        if not self.root.is_dir():
            return iter(())
        hexdigits = frozenset("0123456789abcdef")
        return iter(sorted(p.stem for p in self.root.glob("*/*.kvc")
                           if hexdigits.issuperset(p.stem) and p.parent.name == p.stem[:2] and not p.is_symlink()))
