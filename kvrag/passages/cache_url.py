"""Where a passage cache lives: its URL parsed into a store bounded in bytes.

Contract: `open_cache_store(url)` builds the store a ``cache=`` argument names:

- None: `default_cache_dir` (``$KVRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrag``, else ``~/.cache/kvrag``) under
  ``passages/``, bounded by `DEFAULT_MAX_BYTES`;
- ``file:///abs/path?max_bytes=5GB`` or a plain path (absolute, or starting with ``~`` or ``.``): an
  `BoundedDiskStore` there;
- ``redis://[[USER]:PASSWORD@]HOST:PORT/DB?max_bytes=1GB`` (``rediss://`` over TLS): an `BoundedRedisStore`; its
  other query options are redis-py's connection options.

The store is opened by `kvrag.storage.stores.make_store`, with ``max_bytes`` and the store's own query options; an
option neither the cache nor the store takes is refused in one line.

``max_bytes`` takes bytes or a size with a unit (``kB``, ``MB``, ``GB``, ``TB``: powers of 1000; ``KiB``, ``MiB``,
``GiB``, ``TiB``: of 1024), `kvrag.sizes.parse_bytes`; the ``max_bytes`` argument, when given, overrides the URL's.
A bad URL or size raises ValueError in one line, before anything is created.

Two more options (any scheme) bound what the process keeps in memory, not the store (`memory_bound`; 0 turns each
off): ``decoded_bytes`` (e.g. ``file:///path?decoded_bytes=1GiB``) the tier of hot passage caches kept decoded
(default `kvrag.storage.decoded_tier.DEFAULT_DECODED_BYTES`), and ``prompt_bytes`` the whole prompts kept exact
(default `kvrag.query.head_cache.DEFAULT_PROMPT_BYTES`, `kvrag.query.head_cache.HeadCache.keep_prompt`).
``codec`` names the codec the caches are stored with (`url_codec`; e.g. ``?codec=cachegen``).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvrag.codec import available_codecs
from kvrag.query.head_cache import DEFAULT_PROMPT_BYTES
from kvrag.sizes import parse_bytes
from kvrag.storage.decoded_tier import DEFAULT_DECODED_BYTES
from kvrag.storage.stores import ByteStore, make_store, public_url
from kvrag.user_cache import default_cache_dir

DEFAULT_MAX_BYTES = 5 * 10**9
_CACHE_OPTIONS = ("decoded_bytes", "prompt_bytes", "codec")  # the cache's own; the store takes the rest
_MEMORY_DEFAULTS = {"decoded_bytes": DEFAULT_DECODED_BYTES, "prompt_bytes": DEFAULT_PROMPT_BYTES}


def _option(url: str | os.PathLike[str] | None, name: str) -> str | None:
    """The last value a cache URL's query gives ``name``, else None."""
    if url is None or "?" not in os.fspath(url):
        return None
    given = [v for k, v in parse_qsl(urlsplit(os.fspath(url)).query, keep_blank_values=True) if k == name]
    return given[-1] if given else None


def _without(url: str, names: tuple[str, ...]) -> str:
    """``url`` (``file://`` or ``redis://``) without the query options ``names``."""
    parts = urlsplit(url)
    kept = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in names])
    return urlunsplit(parts._replace(query=kept))


def memory_bound(url: str | os.PathLike[str] | None, name: str) -> int:
    """A cache URL's in-memory bound ``name`` (``decoded_bytes`` or ``prompt_bytes``; the last one given), else its
    default.
    """
    given = _option(url, name)
    return _MEMORY_DEFAULTS[name] if given is None else parse_bytes(given, name, zero=True)


def url_codec(url: str | os.PathLike[str] | None) -> str | None:
    """The codec a cache URL names (``?codec=``, the last one given), else None; ValueError for an unknown one."""
    given = _option(url, "codec")
    if given is not None and given not in available_codecs():
        raise ValueError(f"codec must be one of {', '.join(available_codecs())}, got {given!r}")
    return given


def open_cache_store(url: str | os.PathLike[str] | None = None, max_bytes: int | str | None = None) -> ByteStore:
    """The bounded store ``url`` names (see the module contract), opened by `kvrag.storage.stores.make_store`."""
    if url is None:
        return make_store(default_cache_dir() / "passages", max_bytes=max_bytes or DEFAULT_MAX_BYTES)
    text = os.fspath(url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower() if "://" in text else ""
    if scheme == "file" and parts.netloc not in ("", "localhost"):
        raise ValueError(f"a file:// cache URL names a local folder (file:///abs/path), got {public_url(text)}")
    if not scheme and (text.startswith(("/", "~", ".")) or os.sep in text):  # a path, perhaps with a query
        folder, _, query = text.partition("?")
        text = urlunsplit(("file", "", Path(folder).expanduser().absolute().as_posix(), query, ""))
    elif scheme not in ("file", "redis", "rediss"):
        raise ValueError(f"cache must be file:///path, redis://host:port/db or a folder path, got "
                         f"{public_url(text)!r}")
    store_url = _without(text, _CACHE_OPTIONS)
    given = max_bytes if max_bytes is not None or _option(text, "max_bytes") is not None else DEFAULT_MAX_BYTES
    return make_store(store_url, max_bytes=given)  # (None: the URL's own)
