"""The storage layer's name for `kvrag.atomic_files`: atomic writes, stale-temp cleanup and the writer lock.

The functions live in the foundation module `kvrag.atomic_files`, so that stages below storage (the
codec's cachegen state) write files atomically without importing storage; this module re-exports them
unchanged for the storage layer and the stages above it.
"""

from __future__ import annotations

from kvrag.atomic_files import (
    atomic_write_bytes,
    atomic_write_json,
    exclusive_lock,
    fsync_dir,
    read_json,
    remove_stale_temps,
)

__all__ = ["atomic_write_bytes", "atomic_write_json", "exclusive_lock", "fsync_dir", "read_json", "remove_stale_temps"]
