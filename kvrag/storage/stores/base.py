"""The byte-store interface and the name-keyed factory that builds stores.

Contract:

- A `ByteStore` holds keyed blobs; keys are lowercase hex content hashes. ``open`` returns a readable,
  seekable binary file or None when the key is absent; ``put`` replaces a blob whole; ``delete`` of an
  absent key is not an error.
- Store classes register under a name and any aliases with `register_store`; `make_store` builds one
  by name, by ``name://location`` URL or from a plain filesystem path (the ``file`` store), taking the
  fields of `kvrag.config.StoreConfig`: ``make_store(config.backend, root, fsync=config.fsync)``.
- `available_stores` lists every name `make_store` accepts. The stores shipped with kvrag register
  when `kvrag.storage.stores` is imported.
"""

from __future__ import annotations

import io
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

log = logging.getLogger(__name__)

S = TypeVar("S", bound="type[ByteStore]")

_REGISTRY: dict[str, type[ByteStore]] = {}
_PATH_STORE = "file"  # the store a plain path or a ``file://`` URL names


class ByteStore(ABC):
    """Keyed blobs. Keys are hex content hashes.

    Attributes:
        name: the name the class is registered under (`register_store`), empty when unregistered.
    """

    name: str = ""

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> ByteStore:
        """Build the store `make_store` asks for.

        The default builds ``cls(**options)`` and ignores ``root`` and ``fsync``: right for stores that
        keep nothing on disk. Stores with a location or durability choice override it.

        Args:
            root: the directory (or location) the store lives in, when one was given.
            fsync: whether writes are flushed to stable storage before they return.
            **options: store-specific settings.

        Returns:
            The new store.
        """
        return cls(**options)

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any previous blob."""

    @abstractmethod
    def open(self, key: str) -> BinaryIO | None:
        """A readable binary file for ``key``, or None when absent."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``'s blob if present."""

    def nbytes(self, key: str) -> int:
        """Size of ``key``'s blob in bytes (0 when absent)."""
        fh = self.open(key)
        if fh is None:
            return 0
        with fh:
            return fh.seek(0, io.SEEK_END)

    def close(self) -> None:
        """Release resources."""


def register_store(name: str, *aliases: str) -> Callable[[S], S]:
    """Class decorator that makes a `ByteStore` available to `make_store` under ``name`` and ``aliases``.

    Args:
        name: the canonical name, also accepted as a URL scheme (``name://...``).
        *aliases: further names for the same class.

    Returns:
        The decorator; it sets the class's ``name`` and returns the class unchanged otherwise.

    Raises:
        ValueError: a name is already taken by another class, or is not a valid URL scheme.
    """

    def wrap(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, ByteStore)):
            raise TypeError(f"register_store expects a ByteStore subclass, got {cls!r}")
        for key in (name, *aliases):
            if not key or not key[0].isalpha() or not all(c.isalnum() or c in "+-." for c in key):
                raise ValueError(f"store name {key!r} is not a valid URL scheme")
            taken = _REGISTRY.get(key.lower())
            if taken is not None and taken is not cls:
                raise ValueError(f"store name {key!r} is already registered by {taken.__name__}")
            _REGISTRY[key.lower()] = cls
        cls.name = name
        return cls

    return wrap


def available_stores() -> list[str]:
    """Names (and aliases) accepted by `make_store`, sorted."""
    return sorted(_REGISTRY)


def _looks_like_path(text: str) -> bool:
    return os.path.isabs(text) or text.startswith((".", "~")) or "/" in text or os.sep in text


def _from_url(url: str) -> tuple[str, Path | None]:
    """``(store name, root)`` of a ``name://location`` URL; ``file:///abs/path`` names the path."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _REGISTRY:
        raise ValueError(f"unknown store URL scheme {parts.scheme!r} in {url!r}; available: {available_stores()}")
    if parts.query or parts.fragment:
        raise ValueError(f"store URL {url!r}: queries and fragments are not supported")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"store URL {url!r} names host {parts.netloc!r}; only local locations are supported")
    if not parts.path:
        return scheme, None
    path = Path(url2pathname(unquote(parts.path)))
    if not path.is_absolute():
        raise ValueError(f"store URL {url!r} must hold an absolute path (file:///abs/path)")
    return scheme, path


def _resolve(backend: str | os.PathLike[str], root: str | os.PathLike[str] | None) -> tuple[str, Path | None]:
    """``(registered name, root)`` for `make_store`'s ``backend`` and ``root`` arguments."""
    located: Path | None = None
    if isinstance(backend, os.PathLike):
        name, located = _PATH_STORE, Path(backend)
    elif "://" in backend:
        name, located = _from_url(backend)
    elif backend.lower() in _REGISTRY:
        name = backend.lower()
    elif _looks_like_path(backend):
        name, located = _PATH_STORE, Path(backend).expanduser()
    else:
        raise ValueError(f"unknown store backend {backend!r}; expected one of {available_stores()}, "
                         "a file:///abs/path URL or a path")
    if located is not None and root is not None:
        raise ValueError(f"store {str(backend)!r} already names its location; got root={str(root)!r} as well")
    if located is None and root is not None:
        located = Path(root)
    return name, located


def make_store(backend: str | os.PathLike[str], root: str | os.PathLike[str] | None = None, fsync: bool = True,
               **options: Any) -> ByteStore:
    """Build a byte store by name, URL or path.

    Takes the fields of `kvrag.config.StoreConfig`, e.g. ``make_store(config.backend, root,
    fsync=config.fsync)``.

    Args:
        backend: a registered name (`available_stores`: ``file`` alias ``disk``, ``memory``,
            ``throttled``, ...), a URL ``name://location`` (``file:///abs/path``, ``memory://``), or a
            path: absolute, or starting with ``.`` or ``~``, or containing a separator (the ``file``
            store rooted there). A bare word that is no registered name is refused, not taken as a path.
        root: the store's directory, for a backend given by name.
        fsync: whether writes are flushed to stable storage before they return.
        **options: store-specific settings (``throttled``: ``bytes_per_s``, ``inner``).

    Returns:
        The new store.

    Raises:
        ValueError: an unknown name or scheme, a location given twice, or a store that needs a root
            given none.

    Example:
        >>> make_store("memory").contains("ab")
        False
    """
    name, located = _resolve(backend, root)
    store = _REGISTRY[name].create(located, fsync=fsync, **options)
    log.debug("opened %s store at %s", name, located)
    return store
