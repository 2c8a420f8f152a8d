"""Where a passage cache lives: its URL parsed into a store bounded in bytes.

Contract: `open_cache_store(url)` builds the store a ``cache=`` argument names:

- None: `default_cache_dir` (``$KVRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrag``, else ``~/.cache/kvrag``) under
  ``passages/``, bounded by `DEFAULT_MAX_BYTES`;
- ``file:///abs/path?max_bytes=5GB`` or a plain path (absolute, or starting with ``~`` or ``.``): an
  `LRUDiskStore` there;
- ``redis://[[USER]:PASSWORD@]HOST:PORT/DB?max_bytes=1GB`` (``rediss://`` over TLS): an `LRURedisStore`; its
  other query options go to redis-py.

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
from urllib.request import url2pathname

from kvrag.query.head_cache import DEFAULT_PROMPT_BYTES
from kvrag.sizes import parse_bytes
from kvrag.storage.decoded_tier import DEFAULT_DECODED_BYTES
from kvrag.storage.stores import ByteStore, LRUDiskStore, LRURedisStore, public_url
from kvrag.user_cache import default_cache_dir

DEFAULT_MAX_BYTES = 5 * 10**9
_OURS = ("max_bytes", "decoded_bytes", "prompt_bytes", "codec")  # kvrag's; a redis:// URL's others go to redis-py
_MEMORY_DEFAULTS = {"decoded_bytes": DEFAULT_DECODED_BYTES, "prompt_bytes": DEFAULT_PROMPT_BYTES}


def _option(url: str | os.PathLike[str] | None, name: str) -> str | None:
    """The last value a cache URL's query gives ``name``, else None."""
    if url is None or "?" not in os.fspath(url):
        return None
    given = [v for k, v in parse_qsl(urlsplit(os.fspath(url)).query, keep_blank_values=True) if k == name]
    return given[-1] if given else None


def memory_bound(url: str | os.PathLike[str] | None, name: str) -> int:
    """A cache URL's in-memory bound ``name`` (``decoded_bytes`` or ``prompt_bytes``; the last one given), else its
    default.
    """
    given = _option(url, name)
    return _MEMORY_DEFAULTS[name] if given is None else parse_bytes(given, name, zero=True)


def url_codec(url: str | os.PathLike[str] | None) -> str | None:
    """The codec a cache URL names (``?codec=``, the last one given), else None; ValueError for an unknown one."""
    from kvrag.codec import available_codecs

    given = _option(url, "codec")
    if given is not None and given not in available_codecs():
        raise ValueError(f"codec must be one of {', '.join(available_codecs())}, got {given!r}")
    return given


def open_cache_store(url: str | os.PathLike[str] | None = None, max_bytes: int | str | None = None) -> ByteStore:
    """The bounded store ``url`` names (see the module contract)."""
    if url is None:
        return LRUDiskStore(default_cache_dir() / "passages", parse_bytes(max_bytes or DEFAULT_MAX_BYTES))
    text = os.fspath(url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower() if "://" in text else ""
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = _option(text, "max_bytes")
    bound = parse_bytes(max_bytes if max_bytes is not None else given if given is not None else DEFAULT_MAX_BYTES)
    if scheme in ("redis", "rediss"):
        rest = urlencode([(k, v) for k, v in query if k not in _OURS])
        return LRURedisStore(urlunsplit(parts._replace(query=rest)), bound)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// cache URL names a local folder (file:///abs/path), got {public_url(text)}")
        return LRUDiskStore(Path(url2pathname(parts.path)).expanduser(), bound)
    if not scheme and (text.startswith(("/", "~", ".")) or os.sep in text):
        return LRUDiskStore(Path(text.split("?", 1)[0]).expanduser(), bound)
    raise ValueError(f"cache must be file:///path, redis://host:port/db or a folder path, got {public_url(text)!r}")
