"""What opening an index trusts, and the one-line errors for what an edited or damaged index names.

A manifest's checksum is no signature: these tests edit ``manifest.json`` and write it back with its checksum
recomputed, as anyone who can write the file can. An embedder or model path outside the index is refused unless
the caller names it or this user built an index from it; a codec level kvrag does not offer is one
`IndexCorruptError`; a chunk key the index does not hold (rows lost from a ``chunks.sqlite`` overwritten with
garbage pages) is one `ChunkNotFoundError`, never a bare `KeyError`. Tiny random model.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvrag import ChunkNotFoundError, IndexCorruptError, KVRag, KVRagError, SplitConfig, UntrustedPathError
from kvrag.cli import main
from kvrag.storage.integrity import write_manifest
from kvrag.storage.verify import verify_index

DOCS = [(f"d{i}", f"The depot {i} is kept by Ada {i}. It holds {i * 5} lamps and {i} crates of salt.")
        for i in range(12)]
QUESTION = "Who keeps depot 3?"


@pytest.fixture(scope="module")
def clean(tiny_lm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trust") / "idx"
    KVRag.build(DOCS, path, model=tiny_lm, split=SplitConfig(mode="document"), show_progress=False).close()
    return path


def _copy(clean: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "idx"))


def _edit_manifest(path: Path, **changes: Any) -> None:
    """Change the manifest and write it back with a valid checksum (what an attacker can do)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("checksum", None)
    for key, value in changes.items():
        if isinstance(value, dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    write_manifest(path / "manifest.json", manifest)


def test_an_embedder_path_outside_the_index_is_refused_unless_named(clean: Path, tmp_path: Path, tiny_lm, capsys):
    path = _copy(clean, tmp_path)
    outside = tmp_path / "someone-elses-embedder"
    outside.mkdir()
    (outside / "modules.json").write_text("[]")
    _edit_manifest(path, embedder=str(outside))
    with pytest.raises(UntrustedPathError) as refused:
        KVRag.open(path, model=tiny_lm)
    message = str(refused.value)
    assert "\n" not in message and str(outside) in message and "embedder=" in message and "--embedder" in message
    assert main(["ask", str(path), QUESTION, "--model", str(tiny_lm.source)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--embedder" in err
    with KVRag.open(path, model=tiny_lm, embedder=str(outside)) as opened:  # named by the caller: trusted
        assert opened.embedder.name == str(outside)
    for relative in ("../elsewhere", "~/elsewhere"):
        _edit_manifest(path, embedder=relative)
        with pytest.raises(UntrustedPathError):
            KVRag.open(path, model=tiny_lm)


def test_an_embedder_inside_the_index_or_a_hub_name_opens(clean: Path, tmp_path: Path, tiny_lm):
    path = _copy(clean, tmp_path)
    inside = path / "embedder"
    inside.mkdir()
    _edit_manifest(path, embedder=str(inside))
    with KVRag.open(path, model=tiny_lm) as opened:
        assert opened.embedder.name == str(inside)
    _edit_manifest(path, embedder="someone/some-hub-model")  # a hub id is no local path
    KVRag.open(path, model=tiny_lm).close()


def test_a_model_path_outside_the_index_is_refused_unless_named_or_built_from_here(clean: Path, tmp_path: Path,
                                                                                   tiny_lm, tiny_model_dir, capsys):
    from kvrag import trusted_paths

    path = _copy(clean, tmp_path)
    foreign = Path(shutil.copytree(tiny_model_dir, tmp_path / "someone-elses-model"))  # never built from here
    _edit_manifest(path, model={"source": str(foreign)})
    with pytest.raises(UntrustedPathError) as refused:
        KVRag.open(path)
    message = str(refused.value)
    assert "\n" not in message and str(foreign) in message and "model=" in message and "--model" in message
    assert main(["ask", str(path), QUESTION]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err
    with KVRag.open(path, model=str(foreign)) as opened:  # named by the caller: trusted
        assert opened.lm.fingerprint == tiny_lm.fingerprint
    KVRag.open(path, model=tiny_lm).close()
    # an index this user builds from a local folder opens again without naming it
    built = tmp_path / "built"
    KVRag.build(DOCS[:3], built, model=str(foreign), split=SplitConfig(mode="document"), show_progress=False).close()
    assert trusted_paths.trusted(foreign)
    KVRag.open(built).close()
    KVRag.open(path).close()  # the folder is this user's now


@pytest.mark.parametrize("level", [10**9, -3, "high", 2.5])
def test_an_absurd_codec_level_is_one_kvrag_error(clean: Path, tmp_path: Path, tiny_lm, level: Any, capsys):
    path = _copy(clean, tmp_path)
    _edit_manifest(path, codec={"level": level})
    with pytest.raises(IndexCorruptError) as refused:
        KVRag.open(path, model=tiny_lm)
    message = str(refused.value)
    assert "\n" not in message and "manifest.json" in message and "codec" in message and "kvrag index" in message
    report = verify_index(path)
    assert not report.ok and any(p.part == "manifest" and "codec" in p.what for p in report.problems)
    assert main(["verify", str(path)]) == 1
    assert "codec" in capsys.readouterr().out


def test_a_key_the_index_does_not_hold_is_a_kvrag_error_naming_verify(clean: Path, tmp_path: Path, tiny_lm):
    with KVRag.open(clean, model=tiny_lm) as rag:
        with pytest.raises(ChunkNotFoundError) as missing:
            rag.answer(QUESTION, chunks=["ab" * 20], max_new_tokens=2)
    error = missing.value
    assert isinstance(error, KVRagError) and isinstance(error, KeyError)  # KeyError: what it raised before
    assert str(clean) in str(error) and f"kvrag verify {clean}" in str(error) and "\n" not in str(error)


@pytest.mark.parametrize("seed", range(6))
def test_garbage_pages_in_chunks_sqlite_give_an_answer_or_one_kvrag_error(clean: Path, tmp_path: Path, tiny_lm,
                                                                        seed: int):
    with KVRag.open(clean, model=tiny_lm) as rag:
        keys = [c.key for c in rag.retrieve(QUESTION, k=2)]
    path = _copy(clean, tmp_path)
    db = path / "chunks.sqlite"
    data, rng, page = bytearray(db.read_bytes()), random.Random(seed), 4096
    for p in rng.sample(range(1, len(data) // page), max(1, len(data) // page // 3)):
        data[p * page:(p + 1) * page] = rng.randbytes(page)
    db.write_bytes(bytes(data))
    for ask in ({}, {"chunks": keys}):
        try:
            with KVRag.open(path, model=tiny_lm) as rag:
                assert rag.answer(QUESTION, k=2, max_new_tokens=2, **ask).token_ids
        except KVRagError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc) and ("repair" in str(exc) or "verify" in str(exc))
