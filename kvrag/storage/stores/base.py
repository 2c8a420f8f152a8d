"""The byte-store interface and the name-keyed factory that builds stores.

Contract:

- A `ByteStore` holds keyed blobs; keys are lowercase hex content hashes. ``open`` returns a readable,
  seekable binary file or None when the key is absent; ``put`` replaces a blob whole; ``delete`` of an
  absent key is not an error.
- ``open`` raises `kvrag.errors.StoreUnavailableError` when the store cannot be reached (a network
  store): "absent because unreachable" is never answered as "absent".
- Store classes register under a name and any aliases with `register_store`; `make_store` builds one
  by name, by ``name://location?option=value`` URL or from a plain filesystem path (the ``file`` store),
  taking the fields of `kvrag.config.StoreConfig`: ``make_store(config.backend, root, fsync=config.fsync)``.
  A class that sets ``network = True`` takes a network location: ``make_store("redis://host:6379/0")``
  builds it with the whole URL as its ``url`` option; other stores take only local locations.
- A URL's query options are the store class's own (`ByteStore.url_options`, `kvrag.storage.stores.store_url`):
  one it does not take is refused in one line. ``max_bytes`` (in the URL or as a keyword) bounds a store that
  has a bounded kind (`ByteStore.bounded`: ``file`` → ``bounded-file``, ``redis`` → ``bounded-redis``), blobs not
  read since stored evicted first (a segmented LRU).
- `available_stores` lists every name `make_store` accepts; `store_class` looks one up; `network_class`
  says whether a URL names a network store. The stores shipped with kvrag register when
  `kvrag.storage.stores` is imported.
- `LinkMeter`: a store that reads over a link (``meter`` not None) records each read's bytes and seconds
  there; its recent throughput is what the streaming loader plans with (`kvrag.query.plan`).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from kvrag.sizes import parse_bytes
from kvrag.storage.stores.store_url import split_url_options

log = logging.getLogger(__name__)

S = TypeVar("S", bound="type[ByteStore]")

_REGISTRY: dict[str, type[ByteStore]] = {}
_PATH_STORE = "file"  # the store a plain path or a ``file://`` URL names


class LinkMeter:
    """The bytes and seconds of a store's recent reads over its link (thread-safe).

    Args:
        window: how many recent reads `bytes_per_s` sums over.
    """

    def __init__(self, window: int = 16) -> None:
        self._reads: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.total_bytes, self.total_s = 0, 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        """One read of ``nbytes`` that took ``seconds`` on the link."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._reads.append((int(nbytes), float(seconds)))
            self.total_bytes += int(nbytes)
            self.total_s += float(seconds)

    @property
    def bytes_per_s(self) -> float | None:
        """Bytes per second over the recent reads, or None before any."""
        with self._lock:
            seconds = sum(s for _, s in self._reads)
            return sum(n for n, _ in self._reads) / seconds if seconds > 0 else None

    def reset(self) -> None:
        """Forget every read (e.g. after the link changed)."""
        with self._lock:
            self._reads.clear()


class ByteStore(ABC):
    """Keyed blobs. Keys are hex content hashes.

    Attributes:
        name: the name the class is registered under (`register_store`), empty when unregistered.
        network: whether the store lives at a network location named by its URL (``redis://host:port/db``);
            `make_store` then hands it the whole URL as ``url=``.
        meter: the `LinkMeter` of a store read over a link, None for local stores.
        url_options: the query options the store's URL may carry, each with its parser (`store_url`).
        bounded: the registered name of the store a ``max_bytes`` bound opens instead (blobs not read since stored
            evicted), empty when the store has no bounded kind.
    """

    name: str = ""
    network: bool = False
    meter: LinkMeter | None = None
    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {}
    bounded: ClassVar[str] = ""

    @classmethod
    def client_url_options(cls) -> Collection[str]:
        """The URL query options left in the URL for the store's client library (none by default)."""
        return ()

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

    def touch(self, key: str) -> None:
        """Count a use of ``key``'s blob, where the store evicts by use (a read served from memory, never opened
        here); nothing elsewhere or when it is absent.
        """

    def peek(self, key: str) -> BinaryIO | None:
        """`open`, not counted as a use where the store evicts by use (a blob read back right after it was
        stored, to keep it decoded in memory, has not been asked for again).
        """
        return self.open(key)

    def nbytes(self, key: str) -> int:
        """Size of ``key``'s blob in bytes (0 when absent); not a use of it."""
        fh = self.open(key)
        if fh is None:
            return 0
        with fh:
            return fh.seek(0, io.SEEK_END)

    def sizes(self, keys: Iterable[str]) -> list[int]:
        """`nbytes` of each key, in order (a network store asks for all of them in one round trip)."""
        return [self.nbytes(key) for key in keys]

    def keys(self) -> Iterator[str]:
        """Every key held (a network store: those under its namespace). Stores that cannot list raise
        NotImplementedError.
        """
        raise NotImplementedError(f"the {self.name or type(self).__name__!r} store cannot list its keys")

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


