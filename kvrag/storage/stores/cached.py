"""The local side of a remote chunk store: a bounded cache of hot blobs, and what happens when the store is away.

Contract:

- `CachedStore` wraps a remote `ByteStore` (``redis``): reads are served from an in-memory LRU cache of whole
  blobs bounded in bytes (``max_bytes``; 0: none; a larger blob is never cached), else fetched and remembered;
  writes go through and are remembered. Cached bytes are as stored: every read is still checked by the
  container's checksums (`kvrag.storage.container`); a blob replaced or deleted through it is so here too.
- A remote store that cannot be reached (refused, timed out, a refused login) raises
  `kvrag.errors.StoreUnavailableError`. Then ``open`` raises it too (after the local cache), so that the reader
  can tell "absent because unreachable" from "absent" (`kvrag.storage.kvstore.KVStore.reader` raises
  `kvrag.errors.ChunkUnavailableError`, which the recoveries log at debug level and recompute from the text);
  ``contains``/``nbytes``/``sizes`` answer "absent"; a write waits in a pending list (at most
  ``max(max_bytes, PENDING_MIN_BYTES)``, the oldest dropped first). The store logs **one** warning for the
  whole outage. The first operation that reaches the store again stores the pending blobs
  (`CachedStore.flush`): the chunks recomputed meanwhile are stored again. A read served from the pending list
  tries that too, in the background and at most once every ``PENDING_RETRY_S`` seconds, so that chunks read
  only from there are stored once the store is back. `close` tries once more.
- Reads that reach the store are timed in ``meter`` (`kvrag.storage.stores.base.LinkMeter`): the link's
  throughput, which the streaming loader plans with; reads served from memory are not.

How an index finds its store (and `public_url`) is `kvrag.storage.stores.index_store`.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, TypeVar

from kvrag.byte_lru import ByteLRU
from kvrag.errors import StoreUnavailableError
from kvrag.storage.stores.base import ByteStore, LinkMeter

log = logging.getLogger(__name__)
T = TypeVar("T")

MB = 1 << 20
PENDING_RETRY_S = 1.0  # how often reads of pending blobs try to store them (in the background)
PENDING_MIN_BYTES = 64 * MB  # room for caches recomputed while the store is away, whatever the cache's size
__all__ = ["CachedStore", "StoreUnavailableError"]


class CachedStore(ByteStore):
    """A remote store behind a bounded in-memory LRU cache of whole blobs, riding out outages.

    Args:
        inner: the remote store; it raises `StoreUnavailableError` when it cannot be reached.
        max_bytes: the cache's bound in bytes (0: no cache).
        label: how messages name the store (its URL without the password).
        max_pending_bytes: bound of the blobs kept for storing once the store is back (default
            ``max(max_bytes, PENDING_MIN_BYTES)``).

    Attributes:
        hits, misses: reads served from memory, and reads that went to the store.
    """

    def __init__(self, inner: ByteStore, max_bytes: int, label: str = "", max_pending_bytes: int | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.inner, self.max_bytes, self.label = inner, int(max_bytes), label or type(inner).__name__
        self.max_pending_bytes = max(self.max_bytes, PENDING_MIN_BYTES) if max_pending_bytes is None \
            else int(max_pending_bytes)
        self._hot: ByteLRU[str, bytes] = ByteLRU(self.max_bytes)  # the cache
        self._pending: ByteLRU[str, bytes] = ByteLRU(self.max_pending_bytes)  # oldest first (never read as "used")
        self._lock = threading.RLock()
        self._flushing = threading.Lock()
        self._down = False  # in an outage that has been warned about
        self._last_retry = 0.0  # when a read of a pending blob last tried to store the pending ones
        self.hits = self.misses = 0
        self.meter: LinkMeter = LinkMeter()

    @property
    def cached_bytes(self) -> int:
        """Bytes held by the cache now (never more than ``max_bytes``)."""
        return self._hot.nbytes

    @property
    def pending(self) -> list[str]:
        """Keys of the blobs waiting for the store to be reachable again, oldest first."""
        with self._lock:
            return list(self._pending)

    def clear(self) -> None:
        """Drop every cached blob (the pending ones stay until stored)."""
        with self._lock:
            self._hot.clear()

    # -- the cache --------------------------------------------------------------------------

    def _remember(self, key: str, data: bytes) -> None:
        with self._lock:
            self._hot.put(key, data, len(data))

    def _forget(self, key: str) -> None:
        with self._lock:
            self._hot.pop(key)

    def _local(self, key: str) -> bytes | None:
        with self._lock:
            data = self._hot.get(key)
            return data if data is not None else self._pending.peek(key)

    # -- outages ------------------------------------------------------------------------------

    def _unpend(self, key: str) -> None:
        with self._lock:
            self._pending.pop(key)

    def _defer(self, key: str, data: bytes) -> None:
        """Keep ``data`` for storing once the store is back (the oldest pending dropped for room)."""
        with self._lock:
            self._pending.put(key, data, len(data))

    def _outage(self, exc: StoreUnavailableError) -> None:
        """Warn once per outage."""
        with self._lock:
            first, self._down = not self._down, True
        if first:
            log.warning("%s; chunk caches are computed from their text until it answers again (those computed "
                        "meanwhile are stored then)", exc)

    def _back(self) -> None:
        """The store answered: end the outage and store what waited for it."""
        with self._lock:
            was_down, self._down = self._down, False
            waiting = bool(self._pending)
        if was_down:
            log.info("%s answers again", self.label)
        if waiting:
            self.flush()

    def _retry_pending(self) -> None:
        """While blobs wait for the store, try to store them in the background (at most every PENDING_RETRY_S)."""
        with self._lock:
            now = time.monotonic()
            if not self._pending or now - self._last_retry < PENDING_RETRY_S:
                return
            self._last_retry = now
        threading.Thread(target=self.flush, name="kvrag-store-flush", daemon=True).start()

    def flush(self) -> int:
        """Store the pending blobs, oldest first, until one fails; how many are still pending."""
        if not self._flushing.acquire(blocking=False):  # another thread is at it
            return len(self._pending)
        try:
            while True:
                with self._lock:
                    first = self._pending.oldest()
                    if first is None:
                        return 0
                    key, data = first
                try:
                    self.inner.put(key, data)
                except StoreUnavailableError as exc:
                    self._outage(exc)
                    return len(self._pending)
                with self._lock:
                    if self._pending.peek(key) is data:
                        self._pending.pop(key)
                log.debug("stored pending chunk cache %s in %s", key, self.label)
        finally:
            self._flushing.release()

    # -- ByteStore ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` remotely and remember it; while the store is away, keep it pending."""
        data = bytes(data)
        self._remember(key, data)
        try:
            self.inner.put(key, data)
        except StoreUnavailableError as exc:
            self._defer(key, data)
            self._outage(exc)
            return
        self._unpend(key)
        self._back()

    def _ask(self, command: Callable[[], T], away: T) -> T:
        """``command()`` on the store, or ``away`` when it cannot be reached."""
        try:
            out = command()
        except StoreUnavailableError as exc:
            self._outage(exc)
            return away
        self._back()
        return out

    def open(self, key: str) -> BinaryIO | None:
        """The blob from memory, else from the store (then remembered); None when absent.

        Raises:
            StoreUnavailableError: the store cannot be reached (warned about once per outage).
        """
        return self._read(key, self.inner.open)

    def peek(self, key: str) -> BinaryIO | None:
        """`open`, through the store's own `peek` (not a use where it evicts by use)."""
        return self._read(key, self.inner.peek)

    def _read(self, key: str, fetch: Callable[[str], BinaryIO | None]) -> BinaryIO | None:
        """The blob from memory, else ``fetch``ed from the store and remembered (`open`)."""
        data = self._local(key)
        if data is not None:
            self.hits += 1
            self._retry_pending()
            return io.BytesIO(data)
        self.misses += 1
        t0 = time.perf_counter()
        try:
            fh = fetch(key)
            data = None if fh is None else fh.read()
        except StoreUnavailableError as exc:
            self._outage(exc)
            raise
        self.meter.record(len(data) if data is not None else 0, time.perf_counter() - t0)
        self._back()
        if data is None:
            return None
        self._remember(key, data)
        return io.BytesIO(data)

    def contains(self, key: str) -> bool:
        """Whether the blob is held here or in the store (False while the store is away)."""
        return self._local(key) is not None or self._ask(lambda: self.inner.contains(key), False)

    def nbytes(self, key: str) -> int:
        """The blob's size (0 when absent or the store is away)."""
        data = self._local(key)
        return len(data) if data is not None else self._ask(lambda: self.inner.nbytes(key), 0)

    def sizes(self, keys: Iterable[str]) -> list[int]:
        """Each blob's size (0 when absent or the store is away): those held here from memory, the rest in one
        request to the store.
        """
        keys = list(keys)
        local = [self._local(k) for k in keys]
        ask = [k for k, d in zip(keys, local) if d is None]
        remote = iter(self._ask(lambda: self.inner.sizes(ask), [0] * len(ask)) if ask else [])
        return [len(d) if d is not None else next(remote) for d in local]

    def keys(self) -> Iterator[str]:
        """The store's keys (`kvrag.errors.StoreUnavailableError` when it cannot be reached)."""
        try:
            found = list(self.inner.keys())
        except StoreUnavailableError as exc:
            self._outage(exc)
            raise
        self._back()
        return iter(sorted(set(found) | set(self.pending)))

    def touch(self, key: str) -> None:
        """Mark the blob as used in the store (nothing while it is away)."""
        self._ask(lambda: self.inner.touch(key), None)

    def delete(self, key: str) -> None:
        """Drop the blob here and in the store (there only if it answers: a damaged blob left there is found
        again when read, and replaced).
        """
        self._forget(key)
        self._unpend(key)
        self._ask(lambda: self.inner.delete(key), None)

    def close(self) -> None:
        """Store what is pending if the store answers, drop the cache, close the store."""
        left = self.flush() if self._pending else 0
        if left:  # the outage was warned about; these are computed from their text again when needed
            log.info("%d chunk cache(s) computed while %s was unreachable were not stored in it", left, self.label)
        self.clear()
        self.inner.close()
