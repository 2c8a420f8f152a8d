"""The ``bounded-redis`` store (alias ``lru-redis``): a `RedisStore` bounded in bytes, evicting the blobs not read
again first.

Contract:

- Blobs are Redis strings as in `RedisStore` (one ``SET`` each: readers never see half a blob). Beside them, under
  the same namespace, two sorted sets order the blobs by last use: ``probation`` (stored, not read since) and
  ``protected`` (read since stored); counters hold the bytes of all blobs (``bytes``) and of the protected
  (``protected_bytes``).
- Eviction is the segmented LRU of `kvrag.storage.stores.protected_blobs`: a read promotes a blob to protected;
  protected blobs may hold `PROTECTED_SHARE` of the bound, beyond which the least recently used go back on probation
  as if just stored; probation's least recently used are evicted first, protected ones only when probation is
  empty. So a passage read again outlives a stream of passages stored once.
- Each `put` runs one Lua script, atomic on the server whatever the number of processes sharing the namespace:
  it stores the blob (a rewritten protected blob stays protected), counts its bytes and, while the total exceeds
  ``max_bytes``, deletes other blobs in that order down to `LOW_WATER` of the bound. So the bound holds across
  processes after every put. A namespace an older kvrag kept in one last-use order (``lru``) is taken over by the
  first put: its blobs go on probation in their order.
- `open` reads the blob and promotes it in one round trip (`touch` promotes without reading, `peek` reads without
  promoting); `nbytes` and `contains` are not reads; `delete` removes a blob and its bytes atomically.
- A blob larger than ``max_bytes`` is not stored. `put_state`/`get_state` keep small named blobs (a codec's
  fitted state) outside the bound, never evicted; `put_state` writes only when the name is absent (``SET NX``)
  and returns what is stored, so racing writers agree on one.
- `held` asks the server for the bytes held; ``evicted`` counts the blobs this process's puts deleted;
  `popularity` gives the blobs and bytes protected and on probation.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any, BinaryIO

from kvrag.storage.stores.base import register_store
from kvrag.storage.stores.protected_blobs import PROTECTED_SHARE
from kvrag.storage.stores.redis import RedisStore

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # an eviction frees room down to this fraction of the bound
_OWN_KEYS = ("probation", "protected", "bytes", "protected_bytes", "lru")  # the namespace's bookkeeping, not blobs

# KEYS: blob, probation, protected, bytes, protected bytes, lru (an older kvrag's order). ARGV: data, max bytes, low
# water, member, namespace, protected share of the bound. Returns the blobs evicted.
_PUT = """
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('ZUNIONSTORE', KEYS[2], 2, KEYS[2], KEYS[6])
  redis.call('DEL', KEYS[6])