def store_class(name: str) -> type[ByteStore]:
    """The store class registered under ``name`` (a name, alias or URL scheme; any case).

    Raises:
        ValueError: no store is registered under it.
    """
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown store {name!r}; available: {available_stores()}")
    return cls


def network_class(url: str) -> type[ByteStore] | None:
    """The registered network store class (``network = True``) a ``scheme://...`` URL names, else None."""
    if "://" not in url:
        return None
    cls = _REGISTRY.get(urlsplit(url).scheme.lower())
    return cls if cls is not None and cls.network else None


def _looks_like_path(text: str) -> bool:
    return os.path.isabs(text) or text.startswith((".", "~")) or "/" in text or os.sep in text


def _from_url(url: str) -> tuple[str, Path | None]:
    """``(store name, root)`` of a ``name://location`` URL (its query already taken out); ``file:///abs/path``
    names the path.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.fragment:
        raise ValueError(f"store URL {url!r}: fragments are not supported")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"store URL {url!r} names host {parts.netloc!r}; the {scheme!r} store takes only local "
                         "locations")
    if not parts.path:
        return scheme, None
    path = Path(url2pathname(unquote(parts.path)))
    if not path.is_absolute():
        raise ValueError(f"store URL {url!r} must hold an absolute path (file:///abs/path)")
    return scheme, path


def _url_class(url: str) -> type[ByteStore]:
    """The store class a ``scheme://...`` URL names."""
    cls = _REGISTRY.get(urlsplit(url).scheme.lower())
    if cls is None:
        raise ValueError(f"unknown store URL scheme {urlsplit(url).scheme!r} in {url!r}; available: "
                         f"{available_stores()}")
    return cls


def _bounded(cls: type[ByteStore], max_bytes: int | str | None) -> tuple[type[ByteStore], dict[str, int]]:
    """The class to build and its ``max_bytes`` option: ``cls`` unbounded, or its bounded kind."""
    if max_bytes is None:
        return cls, {}
    if not cls.bounded:
        raise ValueError(f"the {cls.name!r} store has no bound in bytes (max_bytes); stores that have one: "
                         f"{sorted(n for n, c in _REGISTRY.items() if c.bounded)}")
    return _REGISTRY[cls.bounded], {"max_bytes": parse_bytes(max_bytes)}


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
            ``throttled``, ``redis``, ...), a URL ``name://location`` (``file:///abs/path``, ``memory://``;
            a network store's ``redis://host:6379/0``, given to it whole as ``url=``), or a
            path: absolute, or starting with ``.`` or ``~``, or containing a separator (the ``file``
            store rooted there). A bare word that is no registered name is refused, not taken as a path.
        root: the store's directory, for a backend given by name.
        fsync: whether writes are flushed to stable storage before they return.
        **options: store-specific settings (``throttled``: ``bytes_per_s``, ``inner``; ``redis``:
            ``namespace``, timeouts); they override the URL's options of the same name. ``max_bytes``
            (bytes or a size such as ``"5GB"``; None: none) opens the store's bounded kind (`ByteStore.bounded`).

    Returns:
        The new store.

    Raises:
        ValueError: an unknown name or scheme, a URL option the store does not take, a bound on a store that
            has none, a location given twice, or a store that needs a root given none.

    Example:
        >>> make_store("memory").contains("ab")
        False
    """
    max_bytes = options.pop("max_bytes", None)
    if isinstance(backend, str) and "://" in backend:  # its query options are the store class's own
        backend, given = split_url_options(backend, _url_class(backend))
        in_url = given.pop("max_bytes", None)
        max_bytes, options = in_url if max_bytes is None else max_bytes, {**given, **options}
    network = network_class(backend) if isinstance(backend, str) else None
    if network is not None:  # the whole URL is its location (host, port, database, credentials)
        if root is not None:
            raise ValueError(f"the {network.name!r} store is located by its URL; got root={str(root)!r} as well")
        cls, bound = _bounded(network, max_bytes)
        store = cls.create(None, fsync=fsync, url=backend, **options, **bound)
        log.debug("opened %s store", cls.name)
        return store
    name, located = _resolve(backend, root)
    cls, bound = _bounded(_REGISTRY[name], max_bytes)
    store = cls.create(located, fsync=fsync, **options, **bound)
    log.debug("opened %s store at %s", cls.name, located)
    return store
