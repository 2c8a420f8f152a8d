"""`ByteLRU`: entries kept in least-recently-used order within a bound on their total size in bytes.

Contract: every entry has a size given when it is put; ``nbytes`` is their sum and never exceeds ``max_bytes``
after a `put`. `put` first evicts the least recently used entries (or, with ``victim``, the one it picks among
them, e.g. to spare the pinned ones) until the new entry fits, then keeps it as the most recent, and returns the
evicted entries oldest first so that the caller can move them elsewhere; an entry larger than the bound is not
kept. `get` marks an entry as used; `peek` and iteration (least recent first) do not. Not thread-safe: callers
hold their own lock. kvrag's bounded caches (the remote store's local cache and its pending writes, the
conversations' tiers, the prompt heads, tokenized texts) all keep their entries here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Entries by key, least recently used first, bounded by ``max_bytes`` in total size."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(list(self._entries))

    def fits(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes can be kept at all."""
        return size <= self.max_bytes

    def get(self, key: K) -> V | None:
        """The entry under ``key``, marked as the most recently used (None if absent)."""
        held = self._entries.get(key)
        if held is None:
            return None
        self._entries.move_to_end(key)
        return held[0]

    def peek(self, key: K) -> V | None:
        """The entry under ``key`` without marking it used (None if absent)."""
        held = self._entries.get(key)
        return None if held is None else held[0]

    def pop(self, key: K) -> V | None:
        """Remove and return the entry under ``key`` (None if absent)."""
        held = self._entries.pop(key, None)
        if held is None:
            return None
        self.nbytes -= held[1]
        return held[0]

    def make_room(self, size: int, victim: Callable[[list[K]], K] | None = None) -> list[tuple[K, V]]:
        """Evict until ``size`` more bytes fit (as `put` does before keeping an entry): the evicted, oldest first."""
        evicted: list[tuple[K, V]] = []
        while self._entries and self.nbytes + size > self.max_bytes:
            key = next(iter(self._entries)) if victim is None else victim(list(self._entries))
            value = self.pop(key)
            evicted.append((key, value))  # type: ignore[arg-type]
        return evicted

    def put(self, key: K, value: V, size: int,
            victim: Callable[[list[K]], K] | None = None) -> list[tuple[K, V]]:
        """Keep ``value`` under ``key`` as the most recent entry (replacing one under the same key), evicting what
        no longer fits; the evicted entries, oldest first. A value larger than ``max_bytes`` is not kept.
        """
        self.pop(key)
        if not self.fits(size):
            return []
        evicted = self.make_room(size, victim)
        self._entries[key] = (value, int(size))
        self.nbytes += int(size)
        return evicted

    def oldest(self) -> tuple[K, V] | None:
        """The least recently used entry (None when empty), left in place."""
        for key, (value, _) in self._entries.items():
            return key, value
        return None

    def items(self) -> list[tuple[K, V]]:
        """The entries, least recently used first."""
        return [(k, v) for k, (v, _) in self._entries.items()]

    def clear(self) -> list[tuple[K, V]]:
        """Remove every entry; what was held, least recent first."""
        held = self.items()
        self._entries.clear()
        self.nbytes = 0
        return held
