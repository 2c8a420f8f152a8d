"""Byte stores registered by name: the interface and factory (`base`) and the stores kvrag ships.

Contract: importing this package registers ``file`` (alias ``disk``, `DiskStore`), ``memory``
(`MemoryStore`) and ``throttled`` (`ThrottledStore`); `make_store` builds any registered store by name,
``name://`` URL or path. Chunk caches go through a store via `kvrag.storage.kvstore.KVStore`.
"""

from kvrag.storage.stores.base import ByteStore, available_stores, make_store, register_store
from kvrag.storage.stores.disk import DiskStore
from kvrag.storage.stores.memory import MemoryStore
from kvrag.storage.stores.throttled import ThrottledStore

__all__ = ["ByteStore", "DiskStore", "MemoryStore", "ThrottledStore", "available_stores", "make_store",
           "register_store"]
