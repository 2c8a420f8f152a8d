"""`DecodedTier`: hot chunk caches kept decoded in process memory, fused again without reading or decoding a blob.

Contract:

- An entry is what one read of a stored chunk delivered: every layer's pre-RoPE keys and values of the rows read,
  ``[L, H, n, D]`` each, on the host. Its key (`DecodedTier.key`) is the chunk's store key, the stored level read,
  the rows read (first row and count) and the dtype, so an entry is exactly what reading and decoding those rows
  again would give.
- A store key names its content (`kvrag.storage.keys.chunk_key` hashes the model, the codec and its fitted state,
  the prefix and the token ids), so an entry is never stale: a store that evicts the blob, or another process that
  writes the same key, holds the same bytes or none.
- Bounded by ``max_bytes`` in total tensor bytes, least recently used evicted (`kvrag.byte_lru.ByteLRU`); 0 keeps
  nothing. ``hits`` and ``misses`` count `get` calls. Thread-safe.
"""

from __future__ import annotations

import threading

import torch

from kvrag.byte_lru import ByteLRU
from kvrag.model.prefix import KV

DEFAULT_DECODED_BYTES = 512 << 20  # about 11K tokens of SmolLM2-135M in float32, 4K of an 8B model in bf16

TierKey = tuple[str, int | None, int, int, torch.dtype]


class DecodedTier:
    """Decoded chunk caches by (store key, level, first row, rows, dtype), least recently used evicted."""

    def __init__(self, max_bytes: int = DEFAULT_DECODED_BYTES) -> None:
        self._held: ByteLRU[TierKey, KV] = ByteLRU(max_bytes)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(store_key: str, level: int | None, first_row: int, rows: int, dtype: torch.dtype) -> TierKey:
        """The entry key of ``rows`` rows from ``first_row`` of ``store_key``'s cache at ``level``, in ``dtype``."""
        return store_key, level, int(first_row), int(rows), dtype

    @property
    def max_bytes(self) -> int:
        """The bound on the bytes held (0: the tier keeps nothing)."""
        return self._held.max_bytes

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors held."""
        return self._held.nbytes

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: TierKey) -> KV | None:
        """The entry under ``key``, marked as the most recently used (None if absent)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                self.misses += 1
            else:
                self.hits += 1
            return held

    def put(self, key: TierKey, kv: KV) -> None:
        """Keep ``kv`` (``[L, H, n, D]`` keys and values, on the host) under ``key``, evicting what no longer fits."""
        keys, values = kv
        if keys.device.type != "cpu" or keys.shape != values.shape or keys.shape[2] != key[3]:
            raise ValueError(f"a decoded tier entry is [L, H, {key[3]}, D] host tensors, got {tuple(keys.shape)} "
                             f"and {tuple(values.shape)} on {keys.device}")
        size = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        with self._lock:
            self._held.put(key, kv, size)

    def clear(self) -> None:
        """Forget every entry (a cold start, as in a new process)."""
        with self._lock:
            self._held.clear()

    def stats(self) -> dict[str, int]:
        """Hits, misses, entries, bytes held and the bound."""
        with self._lock:
            return {"decoded_hits": self.hits, "decoded_misses": self.misses, "decoded_entries": len(self._held),
                    "decoded_bytes": self._held.nbytes, "decoded_max_bytes": self._held.max_bytes}
