"""Segmented LRU for the bounded stores: which blobs were read since stored, and the order eviction follows.

Contract:

- **The rule** (segmented LRU, as 2Q and the main space of W-TinyLFU keep it): a blob enters *on probation* when
  stored; a read of it promotes it to *protected*. Protected blobs may hold `PROTECTED_SHARE` of the bound; beyond
  it the least recently used go back on probation, as if just stored. Eviction takes probation's least recently
  used first (blobs put back after those stored and never read) and protected blobs only when probation is empty.
  So a stream of blobs stored once (every distinct question stores its own in-place rows) churns through probation
  and never evicts a passage read twice, which a plain LRU bound lets it do; popularity that stops fades as newer
  reads push it back on probation.
- `eviction_order(blobs, protected, max_bytes)` applies it to one scan of a store (pure): the blobs with their last
  use and size, oldest first. It returns the order in which to delete them and the protected ones put back.
- `ProtectedBlobs` keeps a bounded disk store's protected set in SQLite beside the blobs (``root/protected.sqlite``,
  write-ahead log, not synced: a lost row only puts a blob back on probation). Processes on one root share it. A
  store where the database cannot be opened or written (a read-only folder, a full disk) protects nothing from then
  on and evicts least recently used first; it is logged once and never fails a read or a write. Each process
  remembers what it promoted, so a read of a blob it knows protected writes nothing.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROTECTED_SHARE = 0.8  # of the bound: what blobs read since stored may hold before the oldest go back on probation
FILE = "protected.sqlite"


def eviction_order(blobs: Sequence[tuple[str, int]], protected: Collection[str], max_bytes: int
                   ) -> tuple[list[str], list[str]]:
    """The order in which to evict ``blobs`` (``(key, size)``, least recently used first) and the protected keys
    put back on probation (see the module contract).
    """
    guarded = [(key, size) for key, size in blobs if key in protected]  # least recently used first
    over = sum(size for _, size in guarded) - int(PROTECTED_SHARE * max_bytes)
    demoted = []
    for key, size in guarded:
        if over <= 0:
            break
        demoted.append(key)
        over -= size
    probation = [key for key, _ in blobs if key not in protected]
    return probation + demoted + [key for key, _ in guarded[len(demoted):]], demoted


class ProtectedBlobs:
    """The protected set of the bounded disk store under ``root`` (see the module contract)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / FILE
        self._lock = threading.Lock()
        self._known: set[str] = set()  # promoted by this process (a cache of the table, never wrong for long)
        self._db: sqlite3.Connection | None = None
        try:
            db = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            db.execute("CREATE TABLE IF NOT EXISTS protected (key TEXT PRIMARY KEY)")
            self._db = db
        except sqlite3.Error as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        log.warning("%s: reads are not recorded (%s); eviction follows last use alone", self.path, exc)
        if self._db is not None:
            self._db.close()
        self._db = None

    def _write(self, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
        with self._lock:
            if self._db is None:
                return
            try:
                with self._db:
                    self._db.execute("BEGIN IMMEDIATE")
                    self._db.executemany(sql, rows)
            except sqlite3.Error as exc:
                self._give_up(exc)

    def promote(self, key: str) -> None:
        """``key``'s blob was read: protected from now on."""
        if key not in self._known:
            self._write("INSERT OR IGNORE INTO protected VALUES (?)", [(key,)])
            self._known.add(key)

    def demote(self, keys: Iterable[str]) -> None:
        """``keys`` are back on probation, or gone (evicted or deleted)."""
        keys = list(keys)
        if keys:
            self._known.difference_update(keys)
            self._write("DELETE FROM protected WHERE key = ?", [(key,) for key in keys])

    def keys(self) -> set[str]:
        """The protected keys, as every process recorded them."""
        with self._lock:
            if self._db is None:
                return set()
            try:
                found = {key for (key,) in self._db.execute("SELECT key FROM protected")}
            except sqlite3.Error as exc:
                self._give_up(exc)
                return set()
            self._known &= found  # another process may have put some back
        return found

    def close(self) -> None:
        """Close the database; from then on nothing is protected."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
