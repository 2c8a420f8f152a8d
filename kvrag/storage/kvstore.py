"""`KVStore`: chunk caches in and out of a `ByteStore` through a codec and the container format.

Contract: stored tensors are ``[layers, kv_heads, seq, head_dim]`` with keys pre-RoPE; every blob is a
container (`kvrag.storage.container`) checked against the index's model fingerprint on read. A chunk
that is missing or damaged raises `CorruptChunkError` from `KVStore.reader` / `KVStore.load`; one whose
store cannot be reached raises its subclass `ChunkUnavailableError` (the store has warned once for the
outage: `log_recovery` logs such a recovery at debug level, any other at warning level).

Several quality levels per chunk (for the adaptive loader): a chunk's cache at the store codec's
own level lives under its key, as always; `KVStore.put_levels` also stores it at other levels of the
same codec (sharing the fitted codec state) under derived keys ``level_key(key, level)`` — the key
followed by two hex digits of the level. ``load(key, level=...)``, ``reader(key, level=...)``,
``contains(key, level=...)`` and ``nbytes(key, level=...)`` address one level (`contains_levels`:
several); `stored_levels` lists what is present, and `discard` removes every level. `level_sizes` gives the
stored size of each chunk at each level (one request to a network store; remembered, as keys are content hashes) and
`throughput` the store link's recent bytes per second (None for a local store, or before any read):
what the streaming loader plans with (`kvrag.query.plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvrag.codec.base import Codec
from kvrag.errors import ChunkUnavailableError, CorruptChunkError, StoreUnavailableError
from kvrag.storage.container import ChunkReader, encode_chunk
from kvrag.storage.decoded_tier import DEFAULT_DECODED_BYTES, DecodedTier
from kvrag.storage.stores.base import ByteStore

log = logging.getLogger(__name__)


def level_key(key: str, level: int) -> str:
    """The store key of ``key``'s cache at a quality level other than the index's own."""
    if not 0 <= level < 256:
        raise ValueError(f"level must be in 0..255, got {level}")
    return f"{key}{level:02x}"


def log_recovery(logger: logging.Logger, exc: CorruptChunkError, then: str = "recomputing it from its text") -> None:
    """Log that a chunk's cache is recovered after ``exc``: at debug level when its store is unreachable (the
    store warned once for the outage), else as a warning.
    """
    level = logging.DEBUG if isinstance(exc, ChunkUnavailableError) else logging.WARNING
    logger.log(level, "%s; %s", exc, then)


class KVStore:
    """Chunk caches in and out of a `ByteStore` through a `Codec`.

    ``windows`` (per layer, None for a layer without a sliding window): each windowed layer stores only a chunk's
    last ``window`` rows (`kvrag.storage.container.encode_chunk`). ``decoded``: the process's tier of hot caches
    kept decoded (`DecodedTier`, ``decoded_bytes`` of them; 0 turns it off), which the question-time feed reads
    before the store (`kvrag.loading.tiered_feed`).
    """

    SIZES_KEPT = 100_000  # stored sizes remembered (content-hash keys: a size changes only if its blob is damaged)

    def __init__(self, store: ByteStore, codec: Codec, fingerprint: str,
                 windows: Sequence[int | None] | None = None, decoded_bytes: int = DEFAULT_DECODED_BYTES) -> None:
        self.store, self.codec, self.fingerprint = store, codec, fingerprint
        self.decoded = DecodedTier(decoded_bytes)
        self.windows = list(windows) if windows is not None and any(w is not None for w in windows) else None
        self._sizes: dict[str, int] = {}
        self.found = self.missing = 0  # caches asked of `reader`: found in the store, or not (evicted, never stored)

    def stats(self) -> dict[str, int]:
        """Caches found and missing (`reader`), the decoded tier's (`DecodedTier.stats`), and for a store bounded in
        bytes its bytes held, its bound and what it evicts by (``popularity``: the eviction clock, blobs counted,
        those used more than once, the most uses of one).
        """
        out = {"found": self.found, "missing": self.missing, **self.decoded.stats()}
        bounded = self.store
        while not hasattr(bounded, "held") and hasattr(bounded, "inner"):  # a remote store behind its local cache
            bounded = bounded.inner
        if hasattr(bounded, "held"):
            try:
                out.update(held_bytes=int(bounded.held()), max_bytes=int(getattr(bounded, "max_bytes", 0)))
                if hasattr(bounded, "popularity"):
                    out.update(bounded.popularity())
            except StoreUnavailableError:  # unreachable now: the counts still stand
                pass
        return out

    @property
    def throughput(self) -> float | None:
        """The store link's recent read throughput in bytes per second (None: a local store, or no read yet)."""
        meter = getattr(self.store, "meter", None)
        return None if meter is None else meter.bytes_per_s

    def level_sizes(self, keys: Sequence[str], levels: Sequence[int] | None = None) -> list[dict[int, int]]:
        """For each chunk key, ``{level: stored bytes}`` of the levels present (all the codec's when None)."""
        levels = list(self.codec.levels() if levels is None else levels)
        wanted = [self._key(k, lv) for k in keys for lv in levels]
        unknown = [w for w in dict.fromkeys(wanted) if w not in self._sizes]
        if unknown:
            found = self.store.sizes(unknown)
            if len(self._sizes) + len(unknown) > self.SIZES_KEPT:
                self._sizes.clear()
            self._sizes.update((w, n) for w, n in zip(unknown, found) if n > 0)  # absent ones asked again
        rows = [wanted[i * len(levels) : (i + 1) * len(levels)] for i in range(len(keys))]
        return [{lv: self._sizes[w] for lv, w in zip(levels, row) if w in self._sizes} for row in rows]

    def codec_at(self, level: int | None) -> Codec:
        """The store codec at ``level`` (its own level when None), sharing its fitted state."""
        if level is None or level == self.codec.level:
            return self.codec
        return self.codec.with_level(level)

    def stored_key(self, key: str, level: int | None = None) -> str:
        """The store key of ``key``'s cache at ``level`` (its own key at the codec's own level)."""
        return key if level is None or level == self.codec.level else level_key(key, level)

    _key = stored_key

    def put_levels(self, key: str, keys: torch.Tensor, values: torch.Tensor,
                   levels: tuple[int, ...] | None = None) -> dict[int, int]:
        """Store one chunk at several quality levels (all the codec's when None); sizes by level."""
        sizes = {}
        for level in self.codec.levels() if levels is None else levels:
            codec = self.codec_at(level)
            data = encode_chunk(codec, self._key(key, level), self.fingerprint, keys, values, self.windows)
            self.store.put(self._key(key, level), data)
            self._sizes.pop(self._key(key, level), None)
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
        data = encode_chunk(self.codec, key, self.fingerprint, keys, values, self.windows)
        self.store.put(key, data)
        self._sizes.pop(key, None)
        return len(data)

    def contains(self, key: str, level: int | None = None) -> bool:
        return self.store.contains(self._key(key, level))

    def contains_levels(self, key: str, levels: Sequence[int]) -> bool:
        """Whether ``key`` is stored at the codec's own level and at each of ``levels``."""
        return self.contains(key) and all(self.contains(key, level) for level in levels)

    def reader(self, key: str, level: int | None = None, counted: bool = True) -> ChunkReader:
        """An open, header-checked reader; `CorruptChunkError` when missing or damaged. ``counted``: in `found` and
        `missing`, and a use of the blob where the store evicts by use (a read for a prompt; not `hold_decoded`'s,
        which reads back a blob just stored: counted, every stored blob would look asked for again).
        """
        stored = self._key(key, level)
        try:
            fh = self.store.open(stored) if counted else self.store.peek(stored)
        except StoreUnavailableError as exc:
            self._sizes.pop(stored, None)
            raise ChunkUnavailableError(key, f"not read ({exc})") from None
        if fh is None:
            self.missing += int(counted)
            self._sizes.pop(stored, None)
            suffix = "" if stored == key else f" at level {level}"
            raise CorruptChunkError(key, f"missing from the store{suffix}")
        self.found += int(counted)
        try:
            return ChunkReader(stored, fh, self.codec_at(level), self.fingerprint)
        except CorruptChunkError:
            fh.close()
            raise

    def load(self, key: str, level: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a whole chunk: ``(keys, values)``, each ``[L, H, S, D]``, at ``level`` (default: own)."""
        with self.reader(key, level) as reader:
            return reader.decode_all()

    def touch(self, key: str, level: int | None = None) -> None:
        """Mark ``key``'s blob at ``level`` as just used in a store that evicts by use (a read the decoded tier
        served); nothing when the store is away.
        """
        try:
            self.store.touch(self._key(key, level))
        except StoreUnavailableError:
            pass

    def hold_decoded(self, key: str, dtype: torch.dtype) -> None:
        """Decode ``key``'s whole cache at the codec's own level into the decoded tier, as a first read of it would
        keep it (not counted as found); nothing when the tier is off or the cache is missing or damaged.
        """
        if self.decoded.max_bytes == 0:
            return
        try:
            with self.reader(key, counted=False) as reader:
                if reader.header.cut:  # windowed layers: kept as a prompt's read delivers them, on that read
                    return
                k, v = reader.decode_all()
        except CorruptChunkError:  # missing, damaged or unreachable: read (and recovered) when a prompt needs it
            return
        self.decoded.put(self.decoded.key(key, None, 0, int(k.shape[2]), dtype), (k.to(dtype), v.to(dtype)))

    def is_valid(self, key: str, level: int | None = None) -> bool:
        """Whether the chunk is present at ``level`` and every layer passes its checksum (no decoding)."""
        try:
            reader = self.reader(key, level)
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
        self._sizes.pop(key, None)
        for level in self.codec.levels():
            if level != self.codec.level:
                self.store.delete(level_key(key, level))
                self._sizes.pop(level_key(key, level), None)
