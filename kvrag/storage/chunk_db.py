"""The SQLite side of a `ChunkIndex`: the ``chunks`` table, its per-row checksums and the ``meta`` table.

Contract:

- Table ``chunks`` (rows 0..n-1 without gaps): key, doc_id, seq, text, n_tokens, source and
  ``digest``, the row's checksum (`kvrag.storage.integrity.row_digest`), checked on every read.
- Table ``meta`` (name -> value): ``vectors_sha256``, the SHA-256 of the committed ``vectors.faiss``;
  ``vectors_pending``, that of a vectors file being written (a crash may leave it in place); and
  ``manifest``, a checked copy of ``manifest.json`` that `kvrag repair` restores it from.
- Every SQLite failure that means damage (``malformed``, ``no such table``, ``not a database``) becomes
  one `IndexCorruptError` naming the file and the fix; a busy or locked database is passed on as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrag.errors import IndexCorruptError
from kvrag.storage.integrity import row_digest

COLUMNS = "row, key, doc_id, seq, text, n_tokens, source"
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS chunks (row INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, doc_id TEXT NOT NULL, "
    "seq INTEGER NOT NULL, text TEXT NOT NULL, n_tokens INTEGER NOT NULL, source TEXT NOT NULL, "
    "digest TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
)
VECTORS_SHA, VECTORS_PENDING, MANIFEST_COPY = "vectors_sha256", "vectors_pending", "manifest"
_TRANSIENT = ("locked", "busy")


def db_fix(index: object) -> str:
    """What to do about damaged chunk texts."""
    return (f"run 'kvrag repair {index}' to keep the intact chunks (the damaged ones are named; add their "
            "documents again with 'kvrag index')")


@contextlib.contextmanager
def guarded(db: Path, index: object) -> Iterator[None]:
    """Turn SQLite's damage errors inside the block into one `IndexCorruptError` naming ``db``."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) and any(t in str(exc).lower() for t in _TRANSIENT):
            raise
        raise IndexCorruptError(db, f"cannot be read: {exc}", fix=db_fix(index)) from None


def connect(db: Path, index: object, create: bool = False) -> sqlite3.Connection:
    """Open (or with ``create``, create) the chunk database; check its schema."""
    if not create and not db.is_file():
        raise IndexCorruptError(db, "is missing: the chunk texts are gone", fix=db_fix(index))
    with guarded(db, index):
        conn = sqlite3.connect(str(db), timeout=30.0, check_same_thread=False)
        conn.execute("PRAGMA synchronous=FULL")
        if create:
            conn.execute("PRAGMA journal_mode=WAL")  # persistent: readers inherit it
            with conn:
                for statement in SCHEMA:
                    conn.execute(statement)
        check_schema(conn, db, index)
    return conn


def check_schema(conn: sqlite3.Connection, db: Path, index: object) -> None:
    """Refuse a database without the ``chunks`` and ``meta`` tables or the row checksums."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "chunks" not in tables:
        raise IndexCorruptError(db, "has no chunks table (damaged or not a kvrag index)", fix=db_fix(index))
    columns = {row[1] for row in conn.execute("PRAGMA table_info(chunks)")}
    if "digest" not in columns or "meta" not in tables:
        raise IndexCorruptError(db, "has no row checksums (written by an older kvrag)", index)


def row_count(conn: sqlite3.Connection) -> int:
    """Rows are contiguous from 0, so MAX+1 is the count, found in O(log n)."""
    return int(conn.execute("SELECT COALESCE(MAX(row) + 1, 0) FROM chunks").fetchone()[0])


def get_meta(conn: sqlite3.Connection, name: str) -> str | None:
    """One ``meta`` value, or None."""
    row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    return None if row is None else str(row[0])


def set_meta(conn: sqlite3.Connection, **values: str | None) -> None:
    """Set (or with None, delete) ``meta`` values; the caller holds the transaction."""
    for name, value in values.items():
        if value is None:
            conn.execute("DELETE FROM meta WHERE name = ?", (name,))
        else:
            conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", (name, value))


def snapshot(conn: sqlite3.Connection) -> tuple[int, frozenset[str]]:
    """The row count and the accepted vectors-file hashes, read in one transaction."""
    conn.execute("BEGIN")
    try:
        n = row_count(conn)
        hashes = frozenset(h for h in (get_meta(conn, VECTORS_SHA), get_meta(conn, VECTORS_PENDING)) if h)
    finally:
        conn.execute("COMMIT")
    return n, hashes


def checked_row(row: Sequence[Any], db: Path, index: object) -> tuple[Any, ...]:
    """``(row, key, doc_id, seq, text, n_tokens, source)`` of a fetched row after checking its digest."""
    *fields, digest = row
    if digest != row_digest(*fields[1:]):
        raise IndexCorruptError(db, f"chunk row {fields[0]} does not match its checksum (its text or metadata "
                                "changed)", fix=db_fix(index))
    return tuple(fields)


def insert_rows(conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert ``(row, key, doc_id, seq, text, n_tokens, source)`` tuples with their digests."""
    conn.executemany(f"INSERT INTO chunks ({COLUMNS}, digest) VALUES (?,?,?,?,?,?,?,?)",
                     [(*r, row_digest(*r[1:])) for r in rows])


def store_manifest_copy(conn: sqlite3.Connection, manifest: dict[str, Any]) -> None:
    """Keep a copy of the (checksummed) manifest in ``meta``, in its own transaction."""
    with conn:
        set_meta(conn, **{MANIFEST_COPY: json.dumps(manifest, sort_keys=True, ensure_ascii=False)})


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One chunk's metadata, stored beside its vector."""

    key: str  # content hash (hex), unique in an index
    doc_id: str
    seq: int  # position of the chunk within its document, from 0
    text: str  # the chunk's exact text
    n_tokens: int  # length in the LLM tokenizer's tokens
    source: str = ""  # file path or caller-provided id

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"ChunkRecord.key must be a non-empty str, got {self.key!r}")


def check_no_rows(db: Path, manifest: Path, root: Path) -> None:
    """Refuse to create an index over a chunk database that already holds rows (a lost manifest)."""
    try:
        with contextlib.closing(sqlite3.connect(str(db), timeout=30.0)) as conn:
            tables = {t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            rows = row_count(conn) if "chunks" in tables else 0
    except sqlite3.DatabaseError:
        rows = 1
    if rows:
        raise IndexCorruptError(manifest, f"is missing but {db} holds chunks; not overwriting them", root)
