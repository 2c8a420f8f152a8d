"""Byte stores registered by name: the interface and factory (`base`) and the stores kvrag ships.

Contract: importing this package registers ``file`` (alias ``disk``, `DiskStore`), ``memory`` (`MemoryStore`),
``bounded-file`` and ``bounded-redis`` (aliases ``lru-file``, ``lru-redis``; `BoundedDiskStore`, `BoundedRedisStore`:
bounded in bytes, a segmented LRU), ``throttled`` (`ThrottledStore`) and ``redis`` (alias ``rediss``,
`RedisStore`: a shared Redis or Valkey; redis-py is imported only when one is made); `make_store` builds any registered
store by name, ``name://`` URL or path (a network store, ``redis://host:port/db``, by its whole URL);
`store_class` looks a class up by name. A URL's query options are its store class's own (`store_url`). An
index opens its chunk store with `open_index_store` (its ``chunks/`` folder, or the URL its manifest records, a
remote one behind the local cache `CachedStore`). Chunk caches go through a store via `kvrag.storage.kvstore.KVStore`.
"""

from kvrag.errors import StoreUnavailableError
from kvrag.storage.stores.base import (
    ByteStore,
    LinkMeter,
    available_stores,
    make_store,
    network_class,
    register_store,
    store_class,
)
from kvrag.storage.stores.bounded_disk import BoundedDiskStore
from kvrag.storage.stores.bounded_redis import BoundedRedisStore
from kvrag.storage.stores.cached import CachedStore
from kvrag.storage.stores.disk import DiskStore
from kvrag.storage.stores.index_store import is_remote_url, open_index_store, store_record
from kvrag.storage.stores.memory import MemoryStore
from kvrag.storage.stores.redis import RedisStore
from kvrag.storage.stores.store_url import public_url, split_url_options
from kvrag.storage.stores.throttled import ThrottledStore

__all__ = [
    "ByteStore", "CachedStore", "DiskStore", "BoundedDiskStore", "BoundedRedisStore", "LinkMeter", "MemoryStore",
    "RedisStore", "StoreUnavailableError", "ThrottledStore", "available_stores", "is_remote_url", "make_store",
    "network_class", "open_index_store", "public_url", "register_store", "split_url_options", "store_class",
    "store_record",
]
