"""Tests for kvrag.storage.chunk_index: storage roundtrips, exact search, crash consistency, concurrent readers.

Vectors are derived from keys (`_vec`), so any hit can be checked against the row it came from:
a mismatch between FAISS row i and SQLite row i shows up as a wrong score.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import faiss
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import atomic_files
from kvrag.errors import IndexCorruptError, IndexNotFoundError, KVRagError
from kvrag.storage.chunk_index import ChunkIndex, ChunkRecord

DIM = 16


def _vec(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def _rec(i: int, doc: str = "doc") -> ChunkRecord:
    return ChunkRecord(key=f"k{i:05d}", doc_id=doc, seq=i, text=f"chunk number {i}",
                       n_tokens=i % 7 + 1, source=f"{doc}.txt")


def _batch(indices: range | list[int]) -> tuple[list[ChunkRecord], np.ndarray]:
    recs = [_rec(i) for i in indices]
    return recs, np.stack([_vec(r.key) for r in recs]) if recs else np.zeros((0, DIM), np.float32)


def _assert_consistent(index: ChunkIndex) -> None:
    """Every stored chunk is its own nearest neighbour with cosine 1."""
    for rec in index.records():
        (hit, score), *_ = index.search(_vec(rec.key), k=1)
        assert hit == rec
        assert score == pytest.approx(1.0, abs=1e-5)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[ChunkIndex]:
    idx = ChunkIndex.create(tmp_path / "idx", {"embedder": "test", "format_version": 1}, dim=DIM)
    yield idx
    idx.close()


# -- create / open ---------------------------------------------------------------------------


def test_create_open_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    ChunkIndex.create(path, {"embedder": "e"}, dim=DIM).close()
    assert ChunkIndex.exists(path)
    with ChunkIndex.open(path) as idx:
        assert idx.manifest["embedder"] == "e"
        assert idx.manifest["vectors"]["dim"] == DIM
        assert idx.dim == DIM and idx.kind == "flat"
        assert len(idx) == 0 and idx.keys() == set() and idx.records() == []
        assert idx.search(_vec("q"), k=3) == []


def test_create_refuses_existing_index(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    ChunkIndex.create(path, {}, dim=DIM).close()
    with pytest.raises(KVRagError, match=str(path)):
        ChunkIndex.create(path, {}, dim=DIM)


def test_create_validates_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        ChunkIndex.create(tmp_path / "a", {}, dim=DIM, kind="ivf")
    with pytest.raises(ValueError, match="dim"):
        ChunkIndex.create(tmp_path / "b", {}, dim=0)
    with pytest.raises(ValueError, match="reserved"):
        ChunkIndex.create(tmp_path / "c", {"vectors": 1}, dim=DIM)


def test_create_after_interrupted_create(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    ChunkIndex.create(path, {}, dim=DIM).close()
    (path / ChunkIndex.MANIFEST).unlink()  # as if killed before the manifest was written
    assert not ChunkIndex.exists(path)
    ChunkIndex.create(path, {"x": 1}, dim=DIM).close()
    assert ChunkIndex.open(path).manifest["x"] == 1


def test_open_missing_raises(tmp_path: Path) -> None:
    with pytest.raises(IndexNotFoundError, match="nowhere"):
        ChunkIndex.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexNotFoundError):
        ChunkIndex.open(tmp_path / "empty")


def test_closed_index_raises(index: ChunkIndex) -> None:
    index.close()
    with pytest.raises(KVRagError, match="closed"):
        index.records()


def test_atomic_write_json_and_failed_write(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m.json"
    atomic_files.atomic_write_json(target, {"b": 1, "a": [1, 2]})
    assert target.read_text().index('"a"') < target.read_text().index('"b"')  # sorted keys
    assert atomic_files.read_json(target) == {"a": [1, 2], "b": 1}
    assert target.stat().st_mode & 0o777 == 0o644
    monkeypatch.setattr(atomic_files.os, "replace", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        atomic_files.atomic_write_json(target, {"c": 3})
    assert atomic_files.read_json(target) == {"a": [1, 2], "b": 1}  # old contents intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # temp file cleaned up
    (tmp_path / ".m.json.x1.tmp").write_bytes(b"left by a killed writer")
    assert atomic_files.remove_stale_temps(target) == 1 and not list(tmp_path.glob(".*"))


# -- add / get / search ----------------------------------------------------------------------


def test_add_and_search_exact_nearest(index: ChunkIndex) -> None:
    recs, vecs = _batch(range(50))
    assert index.add(recs, vecs * 3.0) == 50  # scale does not matter: rows are normalised
    rng = np.random.default_rng(0)
    query = vecs[7] + 0.05 * rng.standard_normal(DIM).astype(np.float32)
    hits = index.search(query, k=5)
    expected = np.argsort(-(vecs @ (query / np.linalg.norm(query))))[:5]
    assert [h[0].key for h in hits] == [recs[i].key for i in expected]
    assert hits[0][0] == recs[7]
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)


def test_get_records_and_contains(index: ChunkIndex) -> None:
    recs, vecs = _batch(range(5))
    index.add(recs, vecs)
    assert index.records() == recs
    assert index.get("k00003") == recs[3]
    assert "k00003" in index and "nope" not in index and 3 not in index
    with pytest.raises(KeyError, match="nope"):
        index.get("nope")


def test_duplicate_keys_skipped(index: ChunkIndex) -> None:
    recs, vecs = _batch(range(3))
    assert index.add(recs, vecs) == 3
    more, more_vecs = _batch([1, 2, 3, 3])  # two already stored, one repeated in the batch
    assert index.add(more, more_vecs) == 1
    assert len(index) == 4 and index.keys() == {f"k{i:05d}" for i in range(4)}
    _assert_consistent(index)


def test_add_empty_and_bad_shapes(index: ChunkIndex) -> None:
    assert index.add([], np.zeros((0, DIM), np.float32)) == 0
    recs, vecs = _batch(range(2))
    with pytest.raises(ValueError, match="shape"):
        index.add(recs, vecs[:, :8])
    with pytest.raises(ValueError, match="2 records but 1"):
        index.add(recs, vecs[:1])
    with pytest.raises(ValueError, match="zero norm"):
        index.add(recs, np.zeros((2, DIM), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        index.add(recs, np.full((2, DIM), np.nan, np.float32))
    with pytest.raises(TypeError, match="ChunkRecord"):
        index.add(["x"], vecs[:1])  # type: ignore[list-item]
    assert len(index) == 0


def test_k_larger_than_index_returns_all(index: ChunkIndex) -> None:
    recs, vecs = _batch(range(4))
    index.add(recs, vecs)
    hits = index.search(vecs[0], k=100)
    assert len(hits) == 4 and hits[0][0] == recs[0]
    assert {h[0].key for h in hits} == index.keys()


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_bad_k_raises(index: ChunkIndex, k: object) -> None:
    with pytest.raises(ValueError, match="k must"):
        index.search(_vec("q"), k=k)  # type: ignore[arg-type]


def test_bad_query_raises(index: ChunkIndex) -> None:
    with pytest.raises(ValueError, match="query"):
        index.search(np.ones(DIM + 1, np.float32), k=1)
    with pytest.raises(ValueError, match="one vector"):
        index.search(np.ones((2, DIM), np.float32), k=1)


def test_hnsw_kind(tmp_path: Path) -> None:
    path = tmp_path / "hnsw"
    with ChunkIndex.create(path, {}, dim=DIM, kind="hnsw") as idx:
        for start in range(0, 300, 100):  # several appends grow one graph
            idx.add(*_batch(range(start, start + 100)))
    with ChunkIndex.open(path) as idx:
        assert idx.kind == "hnsw" and idx.manifest["vectors"]["hnsw_m"] == 32
        assert len(idx) == 300
        for i in (0, 123, 299):
            assert idx.search(_vec(f"k{i:05d}"), k=1)[0][0].key == f"k{i:05d}"
        assert len(idx.search(_vec("q"), k=1000)) == 300


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=4),
       query_seed=st.integers(0, 2**32 - 1))
def test_flat_matches_brute_force(tmp_path_factory: pytest.TempPathFactory, sizes: list[int],
                                  query_seed: int) -> None:
    with ChunkIndex.create(tmp_path_factory.mktemp("h") / "idx", {}, dim=DIM) as idx:
        start = 0
        for size in sizes:
            idx.add(*_batch(range(start, start + size)))
            start += size
        q = np.random.default_rng(query_seed).standard_normal(DIM).astype(np.float32)
        hits = idx.search(q, k=5)
        _, vecs = _batch(range(start))
        sims = vecs @ (q / np.linalg.norm(q))
        assert [s for _, s in hits] == pytest.approx(sorted(sims, reverse=True)[:5], abs=1e-5)


# -- manifest --------------------------------------------------------------------------------


def test_manifest_update_persists(index: ChunkIndex) -> None:
    other = ChunkIndex.open(index.path)
    index.update_manifest(codec={"name": "raw"}, note="hi")
    assert index.manifest["note"] == "hi" and index.manifest["embedder"] == "test"
    other.update_manifest(extra=1)  # keeps the fields written by `index`
    with ChunkIndex.open(index.path) as fresh:
        assert fresh.manifest["codec"] == {"name": "raw"}
        assert fresh.manifest["note"] == "hi" and fresh.manifest["extra"] == 1
    index.refresh()
    assert index.manifest["extra"] == 1
    with pytest.raises(ValueError, match="reserved"):
        index.update_manifest(vectors={})
    other.close()


def test_manifest_copy_is_detached(index: ChunkIndex) -> None:
    index.manifest["embedder"] = "changed"
    assert index.manifest["embedder"] == "test"


# -- other instances and processes -----------------------------------------------------------


def test_reader_sees_appends_from_other_instance(index: ChunkIndex) -> None:
    reader = ChunkIndex.open(index.path)
    index.add(*_batch(range(10)))
    assert len(reader) == 0  # snapshot until refreshed...
    assert reader.search(_vec("k00004"), k=1)[0][0].key == "k00004"  # ...search refreshes
    assert len(reader) == 10 and "k00009" in reader
    reader.add(*_batch(range(8, 12)))  # a second writer continues where the first stopped
    index.refresh()
    assert len(index) == 12
    _assert_consistent(index)
    reader.close()


def _append_in_child(path: str, start: int, stop: int, step: int) -> None:
    with ChunkIndex.open(path) as idx:
        for s in range(start, stop, step):
            idx.add(*_batch(range(s, min(s + step, stop))))


def _crash_in_child(path: str, start: int, stop: int) -> None:
    def die(*args: object, **kwargs: object) -> None:
        os._exit(17)  # killed after the vectors file was replaced, before metadata committed

    ChunkIndex._commit_rows = die  # type: ignore[method-assign]
    with ChunkIndex.open(path) as idx:
        idx.add(*_batch(range(start, stop)))


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError("disk full")  # fails after the vectors file was replaced, before the commit


def _run_child(target: Callable[..., object], *args: object) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    return proc


def test_concurrent_reader_while_other_process_appends(index: ChunkIndex) -> None:
    index.add(*_batch(range(5)))
    proc = _run_child(_append_in_child, str(index.path), 5, 205, 10)
    while proc.is_alive():
        key = f"k{len(index) - 1:05d}"  # the newest chunk of the current snapshot
        (hit, score), *_ = index.search(_vec(key), k=1)
        assert hit.key == key and score == pytest.approx(1.0, abs=1e-5)
    proc.join(30)
    index.refresh()
    assert proc.exitcode == 0
    assert len(index) == 205
    _assert_consistent(index)


def test_crash_between_vectors_and_metadata_in_process(index: ChunkIndex,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    index.add(*_batch(range(10)))
    monkeypatch.setattr(ChunkIndex, "_commit_rows", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        index.add(*_batch(range(10, 20)))
    monkeypatch.undo()
    assert len(index) == 10 and "k00015" not in index
    assert faiss.read_index(str(index.path / "vectors.faiss")).ntotal == 20  # orphans on disk
    _assert_consistent(index)
    assert index.add(*_batch(range(10, 25))) == 15
    _assert_consistent(index)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_killed_process_between_vectors_and_metadata(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "idx"
    with ChunkIndex.create(path, {}, dim=DIM, kind=kind) as idx:
        idx.add(*_batch(range(10)))
    reader = ChunkIndex.open(path)
    proc = _run_child(_crash_in_child, str(path), 10, 30)
    proc.join(30)
    assert proc.exitcode == 17
    assert faiss.read_index(str(path / "vectors.faiss")).ntotal == 30  # the crash hit mid-append
    for idx in (reader, ChunkIndex.open(path)):
        idx.refresh()
        assert len(idx) == 10 and idx.keys() == {f"k{i:05d}" for i in range(10)}
        assert len(idx.search(_vec("q"), k=100)) == 10
        _assert_consistent(idx)
    with ChunkIndex.open(path) as idx:  # resuming the append adds exactly what was lost
        assert idx.add(*_batch(range(0, 30))) == 20
        _assert_consistent(idx)
    reader.refresh()
    assert len(reader) == 30
    assert not list(path.glob(".*.tmp"))


def test_crash_during_first_append(index: ChunkIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChunkIndex, "_commit_rows", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        index.add(*_batch(range(3)))
    monkeypatch.undo()
    with ChunkIndex.open(index.path) as fresh:
        assert len(fresh) == 0 and fresh.search(_vec("q"), k=2) == []
    assert index.add(*_batch(range(3))) == 3
    _assert_consistent(index)


def test_vectors_file_replaced_or_garbage_is_corruption(index: ChunkIndex) -> None:
    index.add(*_batch(range(3)))
    empty = faiss.serialize_index(faiss.IndexFlatIP(DIM)).tobytes()
    (index.path / "vectors.faiss").write_bytes(empty)
    with pytest.raises(IndexCorruptError, match="vectors.faiss: does not match its recorded checksum.*kvrag repair"):
        ChunkIndex.open(index.path)
    (index.path / "vectors.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexCorruptError, match="vectors.faiss: does not match"):
        ChunkIndex.open(index.path)


def test_a_changed_chunk_text_is_caught_on_read(index: ChunkIndex) -> None:
    import sqlite3

    index.add(*_batch(range(3)))
    with sqlite3.connect(str(index.path / "chunks.sqlite")) as conn:
        conn.execute("UPDATE chunks SET text = 'chunk number 9' WHERE row = 1")
    with ChunkIndex.open(index.path) as fresh:
        with pytest.raises(IndexCorruptError, match="chunk row 1 does not match its checksum"):
            fresh.records()
        with pytest.raises(IndexCorruptError, match="chunk row 1"):
            fresh.get("k00001")
        assert fresh.get("k00002").text == "chunk number 2"


def test_manifest_damage_is_one_clear_error(index: ChunkIndex) -> None:
    manifest = index.path / ChunkIndex.MANIFEST
    good = manifest.read_bytes()
    for damaged, what in [(b"", "is empty"), (good[: len(good) // 2], "is not valid JSON"),
                          (good.replace(b'"test"', b'"tesu"'), "does not match its checksum")]:
        manifest.write_bytes(damaged)
        with pytest.raises(IndexCorruptError, match=what + ".*kvrag repair"):
            ChunkIndex.open(index.path)
