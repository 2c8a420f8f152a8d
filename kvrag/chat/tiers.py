"""Conversations' kept KV across tiers: GPU memory (when the model is on a GPU), host memory, local disk.

Contract:

- Entries are `HistoryKV`s under string keys (a digest of the conversation's token ids); an entry's
  leading messages can be found under their own keys too (`put`'s ``prefixes``). Each tier holds
  at most its configured bytes (`kvrag.config.SessionConfig`); a new entry enters the top tier and what
  no longer fits moves down a tier (to disk as a safetensors file, one tensor per layer, written
  atomically), and off the bottom. A tier too small for an entry passes it down.
- `get` looks top-down, counts a hit for the tier it found the entry in (a miss when none) and moves
  the entry to the top tier, reading a disk entry layer by layer.
- Scheduler-aware (CachedAttention): `expect` marks keys a queued request will read. They are evicted
  only when nothing else can go, and an expected entry on disk is read back to host memory ahead of its
  request, in the background. `release` ends that. Among the rest, the least recently used goes first.
- `put` may be called from a background thread; every method is thread-safe.
- The disk tier degrades, never fails a request: an entry that cannot be written (a full disk) or read back
  (a damaged file) is dropped, counted (``write_errors``, ``read_errors``) and warned about once.
- A disk tier in a folder of the caller's (``disk_dir``) outlives the process: its entries sit in a subfolder
  named by ``scope`` (the model's fingerprint), each file written whole under a temporary name and renamed, and a
  new `SessionTiers` over that folder finds them again, least recently written first, up to its bound; only
  ``<32 hex digits>.safetensors`` files are entries, so a file a killed writer left half-written (its temporary
  name) is never read, and one older than a minute is removed.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from kvrag.byte_lru import ByteLRU
from kvrag.chat.history import HistoryKV
from kvrag.config import SessionConfig
from kvrag.storage.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

ENTRY_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
STALE_TEMP_S = 60.0  # a temporary file older than this was left by a killed writer


class _Tier:
    """One bounded tier: entries by key in least-recently-used order."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.entries: ByteLRU[str, Any] = ByteLRU(limit)  # a HistoryKV, or on disk its file's path
        self.hits = 0

    def stats(self) -> dict[str, int]:
        held = self.entries
        return {"hits": self.hits, "bytes": held.nbytes, "limit": held.max_bytes, "entries": len(held)}


