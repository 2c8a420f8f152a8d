"""`verify_index`: check every file of an index without loading a model, and say what is damaged.

Contract: `verify_index(path)` reads the index folder and never writes to it. It checks, in order:
links leading out of the folder (if any, nothing else is read); ``manifest.json`` against its
checksum (and whether the copy kept in ``chunks.sqlite`` could restore it); ``chunks.sqlite``
(SQLite's ``quick_check``, the schema, every row against its digest, rows without gaps, keys kvrag
writes); ``vectors.faiss`` against its recorded SHA-256, its kind, width and count; the codec state
of a codec that needs fitting; and with ``caches=True`` every stored chunk cache, at the codec's own level
and at each of the index's stream levels (header and per-layer checksums; a missing cache is no damage:
it is computed on first use), in the index's store (`open_index_store`: its ``chunks/`` folder, or the keys
under its namespace in a network store, listed with ``SCAN``; a store that does not answer is a problem
that repair cannot fix). It returns a `VerifyReport`
with one `Problem` per damaged part; ``report.ok`` is True when there is none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from kvrag.codec.base import make_codec
from kvrag.config import StoreConfig
from kvrag.errors import (
    ChunkUnavailableError,
    CorruptChunkError,
    IndexCorruptError,
    IndexNotFoundError,
    StoreUnavailableError,
)
from kvrag.storage import chunk_db
from kvrag.storage.codec_state import load_codec_state
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.integrity import is_chunk_key, links_out, manifest_problem, parse_manifest, sha256_hex
from kvrag.storage.keys import plain_cache_key
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import open_index_store, public_url

log = logging.getLogger(__name__)



@dataclass
class Problem:
    """One damaged part of an index: which part, which file, what is wrong, and whether repair can rebuild it."""

    part: str  # "links", "manifest", "chunks", "vectors", "codec" or "caches"
    file: str
    what: str
    repairable: bool

    def line(self) -> str:
        """The problem in one line."""
        fix = "kvrag repair rebuilds it" if self.repairable else "kvrag repair cannot rebuild it"
        return f"{self.part}: {self.file}: {self.what} ({fix})"


@dataclass
class VerifyReport:
    """What `verify_index` found. ``ok`` when no part is damaged."""

    path: Path
    problems: list[Problem] = field(default_factory=list)
    chunks: int = 0  # chunk rows read
    bad_rows: list[int] = field(default_factory=list)  # rows whose digest fails
    caches_checked: int = 0
    caches_missing: int = 0
    bad_caches: list[str] = field(default_factory=list)  # store keys of damaged caches
    manifest: dict[str, Any] | None = None  # the manifest, if sound
    manifest_copy: dict[str, Any] | None = None  # the sound copy kept in chunks.sqlite, if any

    @property
    def ok(self) -> bool:
        """Whether nothing is damaged."""
        return not self.problems

    def lines(self) -> list[str]:
        """One line per damaged part, or one line saying the index is sound."""
        if self.ok:
            return [f"{self.path}: ok ({self.chunks} chunks, {self.caches_checked} caches checked, "
                    f"{self.caches_missing} computed on first use)"]
        return [p.line() for p in self.problems]

    def _add(self, part: str, file: Path | str, what: str, repairable: bool) -> None:
        self.problems.append(Problem(part, str(file), what, repairable))


def verify_index(path: str | os.PathLike[str], caches: bool = True) -> VerifyReport:
    """Check every file of the index at ``path`` (see the module docstring); never writes."""
    path = Path(path)
    if not path.is_dir():
        raise IndexNotFoundError(f"no kvrag index at {path}: not a folder")
    report = VerifyReport(path)
    outside = links_out(path)
    for link, target in outside:
        report._add("links", link, f"is a link to {target}, outside the index; remove it", False)
    if outside:
        return report
    report.manifest, problem = manifest_problem(IndexLayout(path).manifest)
    keys = _check_db(path, report)
    if report.manifest is None:
        can = report.manifest_copy is not None
        what = problem + ("" if can else "; no sound copy to restore it from")
        report._add("manifest", IndexLayout(path).manifest, what, can)
        return report
    _check_vectors(path, report)
    codec = _check_codec(path, report)
    if caches and codec is not None:
        _check_caches(path, report, codec, keys)
    return report


def _check_db(path: Path, report: VerifyReport) -> list[str]:
    """Check ``chunks.sqlite``; returns the keys of the sound rows, in row order."""
    db = IndexLayout(path).db
    if not db.is_file():
        report._add("chunks", db, "is missing: the chunk texts are gone", False)
        return []
    keys: list[str] = []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)) as conn:
            check = [row[0] for row in conn.execute("PRAGMA quick_check")]
            tables = {t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "meta" in tables:
                copy = chunk_db.get_meta(conn, chunk_db.MANIFEST_COPY)
                report.manifest_copy = parse_manifest(copy.encode())[0] if copy else None
            if check != ["ok"]:
                report._add("chunks", db, f"fails SQLite's check: {check[0]}", True)
            if "chunks" not in tables:
                report._add("chunks", db, "has no chunks table: the chunk texts are gone", False)
                return []
            columns = {row[1] for row in conn.execute("PRAGMA table_info(chunks)")}
            legacy = "digest" not in columns or "meta" not in tables
            sql = f"SELECT {chunk_db.COLUMNS}, {'NULL' if legacy else 'digest'} FROM chunks ORDER BY row"
            for expected, row in enumerate(conn.execute(sql)):
                report.chunks += 1
                if row[0] != expected:
                    report._add("chunks", db, f"rows jump from {expected - 1} to {row[0]}", True)
                    break
                if not legacy:
                    try:
                        chunk_db.checked_row(row, db, path)
                    except IndexCorruptError:
                        report.bad_rows.append(row[0])
                        continue
                if not is_chunk_key(row[1]):
                    report._add("chunks", db, f"row {row[0]} holds key {str(row[1])[:60]!r}, which kvrag never "
                                "writes (a hostile or foreign index)", False)
                    continue
                keys.append(row[1])
            if legacy:
                report._add("chunks", db, "has no row checksums (written by an older kvrag)", True)
    except sqlite3.DatabaseError as exc:
        report._add("chunks", db, f"cannot be read: {exc}", True)
    if report.bad_rows:
        shown = ", ".join(map(str, report.bad_rows[:5])) + (" ..." if len(report.bad_rows) > 5 else "")
        report._add("chunks", db, f"{len(report.bad_rows)} chunk row(s) do not match their checksum (rows {shown}); "
                    "their texts are lost: repair drops them, add their documents again", False)
    return keys


def _check_vectors(path: Path, report: VerifyReport) -> None:
    file = IndexLayout(path).vectors
    section = report.manifest.get("vectors", {}) if report.manifest else {}
    try:
        db = IndexLayout(path).db
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)) as conn:
            hashes = {chunk_db.get_meta(conn, chunk_db.VECTORS_SHA), chunk_db.get_meta(conn, chunk_db.VECTORS_PENDING)}
    except sqlite3.DatabaseError:
        hashes = set()
    if not file.is_file():
        report._add("vectors", file, "is missing", True)
        return
    data = file.read_bytes()
    if sha256_hex(data) not in hashes:
        report._add("vectors", file, "does not match its recorded checksum", True)
        return
    try:
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError:
        report._add("vectors", file, "cannot be read by FAISS", True)
        return
    want = faiss.IndexHNSWFlat if section.get("kind") == "hnsw" else faiss.IndexFlatIP
    if not isinstance(index, want) or index.d != section.get("dim") or index.ntotal < report.chunks:
        report._add("vectors", file, f"holds {index.ntotal} {type(index).__name__} vectors of width {index.d}, "
                    f"not the manifest's {section.get('kind')} of width {section.get('dim')} for "
                    f"{report.chunks} chunks", True)


def _check_codec(path: Path, report: VerifyReport) -> Any:
    """The index's codec with its state loaded, or None when the state is damaged (a problem is recorded)."""
    params = (report.manifest or {}).get("codec", {})
    try:
        codec = make_codec(params["name"], params.get("level"))
    except (ValueError, KeyError, TypeError) as exc:  # a manifest edited with its checksum recomputed
        what = f"names a codec this kvrag cannot read ({str(exc)[:160]})"
        report._add("manifest", IndexLayout(path).manifest, what, False)
        return None
    if codec.needs_fit:
        try:
            load_codec_state(codec, path)
        except IndexCorruptError as exc:
            report._add("codec", exc.file, exc.problem + "; the caches coded with it are recomputed too", True)
            return None
        if not getattr(codec, "fitted", True):
            return None  # not fitted yet and nothing coded with it
    return codec


