"""The ``throttled`` store: another store read through one link of fixed bandwidth.

Contract: every read waits its turn on the link and takes ``size / bytes_per_s``, after the reads queued
before it; writes, deletes and size queries go straight to the inner store. Its files have no
descriptor, so readers take the buffered path. It stands in for a remote store (object storage, a
network file system) in benchmarks and tests. Its reads are recorded in ``meter`` (the link's time per read),
as a remote store's are; ``bytes_per_s`` can be changed between reads (a link whose bandwidth drops).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, cast

from kvrag.storage.stores.base import ByteStore, LinkMeter, make_store, register_store


@register_store("throttled")
class ThrottledStore(ByteStore):
    """Another store read through one link of ``bytes_per_s``: every read waits its turn on the link
    and takes ``size / bytes_per_s``. It stands in for a remote store (object storage, a network
    file system) in benchmarks and tests; its files have no descriptor, so readers take the
    buffered path. Writes go straight through.
    """

    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {"bytes_per_s": float, "inner": str}

    def __init__(self, inner: ByteStore, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.inner, self.bytes_per_s = inner, float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link finishes the reads already queued on it
        self.meter: LinkMeter = LinkMeter()

    @classmethod
    def create(cls, root: Path | None, fsync: bool = True, **options: Any) -> ThrottledStore:
        """A throttled view of a new ``inner`` store (default ``file``) at ``root``.

        Options: ``bytes_per_s`` (required), the link's bandwidth; ``inner``, the name of the store
        read through it.
        """
        if "bytes_per_s" not in options:
            raise ValueError(f"the {cls.name!r} store needs bytes_per_s")
        bytes_per_s = float(options.pop("bytes_per_s"))
        inner = make_store(str(options.pop("inner", "file")), root, fsync=fsync, **options)
        return cls(inner, bytes_per_s)

    def wait(self, nbytes: int) -> None:
        """Hold the calling thread while ``nbytes`` cross the link after the reads queued before."""
        with self._lock:
            done = max(time.perf_counter(), self._free_at) + nbytes / self.bytes_per_s
            self._free_at = done
        self.meter.record(nbytes, nbytes / self.bytes_per_s)  # the link's time for these bytes, queueing aside
        time.sleep(max(0.0, done - time.perf_counter()))

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def open(self, key: str) -> BinaryIO | None:
        return self._throttled(self.inner.open(key))

    def peek(self, key: str) -> BinaryIO | None:
        return self._throttled(self.inner.peek(key))

    def _throttled(self, fh: BinaryIO | None) -> BinaryIO | None:
        return None if fh is None else cast(BinaryIO, _ThrottledFile(fh, self))

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def touch(self, key: str) -> None:
        self.inner.touch(key)

    def nbytes(self, key: str) -> int:
        return self.inner.nbytes(key)

    def sizes(self, keys: Iterable[str]) -> list[int]:
        return self.inner.sizes(keys)

    def keys(self) -> Iterator[str]:
        return self.inner.keys()

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
