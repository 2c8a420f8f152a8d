"""Chunk-cache storage: a tiny byte-store interface with a name-keyed factory, and `KVStore`,
which puts chunk caches through a codec and the container format.

Stored tensors are ``[layers, kv_heads, seq, head_dim]`` with keys pre-RoPE.
"""

from __future__ import annotations

import io
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import BinaryIO

import torch

from kvrag.atomic import atomic_write_bytes
from kvrag.codec.base import Codec
from kvrag.container import ChunkReader, encode_chunk
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


def make_store(backend: str, root: str | os.PathLike[str] | None = None, fsync: bool = True) -> ByteStore:
    """Build a byte store by name: ``disk`` (needs ``root``) or ``memory``."""
    if backend == "disk":
        if root is None:
            raise ValueError("the 'disk' store needs a root directory")
        return DiskStore(root, fsync=fsync)
    if backend == "memory":
        return MemoryStore()
    raise ValueError(f"unknown store backend {backend!r}; expected 'disk' or 'memory'")


class KVStore:
    """Chunk caches in and out of a `ByteStore` through a `Codec`."""

    def __init__(self, store: ByteStore, codec: Codec, fingerprint: str) -> None:
        self.store, self.codec, self.fingerprint = store, codec, fingerprint

    def put(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Encode and store one chunk (``[L, H, S, D]`` each); returns the stored size in bytes."""
        data = encode_chunk(self.codec, key, self.fingerprint, keys, values)
        self.store.put(key, data)
        return len(data)

    def contains(self, key: str) -> bool:
        return self.store.contains(key)

    def reader(self, key: str) -> ChunkReader:
        """An open, header-checked reader; `CorruptChunkError` when missing or damaged."""
        fh = self.store.open(key)
        if fh is None:
            raise CorruptChunkError(key, "missing from the store")
        try:
            return ChunkReader(key, fh, self.codec, self.fingerprint)
        except CorruptChunkError:
            fh.close()
            raise

    def load(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a whole chunk: ``(keys, values)``, each ``[L, H, S, D]``."""
        with self.reader(key) as reader:
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