def _check_caches(path: Path, report: VerifyReport, codec: Any, keys: list[str]) -> None:
    manifest = report.manifest or {}
    url = (manifest.get("store") or {}).get("url")
    levels = [lv for lv in manifest.get("stream_levels", []) if lv != codec.level]
    with_leads = bool(manifest.get("neighbour_context", 0))
    if url is None and not IndexLayout(path).chunks.is_dir():
        report.caches_missing = len(keys) * (1 + with_leads + len(levels))
        return
    where = IndexLayout(path).chunks if url is None else public_url(url)
    store = open_index_store(path, manifest, StoreConfig(cache_bytes=0, fsync=False))
    try:
        held = set(store.keys())
        kvstore = KVStore(store, codec, manifest["model"]["fingerprint"], decoded_bytes=0)
        for key in keys:
            plain = [(plain_cache_key(key), None)] if with_leads else []
            wanted = [(key, None), *plain, *((key, lv) for lv in levels)]
            for stored, level in wanted:
                name = kvstore.stored_key(stored, level)
                if name not in held:
                    report.caches_missing += 1
                    continue
                report.caches_checked += 1
                try:
                    with kvstore.reader(stored, level) as reader:
                        for i in range(reader.header.n_layers):
                            reader.read_layer_bytes(i)
                except ChunkUnavailableError:
                    raise
                except CorruptChunkError:
                    report.bad_caches.append(name)
    except (StoreUnavailableError, ChunkUnavailableError) as exc:
        report._add("caches", where, f"cannot be checked: {exc}", False)
        return
    finally:
        store.close()
    if report.bad_caches:
        report._add("caches", where, f"{len(report.bad_caches)} of {report.caches_checked} chunk caches are "
                    "damaged (each is recomputed from its text on first use)", True)