class SessionTiers:
    """The tiered store of conversations' KV (see the module contract)."""

    def __init__(self, config: SessionConfig, device: torch.device, scope: str = "") -> None:
        self.config = config
        self.device = device
        names = (["device"] if device.type == "cuda" and config.device_bytes else []) + ["host"]
        self.tiers = [_Tier(n, config.device_bytes if n == "device" else config.host_bytes) for n in names]
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if config.disk_bytes:
            if config.disk_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="kvrag-sessions-")
            self.disk_dir = Path(config.disk_dir or self._tmp.name)  # type: ignore[union-attr]
            if config.disk_dir is not None and scope:
                self.disk_dir = self.disk_dir / scope
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self.tiers.append(_Tier("disk", config.disk_bytes))
        self.lookups = self.misses = self.write_errors = self.read_errors = 0
        self.expected: dict[str, int] = {}
        self.aliases: dict[str, tuple[str, int]] = {}  # a prefix's key -> (the entry holding it, its tokens)
        self._lock = threading.RLock()
        self._reading: dict[str, threading.Event] = {}
        if config.disk_bytes and config.disk_dir is not None:
            self._find_kept_entries()

    def _find_kept_entries(self) -> None:
        """Take up the entries an earlier process left in the disk folder (oldest first), within the bound."""
        disk, now = self.tiers[-1], time.time()
        found = []
        for path in self.disk_dir.iterdir():
            try:
                stat = path.stat()
            except OSError:
                continue
            if ENTRY_NAME.fullmatch(path.name):
                found.append((stat.st_mtime, path, stat.st_size))
            elif path.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_S:
                path.unlink(missing_ok=True)  # half-written by a killed writer: never an entry
        kept, used = [], 0
        for _, path, size in sorted(found, reverse=True):  # the most recent first, while they fit
            if used + size > disk.entries.max_bytes:
                path.unlink(missing_ok=True)
                continue
            kept.append((path, size))
            used += size
        for path, size in reversed(kept):  # least recent first, as in LRU order
            disk.entries.put(path.name.removesuffix(".safetensors"), path, size)

    # -- reading --------------------------------------------------------------------------------

    def find(self, keys: list[str]) -> tuple[HistoryKV, str] | None:
        """The first of ``keys`` held (one lookup: a hit for its tier, else a miss), moved to the top tier,
        with the name of the tier it was found in.
        """
        with self._lock:
            self.lookups += 1
            reading = [self._reading[k] for k in keys if k in self._reading]
        for event in reading:  # a read-ahead is bringing it up from disk: wait for it
            event.wait()
        with self._lock:
            for key in keys:
                target, length = self.aliases.get(key, (key, None)) if not self.contains(key) else (key, None)
                for tier in self.tiers:
                    if target in tier.entries:
                        try:
                            entry = self._take(tier, target)
                        except Exception as exc:  # a damaged disk entry: dropped, a miss
                            self._count_error("read", exc)
                            break
                        tier.hits += 1
                        self._insert(0, target, entry)
                        return (entry if length is None else entry.head(length)), tier.name
            self.misses += 1
            return None

    def get(self, key: str) -> tuple[HistoryKV, str] | None:
        """`find` of one key."""
        return self.find([key])

    def contains(self, key: str) -> bool:
        """Whether some tier holds ``key`` (no hit or miss counted)."""
        with self._lock:
            return any(key in tier.entries for tier in self.tiers)

    def _take(self, tier: _Tier, key: str) -> HistoryKV:
        """Remove ``key`` from ``tier`` and return it in memory on the top tier's device."""
        return self._arrived(tier, tier.entries.pop(key))

    def _arrived(self, tier: _Tier, value: Any) -> HistoryKV:
        """A value removed from ``tier``, in memory on the top tier's device (a disk entry read and deleted)."""
        if tier.name == "disk":
            path = value
            try:
                value = _read_file(path, self._device_of(0))
            finally:
                path.unlink(missing_ok=True)
        return value.to(self._device_of(0))

    def _count_error(self, kind: str, exc: BaseException) -> None:
        """Count a disk tier ``kind`` ("read"/"write") error; warn on the first of each kind."""
        count = getattr(self, f"{kind}_errors") + 1
        setattr(self, f"{kind}_errors", count)
        if count == 1:
            log.warning("the conversations' disk tier could not %s an entry (%s); it is dropped and recomputed "
                        "when needed (further failures are counted, not logged)", kind, exc)

    def _device_of(self, level: int) -> torch.device:
        return self.device if self.tiers[level].name == "device" else torch.device("cpu")

    # -- writing --------------------------------------------------------------------------------

    def put(self, key: str, entry: HistoryKV, prefixes: dict[str, int] | None = None) -> None:
        """Keep ``entry`` under ``key`` in the top tier (replacing an older one), pushing others down.

        ``prefixes`` maps the keys of ``entry``'s leading messages to their token counts: those keys then
        find ``entry``'s first rows, and entries kept under them (earlier turns of the same conversation)
        are dropped, so a conversation is held once however many turns it has.
        """
        with self._lock:
            for old in [key, *(prefixes or {})]:
                for tier in self.tiers:
                    if old in tier.entries:
                        self._drop(tier, old)
            for alias, length in (prefixes or {}).items():
                self.aliases[alias] = (key, length)
            self._insert(0, key, entry)

    def _insert(self, level: int, key: str, entry: HistoryKV) -> None:
        if level >= len(self.tiers):  # off the bottom tier, with the prefixes that pointed into it
            self._forget(key)
            return
        tier = self.tiers[level]
        size = entry.nbytes
        if not tier.entries.fits(size):
            self._insert(level + 1, key, entry)
            return
        for victim, value in tier.entries.make_room(size, self._victim):
            if level + 1 >= len(self.tiers):  # off the bottom: nothing to read back
                _discard(tier, value)
                self._forget(victim)
            else:
                self._insert(level + 1, victim, self._arrived(tier, value))
        if tier.name == "disk":
            path = self.disk_dir / f"{key}.safetensors"
            try:
                atomic_write_bytes(path, _to_bytes(entry), fsync=False)
            except OSError as exc:  # a full disk: the entry goes off the bottom
                self._count_error("write", exc)
                self._insert(level + 1, key, entry)
                return
            tier.entries.put(key, path, size)
        else:
            tier.entries.put(key, entry.to(self._device_of(level)), size)

    def _forget(self, key: str) -> None:
        """Drop the prefixes that pointed into the entry ``key``, which no tier holds any more."""
        self.aliases = {a: (k, n) for a, (k, n) in self.aliases.items() if k != key}

    def _victim(self, keys: list[str]) -> str:
        """Of a tier's ``keys`` (least recently used first), the first not expected by a queued request (else the
        first).
        """
        return next((key for key in keys if key not in self.expected), keys[0])

    def _drop(self, tier: _Tier, key: str) -> None:
        _discard(tier, tier.entries.pop(key))

    # -- scheduling -----------------------------------------------------------------------------

    def expect(self, key: str) -> None:
        """A queued request will read ``key``: keep it and bring it up from disk in the background."""
        with self._lock:
            self.expected[key] = self.expected.get(key, 0) + 1
            disk = self.tiers[-1] if self.tiers[-1].name == "disk" else None
            if disk is None or key not in disk.entries or key in self._reading:
                return
            event = self._reading[key] = threading.Event()
        threading.Thread(target=self._prefetch, args=(key, event), daemon=True).start()

    def _prefetch(self, key: str, event: threading.Event) -> None:
        try:
            with self._lock:
                disk = self.tiers[-1]
                if key in disk.entries:
                    entry = self._take(disk, key)
                    self._insert(max(0, len(self.tiers) - 2), key, entry)
        except Exception as exc:  # a damaged entry: dropped; the request's path then finds no entry
            with self._lock:
                self._count_error("read", exc)
        finally:
            with self._lock:
                self._reading.pop(key, None)
            event.set()

    def release(self, key: str) -> None:
        """The request that expected ``key`` is done."""
        with self._lock:
            left = self.expected.get(key, 0) - 1
            if left > 0:
                self.expected[key] = left
            else:
                self.expected.pop(key, None)

    def stats(self) -> dict[str, Any]:
        """Lookups, misses, and per tier its hits, bytes, limit and entries."""
        with self._lock:
            return {"lookups": self.lookups, "misses": self.misses, "write_errors": self.write_errors,
                    "read_errors": self.read_errors, "tiers": {tier.name: tier.stats() for tier in self.tiers}}

    def close(self) -> None:
        """Drop every entry in memory, and the temporary disk folder; a folder of the caller's keeps its entries."""
        with self._lock:
            for tier in self.tiers:
                if tier.name == "disk" and self._tmp is None:
                    continue
                for key in list(tier.entries):
                    self._drop(tier, key)
            self.aliases.clear()
        if self._tmp is not None:
            self._tmp.cleanup()


