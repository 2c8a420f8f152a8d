"""`KVStore`: chunk caches in and out of a `ByteStore` through a codec and the container format.

Contract: stored tensors are ``[layers, kv_heads, seq, head_dim]`` with keys pre-RoPE; every blob is a
container (`kvrag.storage.container`) checked against the index's model fingerprint on read. A chunk
that is missing or damaged raises `CorruptChunkError` from `KVStore.reader` / `KVStore.load`.

Several quality levels per chunk (for the adaptive loader): a chunk's cache at the store codec's
own level lives under its key, as always; `KVStore.put_levels` also stores it at other levels of the
same codec (sharing the fitted codec state) under derived keys ``level_key(key, level)`` — the key
followed by two hex digits of the level. ``load(key, level=...)``, ``reader(key, level=...)``,
``contains(key, level=...)`` and ``nbytes(key, level=...)`` address one level; `stored_levels`
lists what is present, and `discard` removes every level.
"""

from __future__ import annotations

import logging

import torch

from kvrag.codec.base import Codec
from kvrag.errors import CorruptChunkError
from kvrag.storage.container import ChunkReader, encode_chunk
from kvrag.storage.stores.base import ByteStore

log = logging.getLogger(__name__)


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
