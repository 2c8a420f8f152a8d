"""`repair_index`: rebuild what can be rebuilt of a damaged index from what is intact.

Contract: `repair_index(path)` runs `kvrag.storage.verify.verify_index`, then, holding the index's
writer lock, in order:

1. links leading out of the folder: nothing is repaired (kvrag never follows one); the error says
   which link to remove;
2. ``manifest.json``: restored from the checked copy kept in ``chunks.sqlite``; without a sound copy it
   cannot be recovered and the error says what is needed (the documents and the build settings);
3. ``chunks.sqlite``: the rows that pass their checksums are kept (renumbered without gaps, in their
   order) in a fresh database that replaces the old one atomically; rows that fail are named in the
   report (their texts had no other copy: index their documents again); an index written before row
   checksums gets them;
4. ``vectors.faiss``: re-embedded from the chunk texts in row order whenever it is damaged, missing or
   the rows were renumbered, and its hash committed;
5. the codec state of a codec that needs fitting: when damaged, every cache coded with it is removed and
   the build loop runs again over those chunks, which refits the codec on the first chunks and stores
   their caches again;
6. chunk caches that fail their checksums are removed and computed again from their texts.

Returns a `RepairReport`: what was rebuilt, what was lost, and the index's `VerifyReport` afterwards.
The model (``model``, default: the one in the manifest) is loaded only when caches or vectors must be
computed (the embedder for vectors, the LLM for caches).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrag.config import StoreConfig
from kvrag.embedder import Embedder
from kvrag.errors import IndexCorruptError
from kvrag.indexing.build import Builder, BuildStats, Candidate
from kvrag.indexing.kvgen import plain_cache_key
from kvrag.indexing.manifest import check_embedder
from kvrag.prompt import chunk_token_ids
from kvrag.rag import KVRag
from kvrag.storage import atomic, chunk_db
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.integrity import is_chunk_key, manifest_problem, row_digest, write_manifest
from kvrag.storage.kvstore import level_key
from kvrag.storage.stores import open_index_store, public_url
from kvrag.storage.verify import VerifyReport, verify_index

log = logging.getLogger(__name__)

EMBED_GROUP = 256  # rows embedded per call, as a build embeds its groups


@dataclass
class RepairReport:
    """What `repair_index` did: ``rebuilt`` and ``lost`` lines, and the verification afterwards."""

    path: Path
    rebuilt: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    after: VerifyReport | None = None

    @property
    def ok(self) -> bool:
        """Whether the index is sound now."""
        return self.after is not None and self.after.ok

    def lines(self) -> list[str]:
        """One line per thing rebuilt or lost, then the verification's lines."""
        out = [f"rebuilt: {line}" for line in self.rebuilt] + [f"lost: {line}" for line in self.lost]
        return out + (self.after.lines() if self.after is not None else [])


def repair_index(path: str | os.PathLike[str], model: Any = None, device: str | None = None,
                 show_progress: bool = False, embedder: str | None = None) -> RepairReport:
    """Repair the index at ``path`` (see the module docstring) and return a `RepairReport`. ``embedder``: the
    index's embedder when the manifest names it by a path outside the index (loaded only when named here).

    Raises:
        IndexCorruptError: what cannot be rebuilt from what is left (a link out of the folder, a manifest
            without a sound copy, chunk texts that are all gone), naming what is needed.
    """
    files = IndexLayout.of(path)
    path = Path(path)
    report = RepairReport(path)
    found = verify_index(path)
    if found.ok:
        report.after = found
        return report
    for problem in found.problems:
        if problem.part == "links":
            raise IndexCorruptError(problem.file, problem.what.removesuffix("; remove it")
                                    + "; kvrag never follows it", fix="remove the link, then run kvrag repair again")
    with files.writer_lock():
        atomic.remove_stale_temps(files.manifest)
        atomic.remove_stale_temps(files.vectors)
        manifest = _repair_manifest(path, found, report)
        if found.manifest is None:  # verification stops at a damaged manifest: look at the rest now
            found = verify_index(path)
            found.manifest_copy = found.manifest_copy or manifest
        renumbered = _repair_db(path, manifest, found, report)
        parts = {p.part for p in found.problems}
        if renumbered or "vectors" in parts:
            _reembed(path, manifest, report, device, embedder)
        redo = _damaged_caches(path, manifest, found, report, "codec" in parts)
        if redo:
            _recompute(path, redo, report, model, device, show_progress, embedder)
    report.after = verify_index(path)
    return report


