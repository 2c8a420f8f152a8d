"""FAISS vectors of a chunk index: unit-length rows, the FAISS index kinds, and parsing a checked
``vectors.faiss`` file into an index of its committed rows.

Vectors are L2-normalised on the way in (`unit_rows`), so inner-product scores are cosine similarities.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from kvrag.errors import IndexCorruptError
from kvrag.storage import atomic, chunk_db
from kvrag.storage.integrity import sha256_hex

log = logging.getLogger(__name__)

HNSW_M = 32


def unit_rows(x: Any, dim: int, what: str = "embeddings") -> np.ndarray:
    """Validate vectors and return them L2-normalised.

    Args:
        x: ``[n, dim]`` or a single ``[dim]`` vector.
        dim: the expected width.
        what: the argument's name, for error messages.

    Returns:
        float32 ``[n, dim]`` with unit rows. Raises ValueError on a wrong shape, NaN/inf or a
        zero row (which has no direction).
    """
    arr = np.asarray(x, dtype=np.float32)
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if arr.ndim != 2 or arr.shape[1] != dim:
        raise ValueError(f"{what} must have shape [n, {dim}], got {list(np.shape(x))}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)  # [n, 1]
    zero = np.flatnonzero(norms[:, 0] == 0)
    if zero.size:
        raise ValueError(f"{what} row {int(zero[0])} has zero norm and cannot be normalised")
    return np.ascontiguousarray(arr / norms, dtype=np.float32)


def new_faiss(dim: int, kind: str) -> faiss.Index:
    """An empty FAISS index of ``kind`` (``flat`` or ``hnsw``) over inner products of ``dim``-wide rows."""
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    return faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)


FAISS_TYPES = {"flat": faiss.IndexFlatIP, "hnsw": faiss.IndexHNSWFlat}


def load_vectors(data: bytes, n: int, dim: int, kind: str, file: Path, root: Path) -> faiss.Index:
    """Parse the checked ``vectors.faiss`` bytes, keeping the first ``n`` vectors (the committed ones)."""
    try:
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as e:
        raise IndexCorruptError(file, f"cannot be read: {str(e).splitlines()[0]}", root) from None
    if not isinstance(index, FAISS_TYPES[kind]) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise IndexCorruptError(file, f"holds a {type(index).__name__}, the manifest says {kind!r}", root)
    if index.d != dim:
        raise IndexCorruptError(file, f"holds {index.d}-dim vectors, the manifest says {dim}", root)
    if index.ntotal < n:
        raise IndexCorruptError(file, f"holds {index.ntotal} vectors for {n} chunks; it is corrupt", root)
    if index.ntotal > n:
        log.debug("%s: ignoring %d vector(s) past the %d committed chunks (an append "
                     "in progress or interrupted)", file, index.ntotal - n, n)
        kept = new_faiss(dim, kind)  # an HNSW graph cannot drop nodes: rebuild
        if n:
            kept.add(index.reconstruct_n(0, n))  # [n, dim]
        index = kept
    return index


def rewrite_vectors(path: Path, db: Path, vectors_file: Path, lock: Path, dim: int, kind: str,
                    embeddings: np.ndarray) -> None:
    """Replace ``vectors_file`` of the index at ``path`` with ``embeddings`` (one per chunk row of ``db``),
    committing its hash the way an append does: pending, file replaced, then committed.
    """
    with atomic.exclusive_lock(lock), contextlib.closing(chunk_db.connect(db, path)) as conn:
        with chunk_db.guarded(db, path):
            n = chunk_db.row_count(conn)
        if len(embeddings) != n:
            raise ValueError(f"got {len(embeddings)} vectors for {n} chunk rows")
        fresh = new_faiss(dim, kind)
        if n:
            fresh.add(unit_rows(embeddings, dim, "embeddings"))
        data = faiss.serialize_index(fresh).tobytes()
        atomic.remove_stale_temps(vectors_file)
        with chunk_db.guarded(db, path), conn:
            chunk_db.set_meta(conn, **{chunk_db.VECTORS_PENDING: sha256_hex(data)})
        atomic.atomic_write_bytes(vectors_file, data)
        with chunk_db.guarded(db, path), conn:
            chunk_db.set_meta(conn, **{chunk_db.VECTORS_SHA: sha256_hex(data), chunk_db.VECTORS_PENDING: None})
