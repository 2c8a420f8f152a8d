"""A retrieval index in one directory: FAISS vectors, chunk metadata and a manifest.

Files (`kvrag.storage.index_layout`): the manifest (caller fields, a reserved ``"vectors"`` section and a
checksum; it makes a directory an index), the chunk rows (`kvrag.storage.chunk_db`: WAL, rows 0..n-1 without
gaps, each with a checksum), the FAISS vectors (never pickle; FAISS id ``i`` is row ``i``), the writers' lock.

Integrity: every byte read is checked (the manifest against its checksum, each row against its digest, the
vectors against the SHA-256 recorded in ``meta`` before they are parsed); damage raises `IndexCorruptError` naming
the file and ``kvrag repair``. A link leading out of the folder is refused (`kvrag.storage.integrity`).

Commit protocol: an append records the new vectors file's hash as pending, atomically replaces
``vectors.faiss`` with the new vectors added, then inserts the rows and makes the pending hash the
committed one in one SQLite transaction, the commit point. Readers read the row count and both
hashes in one transaction, accept a file matching either, and drop vectors past the row count, so a
writer killed between the steps leaves only unreferenced trailing vectors. Fewer vectors than rows,
or a file matching neither hash, cannot come from a crash and is reported as corruption.

Vectors are L2-normalised on the way in, so scores are cosine similarities, for both ``"flat"``
(exact ``IndexFlatIP``) and ``"hnsw"`` (``IndexHNSWFlat``, inner product, M=32). An append rewrites
the vectors file, O(index size), which is fine at the sizes kvrag builds.

Concurrency: many readers (threads or processes), one appender at a time. ``len``, ``in``,
``keys``, ``get`` and ``records`` answer from the snapshot of the last refresh; `ChunkIndex.search`
refreshes first (one indexed SQLite query and one ``stat`` when nothing changed).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from kvrag.errors import ChunkNotFoundError, IndexCorruptError, IndexNotFoundError, KVRagError
from kvrag.storage import atomic, chunk_db
from kvrag.storage.chunk_db import COLUMNS as _COLUMNS
from kvrag.storage.chunk_db import ChunkRecord
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.integrity import check_confined, read_manifest, sha256_hex, write_manifest
from kvrag.storage.vectors import HNSW_M, load_vectors, new_faiss, rewrite_vectors, unit_rows  # noqa: F401

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("flat", "hnsw")
HNSW_EF_SEARCH = 64
_RESERVED = "vectors"


def _vectors_section(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    section = manifest.get(_RESERVED)
    if not isinstance(section, dict) or "dim" not in section or section.get("kind") not in KINDS:
        raise IndexCorruptError(IndexLayout.of(path).manifest, f"lacks a valid {_RESERVED!r} section", path)
    if int(section.get("format_version", 0)) > FORMAT_VERSION:
        raise KVRagError(f"index at {path} is newer than this kvrag reads; upgrade kvrag")
    return section


class ChunkIndex:
    """FAISS vectors + SQLite chunk metadata + ``manifest.json`` in one directory.

    The module docstring gives the layout, the commit protocol and the concurrency rules.

    Example::

        idx = ChunkIndex.create("idx", {"embedder": "m"}, dim=384)
        idx.add([ChunkRecord("ab12", "doc", 0, "text", 3)], vecs)  # vecs: [1, 384] -> 1
        idx.search(query_vec, k=5)  # [(ChunkRecord, cosine), ...] best first
    """

    MANIFEST = IndexLayout.MANIFEST

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open an existing index; prefer `ChunkIndex.open`, which checks that it exists."""
        self.path = Path(path)
        self.files = IndexLayout(self.path)
        check_confined(self.path)
        self._lock = threading.RLock()
        self._manifest: dict[str, Any] = {}
        self._manifest_sig: tuple[int, int, int] | None = None
        self._load_manifest()
        section = _vectors_section(self._manifest, self.path)
        self.dim, self.kind = int(section["dim"]), str(section["kind"])
        self._conn: sqlite3.Connection | None = chunk_db.connect(self.files.db, self.path)
        self._n = 0
        self._keys: dict[str, int] = {}  # key -> row, for rows < self._n
        self._vectors = new_faiss(self.dim, self.kind)
        self._sync(full=True)

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], manifest: dict[str, Any], dim: int, kind: str = "flat"
    ) -> ChunkIndex:
        """Create an empty index in ``path`` (made if missing) and opens it.

        Args:
            path: the index directory.
            manifest: JSON-serialisable caller fields (model fingerprint, embedder, ...); the key
                ``"vectors"`` is reserved for the index's own section.
            dim: vector width.
            kind: ``"flat"`` (exact search) or ``"hnsw"`` (approximate, faster when large).

        Raises:
            KVRagError: an index (or chunk rows without a manifest) already exists at ``path``.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if _RESERVED in manifest:
            raise ValueError(f"manifest key {_RESERVED!r} is reserved for the index itself")
        path = Path(path)
        section = {"dim": dim, "kind": kind, "metric": "inner_product", "hnsw_m": HNSW_M,
                   "format_version": FORMAT_VERSION}
        path.mkdir(parents=True, exist_ok=True)
        check_confined(path)
        files = IndexLayout(path)
        with atomic.exclusive_lock(files.index_lock):
            # The manifest goes last: until it exists the directory is no index, so a create
            # killed half-way is simply redone.
            if cls.exists(path):
                raise KVRagError(f"an index already exists at {path}; refusing to overwrite it")
            if files.db.exists():
                chunk_db.check_no_rows(files.db, files.manifest, path)
            with contextlib.closing(chunk_db.connect(files.db, path, create=True)) as conn:
                vectors = faiss.serialize_index(new_faiss(dim, kind)).tobytes()
                with chunk_db.guarded(files.db, path), conn:
                    chunk_db.set_meta(conn, **{chunk_db.VECTORS_PENDING: sha256_hex(vectors)})
                atomic.atomic_write_bytes(files.vectors, vectors)
                with chunk_db.guarded(files.db, path), conn:
                    chunk_db.set_meta(conn, **{chunk_db.VECTORS_SHA: sha256_hex(vectors),
                                               chunk_db.VECTORS_PENDING: None})
                stored = write_manifest(files.manifest, {**manifest, _RESERVED: section})
                with chunk_db.guarded(files.db, path):
                    chunk_db.store_manifest_copy(conn, stored)
        logger.info("created %s index at %s (dim=%d)", kind, path, dim)
        return cls(path)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ChunkIndex:
        """Open the index in ``path``; IndexNotFoundError without one, IndexCorruptError if damaged."""
        files = IndexLayout.of(path)
        if not cls.exists(path):
            if files.db.is_file() and files.db.stat().st_size:
                raise IndexCorruptError(files.manifest, "is missing but the index's chunks are there", path)
            raise IndexNotFoundError(f"no kvrag index at {path} (missing {cls.MANIFEST})")
        return cls(path)

    @staticmethod
    def exists(path: str | os.PathLike[str]) -> bool:
        """Tell whether ``path`` holds an index (i.e. its manifest)."""
        return IndexLayout.of(path).manifest.is_file()

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest as stored, including the ``"vectors"`` section."""
        with self._lock:
            return copy.deepcopy(self._manifest)

    def update_manifest(self, **fields: Any) -> None:
        """Set top-level manifest fields and rewrite the file atomically, under the writer lock.

        Fields written meanwhile by other processes are kept; ``"vectors"`` cannot be changed.
        """
        if _RESERVED in fields:
            raise ValueError(f"manifest key {_RESERVED!r} is reserved for the index itself")
        with self._lock, atomic.exclusive_lock(self.files.index_lock):
            current = read_manifest(self.files.manifest, self.path)
            stored = write_manifest(self.files.manifest, {**current, **fields})
            with chunk_db.guarded(self.files.db, self.path):
                chunk_db.store_manifest_copy(self._db, stored)
            self._load_manifest()

    def _load_manifest(self) -> None:
        try:
            st = (self.files.manifest).stat()
        except FileNotFoundError:
            raise IndexCorruptError(self.files.manifest, "is missing", self.path) from None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self._manifest_sig:
            self._manifest = read_manifest(self.files.manifest, self.path)
            self._manifest_sig = sig

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._keys

    def keys(self) -> set[str]:
        """Return the keys of every chunk in the current snapshot."""
        with self._lock:
            return set(self._keys)

    def get(self, key: str) -> ChunkRecord:
        """Return the chunk stored under ``key``; raise `ChunkNotFoundError` (a `KeyError`) naming the key, the
        index and how to check it if absent.
        """
        row = self._keys.get(key)
        if row is None:
            raise ChunkNotFoundError(f"no chunk with key {str(key)[:60]!r} in index {self.path}: a key from another "
                                     f"index, or its row was lost from a damaged chunks.sqlite (check with "
                                     f"'kvrag verify {self.path}', then 'kvrag repair {self.path}')")
        return self._fetch_rows([row])[row]

    def records(self) -> list[ChunkRecord]:
        """Return every chunk of the current snapshot, in insertion order."""
        db = self.files.db
        with self._lock, chunk_db.guarded(db, self.path):
            sql = f"SELECT {_COLUMNS}, digest FROM chunks WHERE row < ? ORDER BY row"
            return [ChunkRecord(*chunk_db.checked_row(r, db, self.path)[1:])
                    for r in self._db.execute(sql, (self._n,))]

    def _fetch_rows(self, rows: Sequence[int]) -> dict[int, ChunkRecord]:
        # json_each keeps this one query with one parameter, whatever the number of rows.
        sql = f"SELECT {_COLUMNS}, digest FROM chunks WHERE row IN (SELECT value FROM json_each(?))"
        db = self.files.db
        with self._lock, chunk_db.guarded(db, self.path):
            cur = self._db.execute(sql, (json.dumps(list(rows)),))
            out = {r[0]: ChunkRecord(*r[1:]) for r in (chunk_db.checked_row(row, db, self.path) for row in cur)}
        if len(out) != len(set(rows)):
            missing = sorted(set(rows) - out.keys())[:5]
            raise IndexCorruptError(db, f"vector rows {missing} have no chunk rows", fix=chunk_db.db_fix(self.path))
        return out

    def search(self, query: np.ndarray, k: int) -> list[tuple[ChunkRecord, float]]:
        """Find the chunks nearest to ``query``, refreshing first to see other processes' appends.

        Args:
            query: ``[dim]`` or ``[1, dim]``; normalised here, so any non-zero vector works.
            k: how many results; a ``k`` larger than the index returns every chunk.

        Returns:
            Up to ``k`` ``(record, cosine similarity)`` pairs, best first; ``[]`` when empty.

        Raises:
            ValueError: ``k < 1``; ``query`` of the wrong shape, non-finite or zero.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        q = unit_rows(query, self.dim, "query")  # [1, dim]
        if q.shape[0] != 1:
            raise ValueError(f"query must be one vector [{self.dim}], got {list(np.shape(query))}")
        with self._lock:
            self.refresh()
            if self._n == 0:
                return []
            k_eff = min(int(k), self._n)
            if self.kind == "hnsw":  # efSearch bounds how many results HNSW can return
                self._vectors.hnsw.efSearch = max(HNSW_EF_SEARCH, k_eff)  # type: ignore[attr-defined]
            scores, ids = self._vectors.search(q, k_eff)  # [1, k_eff] each
            hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]
            records = self._fetch_rows([i for i, _ in hits])
        return [(records[i], s) for i, s in hits]

    def refresh(self) -> None:
        """Pick up appends and manifest updates made by other instances or processes."""
        with self._lock:
            self._load_manifest()
            self._sync(full=False)

    def _sync(self, full: bool) -> None:
        """Load rows past the snapshot (all rows if ``full``: at open, after a failed append)."""
        db = self.files.db
        with chunk_db.guarded(db, self.path):
            n = chunk_db.row_count(self._db)
            start = 0 if full else self._n
            if n == self._n and not full:
                return
            if n < start:
                raise IndexCorruptError(db, f"shrank from {self._n} to {n} chunks", fix=chunk_db.db_fix(self.path))
            n, data = self._read_vectors_file()  # the row count and the file, consistent: see the commit protocol
            vectors = load_vectors(data, n, self.dim, self.kind, self.files.vectors, self.path)
            sql = "SELECT key, row FROM chunks WHERE row >= ? AND row < ?"
            keys = {key: int(row) for key, row in self._db.execute(sql, (start, n))}
        if len(keys) != n - start:
            raise IndexCorruptError(db, f"chunk rows below {n} have gaps", fix=chunk_db.db_fix(self.path))
        if full:
            self._keys = {}
        self._keys.update(keys)
        self._vectors, self._n = vectors, n

    def _read_vectors_file(self) -> tuple[int, bytes]:
        """``(row count, vectors file bytes)`` whose hash the database records, retried while a writer commits."""
        file = self.files.vectors
        for attempt in range(50):
            n, hashes = chunk_db.snapshot(self._db)
            try:
                data = file.read_bytes()
            except FileNotFoundError:
                data = None
            if data is not None and sha256_hex(data) in hashes:
                return n, data
            if chunk_db.snapshot(self._db) == (n, hashes):  # no writer moved on: the file itself is wrong
                what = "is missing" if data is None else "does not match its recorded checksum (damaged or replaced)"
                raise IndexCorruptError(file, what, self.path)
            time.sleep(0.01 * min(attempt + 1, 10))
        raise KVRagError(f"{file} kept changing while it was read; try again")

    def add(self, records: Sequence[ChunkRecord], embeddings: np.ndarray) -> int:
        """Append chunks and their vectors; keys already present (or repeated) are skipped.

        Atomic: rows and vectors become visible together; a killed append changes nothing.

        Args:
            records: the chunks, one per embedding row.
            embeddings: ``[len(records), dim]``, finite non-zero rows (normalised here).

        Returns:
            How many chunks were added.
        """
        records = list(records)
        for i, rec in enumerate(records):
            if not isinstance(rec, ChunkRecord):
                raise TypeError(f"records[{i}] must be a ChunkRecord, got {type(rec).__name__}")
        if not records and np.size(embeddings) == 0:
            return 0
        vecs = unit_rows(embeddings, self.dim, "embeddings")  # [n, dim]
        if vecs.shape[0] != len(records):
            raise ValueError(f"got {len(records)} records but {vecs.shape[0]} embedding rows")
        with self._lock, atomic.exclusive_lock(self.files.index_lock):
            self.refresh()
            fresh = self._new_positions(records)
            if fresh:
                self._append([records[i] for i in fresh], vecs[fresh])
        return len(fresh)

    def _new_positions(self, records: Sequence[ChunkRecord]) -> list[int]:
        first: dict[str, int] = {}
        for i, rec in enumerate(records):
            first.setdefault(rec.key, i)
        fresh = [i for key, i in first.items() if key not in self._keys]
        return fresh

    def _append(self, records: list[ChunkRecord], vecs: np.ndarray) -> None:
        """Write the vectors, then commit the rows; the caller holds both locks."""
        start = self._n
        atomic.remove_stale_temps(self.files.vectors)
        try:
            self._vectors.add(vecs)
            data = faiss.serialize_index(self._vectors).tobytes()
            with chunk_db.guarded(self.files.db, self.path), self._db:
                chunk_db.set_meta(self._db, **{chunk_db.VECTORS_PENDING: sha256_hex(data)})
            atomic.atomic_write_bytes(self.files.vectors, data)
            self._commit_rows(records, start, sha256_hex(data))
        except BaseException:
            self._sync(full=True)  # the in-memory index may hold uncommitted vectors
            raise
        self._keys.update((rec.key, start + i) for i, rec in enumerate(records))
        self._n = start + len(records)

    def _commit_rows(self, records: Sequence[ChunkRecord], start: int, vectors_sha: str) -> None:
        """Insert the metadata rows and commit the vectors file's hash in one transaction: the commit point."""
        rows = [(start + i, *dataclasses.astuple(r)) for i, r in enumerate(records)]
        with chunk_db.guarded(self.files.db, self.path), self._db:
            chunk_db.insert_rows(self._db, rows)
            chunk_db.set_meta(self._db, **{chunk_db.VECTORS_SHA: vectors_sha, chunk_db.VECTORS_PENDING: None})

    @classmethod
    def write_vectors(cls, path: str | os.PathLike[str], embeddings: np.ndarray) -> None:
        """Rewrite ``vectors.faiss`` from one embedding per chunk row (``[rows, dim]``), under the writer lock.

        For `kvrag repair`, on an index whose manifest and chunk rows are sound but whose vectors file is
        not (so it need not open): the hash is committed in the same steps as an append's.
        """
        path = Path(path)
        files = IndexLayout(path)
        section = _vectors_section(read_manifest(files.manifest, path), path)
        rewrite_vectors(path, files.db, files.vectors, files.index_lock, int(section["dim"]), str(section["kind"]),
                        embeddings)

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise KVRagError(f"index at {self.path} is closed")
        return self._conn

    def close(self) -> None:
        """Close the SQLite connection; the instance is unusable afterwards."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
