"""An index whose chunk caches are bounded in bytes (`StoreConfig.max_bytes`, ``kvrag index --max-cache-bytes``):
the bound is recorded and kept, evicted caches are computed again from their text with the same answers, and
``kvrag info`` and the server's ``/metrics`` report it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag import KVRag, SplitConfig, StoreConfig
from kvrag.cli import main
from kvrag.storage.stores import BoundedDiskStore

TOPICS = ["reactor", "telescope", "bridge", "library", "harbour", "observatory", "railway", "lighthouse"]
DOCS = [(t, f"The {t} of the old town was built by the guild of {t} makers in the year 18{i}0, and it is "
            f"still open to visitors every day of the week except on the first of May.") for i, t in enumerate(TOPICS)]
SPLIT = SplitConfig(mode="document")


def _held(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "chunks").glob("*/*.kvc"))


def test_a_bounded_lazy_index_keeps_its_bound_and_answers_as_an_unbounded_one(tiny_lm, tmp_path: Path):
    free = KVRag.build(DOCS, tmp_path / "free", model=tiny_lm, split=SPLIT, show_progress=False, codec="raw")
    blob = max(p.stat().st_size for p in (tmp_path / "free" / "chunks").glob("*/*.kvc"))
    bound = 3 * blob
    rag = KVRag.build(DOCS, tmp_path / "bounded", model=tiny_lm, split=SPLIT, show_progress=False, codec="raw",
                      caches=False, store=StoreConfig(max_bytes=bound))
    assert rag.manifest["store"]["max_bytes"] == bound and isinstance(rag.kvstore.store, BoundedDiskStore)
    for topic in TOPICS + TOPICS:  # more chunks than the bound holds: the least recently used go
        question = f"Who built the {topic}?"
        expected = free.answer(question, k=2, mode="reuse", max_new_tokens=3).token_ids
        for _ in range(2):  # the second time, the caches the first one stored are read
            assert rag.answer(question, k=2, mode="reuse", max_new_tokens=3).token_ids == expected
            assert _held(rag.path) <= bound
    stats = rag.kvstore.stats()
    assert stats["missing"] > 0 and stats["found"] > 0 and stats["held_bytes"] <= stats["max_bytes"] == bound
    rag.close()
    reopened = KVRag.open(tmp_path / "bounded", model=tiny_lm)  # the recorded bound holds after reopening
    assert isinstance(reopened.kvstore.store, BoundedDiskStore) and reopened.kvstore.store.max_bytes == bound
    reopened.close()
    free.close()


def test_the_command_line_records_and_shows_the_bound(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS:
        (docs / f"{name}.txt").write_text(text)
    index = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(index), "--model", str(tiny_model_dir), "--lazy",
                 "--max-cache-bytes", "200kB", "--split", "document", "-q"]) == 0
    capsys.readouterr()
    assert main(["info", str(index)]) == 0
    assert "caches kept under 200.0 kB" in capsys.readouterr().out
    assert main(["info", str(index), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_cache_bytes"] == 200_000
    assert main(["index", str(docs), "--index", str(tmp_path / "x"), "--max-cache-bytes", "lots"]) == 2
    assert "--max-cache-bytes: the value must be a size such as" in capsys.readouterr().err


def test_metrics_report_the_chunk_store():
    pytest.importorskip("prometheus_client")
    from kvrag.serve.metrics import ServeMetrics

    stats = {"found": 7, "missing": 2, "held_bytes": 1234, "max_bytes": 5000}
    text = ServeMetrics(lambda: 0, lambda: 0, lambda: None, chunk_store=lambda: stats).render()[0].decode()
    for line in ("kvrag_chunk_caches_found_total 7.0", "kvrag_chunk_caches_missing_total 2.0",
                 "kvrag_chunk_store_bytes 1234.0", "kvrag_chunk_store_limit_bytes 5000.0"):
        assert line in text
    unbounded = ServeMetrics(lambda: 0, lambda: 0, lambda: None, chunk_store=lambda: {"found": 1, "missing": 0})
    assert "kvrag_chunk_store_bytes" not in unbounded.render()[0].decode()
