"""Chunk-cache storage: a tiny byte-store interface with a name-keyed factory, and `KVStore`,
which puts chunk caches through a codec and the container format.

Stored tensors are ``[layers, kv_heads, seq, head_dim]`` with keys pre-RoPE.

Several quality levels per chunk (for the adaptive loader): a chunk's cache at the store codec's
own level lives under its key, as always; `KVStore.put_levels` also stores it at other levels of the
same codec (sharing the fitted codec state) under derived keys ``level_key(key, level)`` — the key
followed by two hex digits of the level. ``load(key, level=...)``, ``reader(key, level=...)``,
``contains(key, level=...)`` and ``nbytes(key, level=...)`` address one level; `stored_levels`
lists what is present, and `discard` removes every level.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from kvrag.storage.atomic import atomic_write_bytes
from kvrag.codec.base import Codec
from kvrag.storage.container import ChunkReader, encode_chunk
from kvrag.errors import CorruptChunkError

log = logging.getLogger(__name__)


class ByteStore(ABC):
    """Keyed blobs. Keys are hex content hashes."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def open(self, key: str) -> BinaryIO | None:
        """A readable binary file for ``key``, or None when absent."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def nbytes(self, key: str) -> int:
        fh = self.open(key)
        if fh is None:
            return 0
        with fh:
            return fh.seek(0, io.SEEK_END)

    def close(self) -> None:
        """Release resources."""


class DiskStore(ByteStore):
    """One file per chunk under ``root/ab/abcdef….kvc``, written atomically."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"chunk key must be lowercase hex, got {key!r}")
        return self.root / key[:2] / f"{key}.kvc"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(path, data, fsync=self.fsync)

    def open(self, key: str) -> BinaryIO | None:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class MemoryStore(ByteStore):
    """In-process store, for tests and short-lived indexes."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> None:
        self._data[key] = bytes(data)

    def open(self, key: str) -> BinaryIO | None:
        data = self._data.get(key)
        return None if data is None else io.BytesIO(data)

    def contains(self, key: str) -> bool:
        return key in self._data

    def delete(self, key: str) -> None:
        self._data.pop(key, None)


class ThrottledStore(ByteStore):
    """Another store read through one link of ``bytes_per_s``: every read waits its turn on the link
    and takes ``size / bytes_per_s``. It stands in for a remote store (object storage, a network
    file system) in benchmarks and tests; its files have no descriptor, so readers take the
    buffered path. Writes go straight through.
    """

    def __init__(self, inner: ByteStore, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.inner, self.bytes_per_s = inner, float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link finishes the reads already queued on it

    def wait(self, nbytes: int) -> None:
        """Hold the calling thread while ``nbytes`` cross the link after the reads queued before."""
        with self._lock:
            done = max(time.perf_counter(), self._free_at) + nbytes / self.bytes_per_s
            self._free_at = done
        time.sleep(max(0.0, done - time.perf_counter()))

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def open(self, key: str) -> BinaryIO | None:
        fh = self.inner.open(key)
        return None if fh is None else cast(BinaryIO, _ThrottledFile(fh, self))

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def nbytes(self, key: str) -> int:
        return self.inner.nbytes(key)

    def close(self) -> None:
        self.inner.close()


class _ThrottledFile(io.RawIOBase):
    """A read-only file of a `ThrottledStore`: reads pay the link's time."""

    def __init__(self, fh: BinaryIO, store: ThrottledStore) -> None:
        self._fh, self._store = fh, store

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def readinto(self, buffer: Any) -> int:
        got = cast(io.BufferedIOBase, self._fh).readinto(buffer)  # files and BytesIO both have it
        self._store.wait(got)
        return got

    def close(self) -> None:
        self._fh.close()
        super().close()


def make_store(backend: str, root: str | os.PathLike[str] | None = None, fsync: bool = True) -> ByteStore:
    """Build a byte store by name: ``disk`` (needs ``root``) or ``memory``."""
    if backend == "disk":
        if root is None:
            raise ValueError("the 'disk' store needs a root directory")
        return DiskStore(root, fsync=fsync)
    if backend == "memory":
        return MemoryStore()
    raise ValueError(f"unknown store backend {backend!r}; expected 'disk' or 'memory'")


def level_key(key: str, level: int) -> str:
    """The store key of ``key``'s cache at a quality level other than the index's own."""
    if not 0 <= level < 256:
        raise ValueError(f"level must be in 0..255, got {level}")
    return f"{key}{level:02x}"


class KVStore:
    """Chunk caches in and out of a `ByteStore` through a `Codec`."""

    def __init__(self, store: ByteStore, codec: Codec, fingerprint: str) -> None:
        self.store, self.codec, self.fingerprint = store, codec, fingerprint

    def codec_at(self, level: int | None) -> Codec:
        """The store codec at ``level`` (its own level when None), sharing its fitted state."""
        if level is None or level == self.codec.level:
            return self.codec
        return self.codec.with_level(level)

    def _key(self, key: str, level: int | None) -> str:
        return key if level is None or level == self.codec.level else level_key(key, level)

    def put_levels(self, key: str, keys: torch.Tensor, values: torch.Tensor,
                   levels: tuple[int, ...] | None = None) -> dict[int, int]:
        """Store one chunk at several quality levels (all the codec's when None); sizes by level."""
        sizes = {}
        for level in self.codec.levels() if levels is None else levels:
            codec = self.codec_at(level)
            data = encode_chunk(codec, self._key(key, level), self.fingerprint, keys, values)
            self.store.put(self._key(key, level), data)
            sizes[level] = len(data)
        return sizes

    def stored_levels(self, key: str) -> list[int]:
        """The quality levels at which ``key`` is present."""
        return [lv for lv in self.codec.levels() if self.store.contains(self._key(key, lv))]

    def nbytes(self, key: str, level: int | None = None) -> int:
        """Stored size of ``key`` at ``level`` in bytes (0 when absent)."""
        return self.store.nbytes(self._key(key, level))

    def put(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Encode and store one chunk (``[L, H, S, D]`` each); returns the stored size in bytes."""
        data = encode_chunk(self.codec, key, self.fingerprint, keys, values)
        self.store.put(key, data)
        return len(data)

    def contains(self, key: str, level: int | None = None) -> bool:
        return self.store.contains(self._key(key, level))

    def reader(self, key: str, level: int | None = None) -> ChunkReader:
        """An open, header-checked reader; `CorruptChunkError` when missing or damaged."""
        stored = self._key(key, level)
        fh = self.store.open(stored)
        if fh is None:
            suffix = "" if stored == key else f" at level {level}"
            raise CorruptChunkError(key, f"missing from the store{suffix}")
        try:
            return ChunkReader(stored, fh, self.codec_at(level), self.fingerprint)
        except CorruptChunkError:
            fh.close()
            raise

    def load(self, key: str, level: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a whole chunk: ``(keys, values)``, each ``[L, H, S, D]``, at ``level`` (default: own)."""
        with self.reader(key, level) as reader:
            return reader.decode_all()

    def is_valid(self, key: str) -> bool:
        """Whether the chunk is present and every layer passes its checksum (no decoding)."""
        try:
            reader = self.reader(key)
        except CorruptChunkError:
            return False
        with reader:
            try:
                for i in range(reader.header.n_layers):
                    reader.read_layer_bytes(i)
            except CorruptChunkError:
                return False
        return True

    def discard(self, key: str) -> None:
        log.warning("discarding stored cache of chunk %s", key)
        self.store.delete(key)
        for level in self.codec.levels():
            if level != self.codec.level:
                self.store.delete(level_key(key, level))
