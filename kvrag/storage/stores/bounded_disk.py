"""The ``bounded-file`` store (alias ``lru-file``): a `DiskStore` bounded in bytes, evicting blobs not read
again first.

Contract:

- Blobs are files as in `DiskStore`, written atomically (a temporary file renamed into place), so a reader in any
  process sees a whole blob or none, and two processes may share one root.
- ``max_bytes`` bounds the blobs under the root. Before a `put` would take this process's count of them past the
  bound, the root is scanned and blobs are deleted in the order below until the blobs, the new one included,
  hold at most `LOW_WATER` of the bound. The root is also scanned every `RESCAN_PUTS` puts, so blobs that other
  processes wrote are counted. With one writer the bound always holds; with several, each may add one blob
  before it sees the others' (at most one blob per concurrent writer over it).
- Eviction is a segmented LRU (`kvrag.storage.stores.protected_blobs`): a stored blob is on probation until read,
  then protected, up to `PROTECTED_SHARE` of the bound; probation's least recently used go first. So a passage read
  again outlives a stream of passages stored once, which an LRU bound would let evict it. Recency is a blob file's
  modification time, set by `put`, `open` and `touch` (``os.utime``); the protected set is kept in
  ``root/protected.sqlite``, shared by the processes on the root. `nbytes`, `contains` and `peek` are not reads. A blob
  stored by an older kvrag is on probation. A blob deleted while another process reads it stays readable through
  the open file.
- A blob larger than ``max_bytes`` is not stored (`put` returns, logging why); the text it was computed from is
  always there to compute it again.
- `put_state`/`get_state` keep small named blobs (a codec's fitted state) in ``root/state/``, never evicted;
  `put_state` writes only when the name is absent and returns what is stored, so racing writers agree on one.
- ``evicted`` counts the blobs this process deleted; `held` is the bytes of blobs at the last scan plus those this
  process wrote since; `popularity` gives the blobs and bytes protected and on probation at the last scan.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

from kvrag.atomic_files import atomic_write_bytes
from kvrag.storage.stores.base import register_store
from kvrag.storage.stores.disk import DiskStore
from kvrag.storage.stores.protected_blobs import ProtectedBlobs, eviction_order

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # an eviction frees room down to this fraction of the bound
RESCAN_PUTS = 64  # puts between scans that count other processes' blobs
_STATE = "state"


@register_store("bounded-file", "lru-file")
class BoundedDiskStore(DiskStore):
    """A disk store of at most ``max_bytes`` of blobs, those not read again evicted first (see the module contract).

    Args:
        root: the folder (created if missing).
        max_bytes: the bound on the blobs' bytes.
        fsync: whether writes are flushed to stable storage before they return.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, fsync: bool = True) -> None:
        if not max_bytes > 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        super().__init__(root, fsync)
        self.max_bytes = int(max_bytes)
        self.evicted = 0
        self._lock = threading.Lock()
        self._puts = 0
        self.protected = ProtectedBlobs(self.root)
        self._segments = {"protected_blobs": 0, "protected_bytes": 0, "probation_blobs": 0, "probation_bytes": 0}
        self._held = self._scan_total()

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> BoundedDiskStore:
        """A store at ``root`` bounded by ``options["max_bytes"]``."""
        if root is None or "max_bytes" not in options or set(options) != {"max_bytes"}:
            raise ValueError(f"the {cls.name!r} store needs a root and max_bytes=, and takes nothing else")
        return cls(root, int(options["max_bytes"]), fsync)

    def _blobs(self) -> list[tuple[int, int, Path]]:
        """(modification time in ns, size, path) of every blob under the root (files that vanish meanwhile: none)."""
        found = []
        for folder in os.scandir(self.root):
            if not folder.is_dir(follow_symlinks=False) or len(folder.name) != 2:
                continue
            for entry in os.scandir(folder.path):
                if entry.name.endswith(".kvc") and entry.is_file(follow_symlinks=False):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime_ns, st.st_size, Path(entry.path)))
        return found

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._blobs())

    def _make_room(self, size: int) -> None:
        """Scan the root and delete blobs, least valuable first, until ``size`` more bytes fit under the low water."""
        scanned = sorted(self._blobs())  # least recently used first
        paths = {path.stem: path for _, _, path in scanned}
        sizes = {path.stem: blob_size for _, blob_size, path in scanned}
        protected = self.protected.keys()
        order, demoted = eviction_order(list(sizes.items()), protected, self.max_bytes)
        total, target, gone = sum(sizes.values()), int(self.max_bytes * LOW_WATER) - size, set()
        for key in order:
            if total <= target:
                break
            paths[key].unlink(missing_ok=True)
            total -= sizes[key]
            gone.add(key)
        # one transaction: put back, evicted while protected, or vanished since their last read
        self.protected.demote({*demoted, *(protected & gone), *protected.difference(paths)})
        for key in set(demoted) - gone:  # back on probation as if just stored
            self._mark_used(paths[key])
        protected = protected.intersection(paths).difference(demoted, gone)
        guarded = sum(sizes[key] for key in protected)
        self.evicted += len(gone)
        self._held = total
        self._segments = {"protected_blobs": len(protected), "protected_bytes": guarded,
                          "probation_blobs": len(paths) - len(gone) - len(protected),
                          "probation_bytes": total - guarded}

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` after making room for it (a blob over ``max_bytes`` is not stored)."""
        size = len(data)
        if size > self.max_bytes:
            log.info("a %d-byte blob exceeds the cache's bound of %d bytes; not stored", size, self.max_bytes)
            return
        with self._lock:
            self._puts += 1
            if self._held + size > self.max_bytes or self._puts % RESCAN_PUTS == 0:
                self._make_room(size)
            super().put(key, data)
            self._held += size

    def held(self) -> int:
        """The bytes of the blobs held: at the last scan, plus those this process wrote since."""
        return self._held

    @staticmethod
    def _mark_used(where: Path | int) -> bool:
        """Set the blob's modification time (a path or an open file's descriptor) to now; False when absent."""
        try:
            os.utime(where)
        except FileNotFoundError:
            return False
        except OSError:  # a read-only cache still serves its blobs
            pass
        return True

    def open(self, key: str) -> BinaryIO | None:
        """The blob's file, marked as read (protected, just used); None when absent."""
        fh = super().open(key)
        if fh is not None:
            self._mark_used(fh.fileno())
            self.protected.promote(key)
        return fh

    def peek(self, key: str) -> BinaryIO | None:
        """The blob's file, not marked as read (neither protected nor just used); None when absent."""
        return super().open(key)

    def touch(self, key: str) -> None:
        """Mark the blob as read (a read served from memory), as `open` does; nothing when it is absent."""
        if self._mark_used(self._path(key)):
            self.protected.promote(key)

    def delete(self, key: str) -> None:
        """Remove the blob (and its place among the protected)."""
        super().delete(key)
        self.protected.demote([key])

    def popularity(self) -> dict[str, int]:
        """The blobs and bytes protected (read since stored) and on probation, at the last scan."""
        return dict(self._segments)

    def close(self) -> None:
        """Close the protected set's database."""
        self.protected.close()
        super().close()

    def _state_path(self, name: str) -> Path:
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"a state name is letters, digits, '-', '_' and '.', got {name!r}")
        return self.root / _STATE / name

    def get_state(self, name: str) -> bytes | None:
        """The state blob ``name``, or None when absent."""
        try:
            return self._state_path(name).read_bytes()
        except FileNotFoundError:
            return None

    def put_state(self, name: str, data: bytes) -> bytes:
        """Store the state blob ``name`` unless one is there; returns the stored one (the first writer's)."""
        path = self._state_path(name)
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}")
        atomic_write_bytes(temp, data, fsync=self.fsync)
        try:
            os.link(temp, path)  # fails when another writer was first
        except FileExistsError:
            pass
        finally:
            temp.unlink(missing_ok=True)
        return path.read_bytes()
