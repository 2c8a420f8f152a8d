"""Chunk keys: content hashes that name a chunk's cache in an index and in its store.

A chunk's key hashes the model fingerprint, the prompt prefix's token ids and the chunk's token ids, so a
changed model, prompt or text can never read another's cache. Keys are 40 lowercase hex digits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def chunk_key(fingerprint: str, prefix_ids: Sequence[int], ids: Sequence[int]) -> str:
    """Content hash of (model fingerprint, prefix token ids, chunk token ids)."""
    h = hashlib.sha256(fingerprint.encode())
    h.update(b"|" + ",".join(map(str, prefix_ids)).encode())
    h.update(b"|" + ",".join(map(str, ids)).encode())
    return h.hexdigest()[:40]


def plain_cache_key(key: str) -> str:
    """The store key of a chunk's plain cache (computed right after the prefix) in an index whose caches
    are computed after neighbour context: the cache it needs when it comes first in a prompt.
    """
    return hashlib.sha256(b"lead|" + key.encode()).hexdigest()[:40]
