"""The ``memory`` store: blobs in a dict of this process, for tests and short-lived indexes.

Contract: nothing survives the process; ``put`` copies the bytes, ``open`` returns an independent
`io.BytesIO` over them. `make_store` ignores ``root`` and ``fsync`` for it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import BinaryIO

from kvrag.storage.stores.base import ByteStore, register_store


@register_store("memory")
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

    def keys(self) -> Iterator[str]:
        return iter(sorted(self._data))