end
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local old = redis.call('STRLEN', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
local added = string.len(ARGV[1]) - old
if redis.call('ZSCORE', KEYS[3], ARGV[4]) then
  redis.call('ZADD', KEYS[3], now, ARGV[4])
  redis.call('INCRBY', KEYS[5], added)
else
  redis.call('ZADD', KEYS[2], now, ARGV[4])
end
local total = redis.call('INCRBY', KEYS[4], added)
local evicted = 0
if total > tonumber(ARGV[2]) then
  local guarded = tonumber(redis.call('GET', KEYS[5]) or '0')
  while guarded > tonumber(ARGV[6]) do
    local oldest = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not oldest then break end
    redis.call('ZREM', KEYS[3], oldest)
    redis.call('ZADD', KEYS[2], now, oldest)
    guarded = redis.call('DECRBY', KEYS[5], redis.call('STRLEN', ARGV[5] .. oldest))
  end
  while total > tonumber(ARGV[3]) do
    local from, ranked = KEYS[2], redis.call('ZRANGE', KEYS[2], 0, 1)
    if ranked[1] == ARGV[4] then table.remove(ranked, 1) end
    if not ranked[1] then
      from, ranked = KEYS[3], redis.call('ZRANGE', KEYS[3], 0, 1)
      if ranked[1] == ARGV[4] then table.remove(ranked, 1) end
    end
    local victim = ranked[1]
    if not victim then break end
    redis.call('ZREM', from, victim)
    local name = ARGV[5] .. victim
    local size = redis.call('STRLEN', name)
    if from == KEYS[3] then redis.call('DECRBY', KEYS[5], size) end
    total = redis.call('DECRBY', KEYS[4], size)
    redis.call('DEL', name)
    evicted = evicted + 1
  end
end
return evicted
"""
# KEYS: blob, probation, protected, protected bytes. ARGV: member. A read: protected, just used (nothing when absent).
_READ = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('INCRBY', KEYS[4], redis.call('STRLEN', KEYS[1]))
  redis.call('ZADD', KEYS[3], now, ARGV[1])
else
  redis.call('ZADD', KEYS[3], 'XX', now, ARGV[1])
end
"""
# KEYS: blob, probation, protected, bytes, protected bytes. ARGV: member.
_DELETE = """
local size = redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('ZREM', KEYS[3], ARGV[1]) == 1 and size > 0 then redis.call('DECRBY', KEYS[5], size) end
if size > 0 then redis.call('DECRBY', KEYS[4], size) end
return size
"""


@register_store("bounded-redis", "lru-redis")
class BoundedRedisStore(RedisStore):
    """A Redis store of at most ``max_bytes`` of blobs, those not read again evicted first (see the module contract).

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
        self._probation, self._protected, self._bytes, self._guarded, self._lru = (namespace + k for k in _OWN_KEYS)
        self._put_script = self._client.register_script(_PUT)
        self._read_script = self._client.register_script(_READ)
        self._delete_script = self._client.register_script(_DELETE)

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> BoundedRedisStore:
        """A store at ``options["url"]`` bounded by ``options["max_bytes"]``; other options as the constructor's."""
        if root is not None or "url" not in options or "max_bytes" not in options:
            raise ValueError(f"the {cls.name!r} store needs url= and max_bytes=, and no root directory")
        return cls(**options)

    def put(self, key: str, data: bytes) -> None:
        """Store the blob, count it and evict others beyond the bound (one atomic script)."""
        if len(data) > self.max_bytes:
            log.info("a %d-byte blob exceeds the cache's bound of %d bytes; not stored", len(data), self.max_bytes)
            return
        keys = [self._key(key), self._probation, self._protected, self._bytes, self._guarded, self._lru]
        args = [bytes(data), self.max_bytes, int(self.max_bytes * LOW_WATER), key, self.namespace,
                int(self.max_bytes * PROTECTED_SHARE)]
        self.evicted += int(self._call("put", lambda: self._put_script(keys=keys, args=args)))

    def _read_keys(self, key: str) -> list[str]:
        return [self._key(key), self._probation, self._protected, self._guarded]

    def open(self, key: str) -> BinaryIO | None:
        """``GET`` the blob and promote it, in one round trip; None when absent."""
        keys = self._read_keys(key)

        def get() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(keys[0])
            self._read_script(keys=keys, args=[key], client=pipe)
            return pipe.execute()[0]

        data = self._call("GET", get)
        return None if data is None else io.BytesIO(data)

    def peek(self, key: str) -> BinaryIO | None:
        """``GET`` the blob without promoting it; None when absent."""
        return super().open(key)

    def touch(self, key: str) -> None:
        """Promote the blob as a read does (nothing when absent)."""
        keys = self._read_keys(key)
        self._call("touch", lambda: self._read_script(keys=keys, args=[key]))

    def delete(self, key: str) -> None:
        """Remove the blob and its bytes."""
        keys = [self._key(key), self._probation, self._protected, self._bytes, self._guarded]
        self._call("DEL", lambda: self._delete_script(keys=keys, args=[key]))

    def popularity(self) -> dict[str, int]:
        """The blobs and bytes protected (read since stored) and on probation."""

        def ask() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.zcard(self._protected)
            pipe.get(self._guarded)
            pipe.zcard(self._probation)
            pipe.get(self._bytes)
            return pipe.execute()

        protected, guarded, probation, total = self._call("popularity", ask)
        guarded, total = int(guarded or 0), int(total or 0)
        return {"protected_blobs": int(protected), "protected_bytes": guarded, "probation_blobs": int(probation),
                "probation_bytes": total - guarded}

    def held(self) -> int:
        """The bytes of the blobs held, as the server counts them."""
        return int(self._call("GET", lambda: self._client.get(self._bytes)) or 0)

    def keys(self) -> Any:
        """The blobs' keys (the bookkeeping and the state blobs left out)."""
        return iter(k for k in super().keys() if k not in _OWN_KEYS and not k.startswith("state:"))

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
