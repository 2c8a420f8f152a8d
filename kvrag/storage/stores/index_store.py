"""Which chunk store an index uses.

Contract: `open_index_store` opens an index's chunk store: its ``chunks/`` folder by default
(`kvrag.storage.index_layout`), or the URL its manifest records (`store_record`, written at build time), or one
given to override it; a remote one comes behind a `kvrag.storage.stores.cached.CachedStore`, its keys under the
index's own namespace, so that indexes share one Redis database. A bound in bytes (``StoreConfig.max_bytes``,
recorded as the record's ``max_bytes``, or ``?max_bytes=`` in its URL) opens its bounded kind (`BoundedDiskStore`,
`BoundedRedisStore`; `kvrag.storage.stores.base.make_store`). `is_remote_url` tells a network store's URL from a
local one.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvrag.config import StoreConfig
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.integrity import canonical_checksum
from kvrag.storage.stores.base import ByteStore, available_stores, make_store, network_class, store_class
from kvrag.storage.stores.cached import CachedStore
from kvrag.storage.stores.store_url import public_url, split_url_options

_LOCAL = ("", "localhost")  # URL hosts of stores on this machine (``file://``, ``memory://``)
_OWN = ("disk", "file")  # StoreConfig.backend values that mean "the index's own store"


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names a registered network store (``redis://HOST:PORT/DB``), not a local one."""
    return network_class(url) is not None


def store_record(store: str | StoreConfig | None, fingerprint: str) -> dict[str, Any]:
    """The manifest's ``"store"`` entry of a new index: where its chunk caches live (``url``: None for its
    ``chunks/`` folder; a remote URL without its password) and the ``namespace`` its keys take there (the
    model's fingerprint and a new index id, so that indexes can share one database).

    Raises:
        ValueError: ``store`` names no registered store, or its URL an option the store does not take (checked
            before the index is created).
    """
    backend = store.backend if isinstance(store, StoreConfig) else store
    url = None if backend is None or backend.lower() in _OWN else backend
    network = network_class(url) if url is not None else None
    if url is not None and network is not None:
        try:
            urlsplit(url).port  # noqa: B018 - a port that is no number raises ValueError
        except ValueError as exc:
            raise ValueError(f"store URL {public_url(url)}: {exc}") from None
        split_url_options(url, network)  # an option the store does not take: refused now
        url = public_url(url, mask="")
    elif url is not None and "://" in url:
        parts = urlsplit(url)
        if parts.netloc not in _LOCAL or parts.scheme.lower() not in available_stores():
            make_store(public_url(url))  # the registry's own error: an unknown scheme, a host for a local store
        split_url_options(url, store_class(parts.scheme))  # an option the store does not take: refused now
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
    bound = int(bound) if bound else None
    if url is None or not is_remote_url(url):  # (a local store has no password: its errors need not hide one)
        if url is None:
            return make_store("disk", IndexLayout.of(path).chunks, fsync=config.fsync, max_bytes=bound)
        return make_store(public_url(url), fsync=config.fsync, max_bytes=bound)
    options: dict[str, Any] = {
        "namespace": _namespace(manifest), "connect_timeout_s": config.connect_timeout_s, "timeout_s": config.timeout_s,
        "retries": config.retries, "retry_after_s": config.retry_after_s}
    return CachedStore(make_store(url, max_bytes=bound, **options), int(config.cache_bytes), public_url(url))
