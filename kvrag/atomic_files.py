"""Atomic file writes: a reader sees the old file or the new one, never a mix.

Foundation: this module imports nothing of kvrag, so every stage may use it (the codec's cachegen
state, the storage layer's stores and index, the chat's disk tier); `kvrag.storage.atomic` re-exports it.

Every write goes to a temporary file in the destination's directory, is flushed and fsynced, then
renamed over the destination with `os.replace` (atomic on POSIX); finally the directory itself is
fsynced so the rename survives a power loss. A process killed mid-write leaves at most a stray
``.<name>.*.tmp`` file beside the destination, which `remove_stale_temps` clears.
`exclusive_lock` serialises writers across processes (POSIX ``flock``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TEMP_SUFFIX = ".tmp"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Fsync a directory so that renames inside it are durable (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o644


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically.

    Args:
        path: destination file; its directory must exist.
        data: the complete new contents.
        fsync: fsync the file and its directory (turn off only for scratch data in tests).

    Example:
        >>> atomic_write_bytes(tmp_path / "blob.bin", b"payload")  # doctest: +SKIP
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=_TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _mode_for(path))  # mkstemp creates 0600
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        _unlink_quietly(Path(tmp_name))
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, fsync: bool = True) -> None:
    """Write ``obj`` as JSON (sorted keys, indent 2, trailing newline) to ``path`` atomically."""
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file written by `atomic_write_json`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def remove_stale_temps(path: str | os.PathLike[str]) -> int:
    """Delete temporary files left beside ``path`` by killed writers; return how many.

    Call it only while holding the lock that serialises writers of ``path``: otherwise it may
    delete a live writer's temporary file.
    """
    path = Path(path)
    removed = 0
    for stale in path.parent.glob(f"{_temp_prefix(path)}*{_TEMP_SUFFIX}"):
        if _unlink_quietly(stale):
            removed += 1
    if removed:
        logger.info("removed %d stale temporary file(s) beside %s", removed, path)
    return removed


@contextmanager
def exclusive_lock(lock_path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``flock(LOCK_EX)`` on ``lock_path`` (created if missing) for the ``with`` block.

    The lock belongs to the open file, so two holders in one process exclude each other too; it
    is released when the block exits or the process dies.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
