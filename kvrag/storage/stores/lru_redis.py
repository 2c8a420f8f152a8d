"""The ``lru-redis`` store: a `RedisStore` bounded in bytes, evicting the least recently used blobs.

Contract:

- Blobs are Redis strings as in `RedisStore` (one ``SET`` each: readers never see half a blob). Beside them, under
  the same namespace, a sorted set ``lru`` orders the blobs by last use and a counter ``bytes`` holds their total.
- Each `put` runs one Lua script, atomic on the server whatever the number of processes sharing the namespace:
  it stores the blob, counts its bytes and, while the total exceeds ``max_bytes``, deletes the least recently used
  other blobs down to `LOW_WATER` of the bound. So the bound holds across processes after every put.
- `open` reads the blob and marks it used in one round trip; `delete` removes it and its bytes atomically.
- A blob larger than ``max_bytes`` is not stored. `put_state`/`get_state` keep small named blobs (a codec's
  fitted state) outside the bound, never evicted; `put_state` writes only when the name is absent (``SET NX``)
  and returns what is stored, so racing writers agree on one.
- `held` asks the server for the bytes held; ``evicted`` counts the blobs this process's puts deleted.
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any, BinaryIO

from kvrag.storage.stores.base import register_store
from kvrag.storage.stores.redis import RedisStore

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # an eviction frees room down to this fraction of the bound

# KEYS: blob, lru, bytes. ARGV: data, now, max bytes, low water, member, namespace. Returns blobs evicted.
_PUT = """
local old = redis.call('STRLEN', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[1]) - old)
local evicted = 0
if total > tonumber(ARGV[3]) then
  while total > tonumber(ARGV[4]) do
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 1)
    local victim = oldest[1]
    if victim == ARGV[5] then victim = oldest[2] end
    if not victim then break end
    redis.call('ZREM', KEYS[2], victim)
    local name = ARGV[6] .. victim
    total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', name))
    redis.call('DEL', name)
    evicted = evicted + 1
  end
end
return evicted
"""
# KEYS: blob, lru, bytes. ARGV: member.
_DELETE = """
local size = redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if size > 0 then redis.call('DECRBY', KEYS[3], size) end
return size
"""


@register_store("lru-redis")
class LRURedisStore(RedisStore):
    """A Redis store of at most ``max_bytes`` of blobs, least recently used evicted first (see the module contract).

    Args:
        url: ``redis://[[USER]:PASSWORD@]HOST:PORT/DB``.
        max_bytes: the bound on the blobs' bytes.
        namespace: the prefix of this store's keys.
        **options: `RedisStore`'s timeouts and retries.
    """

    def __init__(self, url: str, max_bytes: int, namespace: str = "kvrag:passages:", **options: Any) -> None:
        if not max_bytes > 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        super().__init__(url, namespace, **options)
        self.max_bytes = int(max_bytes)
        self.evicted = 0
        self._lru, self._bytes = namespace + "lru", namespace + "bytes"
        self._put_script = self._client.register_script(_PUT)
        self._delete_script = self._client.register_script(_DELETE)

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> LRURedisStore:
        """A store at ``options["url"]`` bounded by ``options["max_bytes"]``; other options as the constructor's."""
        if root is not None or "url" not in options or "max_bytes" not in options:
            raise ValueError(f"the {cls.name!r} store needs url= and max_bytes=, and no root directory")
        return cls(**options)

    def put(self, key: str, data: bytes) -> None:
        """Store the blob, count it and evict the least recently used others beyond the bound (one atomic script)."""
        if len(data) > self.max_bytes:
            log.info("a %d-byte blob exceeds the cache's bound of %d bytes; not stored", len(data), self.max_bytes)
            return
        name = self._key(key)
        args = [bytes(data), time.time(), self.max_bytes, int(self.max_bytes * LOW_WATER), key, self.namespace]
        self.evicted += int(self._call("put", lambda: self._put_script(keys=[name, self._lru, self._bytes],
                                                                        args=args)))

    def open(self, key: str) -> BinaryIO | None:
        """``GET`` the blob and mark it used, in one round trip; None when absent."""
        name = self._key(key)

        def get() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(name)
            pipe.zadd(self._lru, {key: time.time()}, xx=True)
            return pipe.execute()[0]

        data = self._call("GET", get)
        return None if data is None else io.BytesIO(data)

    def touch(self, key: str) -> None:
        """Mark the blob as just used (``ZADD XX``: nothing when absent)."""
        self._call("ZADD", lambda: self._client.zadd(self._lru, {key: time.time()}, xx=True))

    def delete(self, key: str) -> None:
        """Remove the blob and its bytes from the count."""
        name = self._key(key)
        self._call("DEL", lambda: self._delete_script(keys=[name, self._lru, self._bytes], args=[key]))

    def held(self) -> int:
        """The bytes of the blobs held, as the server counts them."""
        return int(self._call("GET", lambda: self._client.get(self._bytes)) or 0)

    def keys(self) -> Any:
        """The blobs' keys (the order of use and the byte count left out)."""
        return iter(k for k in super().keys() if k not in ("lru", "bytes") and not k.startswith("state:"))

    def get_state(self, name: str) -> bytes | None:
        """The state blob ``name``, or None when absent."""
        key = self.namespace + "state:" + name
        data = self._call("GET", lambda: self._client.get(key))
        return None if data is None else bytes(data)

    def put_state(self, name: str, data: bytes) -> bytes:
        """Store the state blob ``name`` unless one is there (``SET NX``); returns the stored one."""
        key = self.namespace + "state:" + name
        self._call("SET", lambda: self._client.set(key, bytes(data), nx=True))
        stored = self.get_state(name)
        assert stored is not None
        return stored