def _discard(tier: _Tier, value: Any) -> None:
    """Let go of a value removed from ``tier`` (a disk entry's file is deleted)."""
    if tier.name == "disk":
        value.unlink(missing_ok=True)


def _to_bytes(entry: HistoryKV) -> bytes:
    tensors = {f"k.{i}": entry.keys[i].contiguous().cpu() for i in range(entry.keys.shape[0])}
    tensors.update({f"v.{i}": entry.values[i].contiguous().cpu() for i in range(entry.values.shape[0])})
    tensors["ids"] = torch.tensor(entry.ids, dtype=torch.long)
    tensors["spans"] = torch.tensor(entry.spans, dtype=torch.long).reshape(-1, 2)
    return save(tensors)


def _read_file(path: Path, device: torch.device) -> HistoryKV:
    """An entry read back layer by layer."""
    with safe_open(str(path), framework="pt") as f:
        n_layers = sum(1 for name in f.keys() if name.startswith("k."))
        keys = torch.stack([f.get_tensor(f"k.{i}") for i in range(n_layers)]).to(device)
        values = torch.stack([f.get_tensor(f"v.{i}") for i in range(n_layers)]).to(device)
        ids = f.get_tensor("ids").tolist()
        spans = [(int(m), int(n)) for m, n in f.get_tensor("spans").tolist()]
    return HistoryKV(ids, spans, keys, values)
