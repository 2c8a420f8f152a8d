"""Which chunk store an index uses, and URLs as kvrag shows them.

Contract: `open_index_store` opens an index's chunk store: its ``chunks/`` folder by default
(`kvrag.storage.index_layout`), or the URL its manifest records (`store_record`, written at build time), or one
given to override it; a remote one comes behind a `kvrag.storage.stores.cached.CachedStore`, its keys under the
index's own namespace, so that indexes share one Redis database. A bound in bytes (``StoreConfig.max_bytes``,
recorded as the record's ``max_bytes``) makes it an `LRUDiskStore` or `LRURedisStore`. `public_url` is a URL as
messages and manifests show it: without its password. `is_remote_url` tells a network store's URL from a local one.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvrag.config import StoreConfig
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.stores.base import ByteStore, available_stores, make_store, network_class
from kvrag.storage.stores.lru_disk import LRUDiskStore

_LOCAL = ("", "localhost")  # URL hosts of stores on this machine (``file://``, ``memory://``)
_OWN = ("disk", "file")  # StoreConfig.backend values that mean "the index's own store"


def public_url(url: str, mask: str = "***") -> str:
    """``url`` with its password (in the user part or a ``password=`` query field) replaced by ``mask``;
    with ``mask=""`` the password is left out altogether.
    """
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{mask}@{hostport}" if mask else (f"{user}@{hostport}" if user else hostport)
    query = parts.query
    if "password" in query:
        fields = [(k, mask if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)
                  if mask or k != "password"]
        query = urlencode(fields, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names a registered network store (``redis://HOST:PORT/DB``), not a local one."""
    return network_class(url) is not None


def store_record(store: str | StoreConfig | None, fingerprint: str) -> dict[str, Any]:
    """The manifest's ``"store"`` entry of a new index: where its chunk caches live (``url``: None for its
    ``chunks/`` folder; a remote URL without its password) and the ``namespace`` its keys take there (the
    model's fingerprint and a new index id, so that indexes can share one database).

    Raises:
        ValueError: ``store`` names no registered store (checked before the index is created).
    """
    backend = store.backend if isinstance(store, StoreConfig) else store
    url = None if backend is None or backend.lower() in _OWN else backend
    if url is not None and network_class(url) is not None:
        try:
            urlsplit(url).port  # noqa: B018 - a port that is no number raises ValueError
        except ValueError as exc:
            raise ValueError(f"store URL {public_url(url)}: {exc}") from None
        url = public_url(url, mask="")
    elif url is not None and "://" in url:
        parts = urlsplit(url)
        if parts.netloc not in _LOCAL or parts.scheme.lower() not in available_stores():
            make_store(public_url(url))  # the registry's own error: an unknown scheme, a host for a local store
    elif url is not None and url.lower() not in available_stores():
        url = Path(url).expanduser().resolve().as_uri()  # a path: recorded absolute
    bound = store.max_bytes if isinstance(store, StoreConfig) else None
    return {"url": url, "namespace": f"kvrag:{fingerprint[:16]}:{uuid.uuid4().hex[:16]}:",
            **({"max_bytes": int(bound)} if bound else {})}


def _namespace(manifest: Mapping[str, Any]) -> str:
    """The key prefix of the index's caches in a shared store (an index without a record: from its identity)."""
    recorded = manifest.get("store") or {}
    if recorded.get("namespace"):
        return str(recorded["namespace"])
    from kvrag.storage.integrity import canonical_checksum

    ident = canonical_checksum({"model": manifest.get("model"), "created": manifest.get("created"),
                                "codec": manifest.get("codec")})
    return f"kvrag:{str(manifest.get('model', {}).get('fingerprint', ''))[:16]}:{ident[:16]}:"


def open_index_store(path: Path, manifest: Mapping[str, Any], store: str | StoreConfig | None = None) -> ByteStore:
    """The chunk store of the index at ``path``: ``store`` when given (a URL, path or `StoreConfig`; its
    default backend ``disk`` means the index's own), else the one its manifest records, else ``path/chunks``.
    A remote store comes behind a `CachedStore` of ``StoreConfig.cache_bytes``.
    """
    config = store if isinstance(store, StoreConfig) else StoreConfig(backend=store or "disk")
    url = config.backend if config.backend.lower() not in _OWN else (manifest.get("store") or {}).get("url")
    bound = config.max_bytes or (manifest.get("store") or {}).get("max_bytes")
    if url is None or not is_remote_url(url):  # (a local store has no password: its errors need not hide one)
        local = make_store("disk", IndexLayout.of(path).chunks, fsync=config.fsync) if url is None else \
            make_store(public_url(url), fsync=config.fsync)
        root = getattr(local, "root", None)
        return local if not bound or root is None else LRUDiskStore(root, int(bound), fsync=config.fsync)
    options: dict[str, Any] = {
        "namespace": _namespace(manifest), "connect_timeout_s": config.connect_timeout_s, "timeout_s": config.timeout_s,
        "retries": config.retries, "retry_after_s": config.retry_after_s}
    from kvrag.storage.stores.cached import CachedStore
    from kvrag.storage.stores.lru_redis import LRURedisStore  # (it imports this module)

    inner = LRURedisStore(url, int(bound), **options) if bound else make_store(url, **options)
    return CachedStore(inner, int(config.cache_bytes), public_url(url))