def _repair_manifest(path: Path, found: VerifyReport, report: RepairReport) -> dict[str, Any]:
    files = IndexLayout.of(path)
    if found.manifest is not None:
        return found.manifest
    copy = found.manifest_copy
    if copy is None:
        legacy, problem = _legacy_manifest(path)
        if legacy is None:
            raise IndexCorruptError(files.manifest, f"{problem} and chunks.sqlite holds no sound copy of it, so it "
                                    "cannot be recovered", fix=f"move {path} away and build the index again from "
                                    "its documents with the same settings (kvrag index DOCS --index ...)")
        copy = legacy
        report.rebuilt.append(f"{files.manifest}: checksum added (written by an older kvrag)")
    else:
        report.rebuilt.append(f"{files.manifest}: restored from the copy kept in {IndexLayout.DB}")
    return write_manifest(files.manifest, copy)


def _legacy_manifest(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A parseable manifest without a checksum, accepted only beside a database without checksums either."""
    files = IndexLayout.of(path)
    obj, problem = manifest_problem(files.manifest)
    if "no checksum" not in problem:
        return None, problem
    try:
        with contextlib.closing(sqlite3.connect(f"file:{files.db}?mode=ro", uri=True)) as conn:
            tables = {t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError:
        return None, problem
    if "meta" in tables:
        return None, problem
    return json.loads(files.manifest.read_text(encoding="utf-8")), ""


def _repair_db(path: Path, manifest: dict[str, Any], found: VerifyReport, report: RepairReport) -> bool:
    """Rewrite ``chunks.sqlite`` with its sound rows when it is damaged; True when rows were renumbered."""
    files = IndexLayout.of(path)
    problems = [p for p in found.problems if p.part == "chunks"]
    if not problems:
        with contextlib.closing(chunk_db.connect(files.db, path)) as conn, chunk_db.guarded(files.db, path):
            chunk_db.store_manifest_copy(conn, manifest)  # the copy may be the damaged part
        return False
    rows, lost = _salvage(files.db)
    if not rows and (lost or not (files.db).is_file()):
        raise IndexCorruptError(files.db, "is lost: no chunk row could be read back, and the texts have no other "
                                "copy", fix=f"move {path} away and index the documents again")
    report.lost += lost
    tmp = path / f".{IndexLayout.DB}.repair.tmp"
    tmp.unlink(missing_ok=True)
    with contextlib.closing(chunk_db.connect(tmp, path, create=True)) as conn:
        with conn:
            chunk_db.insert_rows(conn, [(i, *r[1:]) for i, r in enumerate(rows)])
        chunk_db.store_manifest_copy(conn, manifest)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("-wal", "-shm"):
        (path / f"{IndexLayout.DB}{suffix}").unlink(missing_ok=True)
        (path / f".{IndexLayout.DB}.repair.tmp{suffix}").unlink(missing_ok=True)
    os.replace(tmp, files.db)
    atomic.fsync_dir(path)
    report.rebuilt.append(f"{files.db}: rewritten with its {len(rows)} sound chunk rows")
    return True


def _salvage(db: Path) -> tuple[list[tuple[Any, ...]], list[str]]:
    """The rows of ``db`` that read back and pass their checksum (in row order), and a line per row lost."""
    if not db.is_file():
        return [], []
    lost: list[str] = []
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.DatabaseError as exc:
        return [], [f"{db}: {exc}"]
    with contextlib.closing(conn):
        try:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(chunks)")}
            top = int(conn.execute("SELECT COALESCE(MAX(row), -1) FROM chunks").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            return [], [f"{db}: {exc}"]
        digest = "digest" if "digest" in columns else "NULL"
        rows = []
        for row_id in range(top + 1):  # one query a row, so that one damaged page loses only its rows
            try:
                row = conn.execute(f"SELECT {chunk_db.COLUMNS}, {digest} FROM chunks WHERE row = ?",
                                   (row_id,)).fetchone()
            except sqlite3.DatabaseError as exc:
                lost.append(f"chunk row {row_id}: unreadable ({exc})")
                continue
            if row is None:
                continue
            fields = tuple(row[:-1])
            if row[-1] is not None and row[-1] != row_digest(*fields[1:]):
                lost.append(f"chunk row {row_id} (document {fields[2]!r}, chunk {fields[3]}, source "
                            f"{fields[6]!r}): its text fails its checksum; index that document again")
                continue
            if not is_chunk_key(fields[1]):
                lost.append(f"chunk row {row_id}: key {str(fields[1])[:60]!r} is no chunk key")
                continue
            rows.append(fields)
    return rows, lost


def _reembed(path: Path, manifest: dict[str, Any], report: RepairReport, device: str | None,
             given: str | None) -> None:
    files = IndexLayout.of(path)
    check_embedder(manifest, path, given)
    with contextlib.closing(chunk_db.connect(files.db, path)) as conn, chunk_db.guarded(files.db, path):
        texts = [t for (t,) in conn.execute("SELECT text FROM chunks ORDER BY row")]
    embedder = Embedder(manifest["embedder"], device=device)
    groups = [embedder.encode(texts[i:i + EMBED_GROUP]) for i in range(0, len(texts), EMBED_GROUP)]
    vectors = np.concatenate(groups) if groups else np.zeros((0, embedder.dim), np.float32)
    ChunkIndex.write_vectors(path, vectors)
    report.rebuilt.append(f"{files.vectors}: {len(texts)} vectors embedded again from the chunk texts")


def _damaged_caches(path: Path, manifest: dict[str, Any], found: VerifyReport, report: RepairReport,
                    codec_damaged: bool) -> set[str]:
    """Remove damaged caches (all of them when the codec state is damaged) from the index's store (its
    ``chunks/`` folder or a network store); the chunk keys to compute again.
    """
    files = IndexLayout.of(path)
    with ChunkIndex.open(path) as index:
        keys = [r.key for r in index.records()]
    owner = {k: k for k in keys}
    if manifest.get("neighbour_context", 0):
        owner.update({plain_cache_key(k): k for k in keys})
    own = manifest.get("codec", {}).get("level")
    for level in manifest.get("stream_levels", []):
        if level != own:
            owner.update({level_key(k, level): k for k in keys})
    url = (manifest.get("store") or {}).get("url")
    if url is None and not files.chunks.is_dir():
        return set()
    where = str(files.chunks) if url is None else public_url(url)
    store = open_index_store(path, manifest, StoreConfig(cache_bytes=0))
    try:
        if codec_damaged:
            stored = list(store.keys())  # every blob of the index: all coded with the damaged state
            for name in stored:
                store.delete(name)
            for f in files.codec_state.glob("*") if files.codec_state.is_dir() else []:
                f.unlink()
            redo = {owner[name] for name in stored if name in owner}
            report.rebuilt.append(f"{files.codec_state}: fitted again; {len(stored)} caches coded with it computed "
                                  "again")
            return redo
        redo = set()
        for name in found.bad_caches:
            store.delete(name)
            if name in owner:
                redo.add(owner[name])
    finally:
        store.close()
    if redo:
        report.rebuilt.append(f"{where}: {len(found.bad_caches)} damaged caches computed again from their texts")
    return redo


def _recompute(path: Path, keys: set[str], report: RepairReport, model: Any, device: str | None,
               show_progress: bool, embedder: str | None) -> None:
    """Run the build loop over the chunks ``keys`` (in row order): it stores the caches they lack."""
    files = IndexLayout.of(path)
    rag = KVRag.open(path, model=model, device=device, embedder=embedder)
    try:
        records = [r for r in rag.index.records() if r.key in keys]
        candidates = [Candidate(r, chunk_token_ids(rag.lm.tokenizer, r.text)) for r in records]
        builder = Builder(rag.lm, rag.index, rag.kvstore, rag.embedder, rag.prefix, files.codec_state, rag.batch_tokens,
                          rag.neighbour_context, rag.neighbour_kv)
        stats = BuildStats()
        builder.run(candidates, stats, show_progress)
        log.info("repair recomputed %d chunk caches", stats.prefilled_chunks)
    finally:
        rag.close()
