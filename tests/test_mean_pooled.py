"""The default embedder run with transformers alone (`kvrag.mean_pooled`): the same embeddings as
sentence-transformers gives for the same folder, long texts truncated alike, and only plain mean-pooled folders
taken that way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvrag.embedder import Embedder, resolve_embedder
from kvrag.mean_pooled import MeanPooledEncoder, is_mean_pooled

TEXTS = ["The Nile flows north through eleven countries.", "a cat", "",
         "Mount Everest " * 200,  # past the 256-token limit: truncated
         "Ünïcode, emoji 🙂 and numbers 1,234.5 in one line.", "Who proposed the theory of continental drift?"]


def test_the_default_embedder_is_mean_pooled_and_equals_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    folder = resolve_embedder(None)
    assert is_mean_pooled(folder)
    assert isinstance(Embedder().model, MeanPooledEncoder)
    light = MeanPooledEncoder(folder, "cpu").encode(TEXTS, batch_size=4, normalize_embeddings=True)
    full = SentenceTransformer(folder, device="cpu").encode(TEXTS, batch_size=4, convert_to_numpy=True,
                                                           normalize_embeddings=True)
    assert light.shape == full.shape == (len(TEXTS), 384) and light.dtype == np.float32
    np.testing.assert_allclose(light, full, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(light, axis=1), 1.0, atol=1e-5)


def test_other_pipelines_are_left_to_sentence_transformers(tmp_path: Path):
    folder = Path(resolve_embedder(None))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    pooling = copy / "1_Pooling" / "config.json"
    settings = json.loads(pooling.read_text())
    pooling.write_text(json.dumps(settings | {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))
    assert not is_mean_pooled(copy)  # CLS pooling
    pooling.write_text(json.dumps(settings))
    (copy / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": True}))
    assert not is_mean_pooled(copy)  # lower-cased input
    assert not is_mean_pooled(tmp_path / "missing") and not is_mean_pooled(tmp_path)


def test_answering_with_the_default_embedder_never_imports_sentence_transformers(tmp_path: Path):
    code = ("import sys; from kvrag.embedder import Embedder; e = Embedder(); v = e.encode_query('a cat'); "
            "assert v.shape == (384,); print('sentence_transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
