"""Fault injection: kills at random points, damaged files of every kind, hostile indexes, a writer among readers.

Every case ends one of two ways, never a third: a `KVRagError` naming the damaged file (and, for damage,
``kvrag repair``), or the answer of the clean index. The soak test (``pytest -m soak tests/test_faults.py``)
runs many more random cases and prints its figures.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvrag import IndexCorruptError, KVRag, KVRagError, SplitConfig
from kvrag.cli import main
from kvrag.repair import repair_index
from kvrag.storage.integrity import row_digest
from kvrag.storage.verify import verify_index

SPLIT = SplitConfig(mode="fixed", max_tokens=24, min_tokens=4)
TOPICS = ["reactor", "station", "river", "forest", "bridge", "harbour", "tower", "canal", "garden", "mine"]
DOCS = [(f"d{i}", f"The {t} number {i} was built by team {i * 7 % 13}. It stands near the {TOPICS[(i + 3) % 10]}. "
         f"Its keeper is called Ada {i}. The {t} holds {i * 11} crates of salt and {i * 5} lamps. "
         f"Visitors come in spring to see the {t}.") for i, t in enumerate(TOPICS + TOPICS[:2])]
QUESTIONS = ["Who keeps the reactor?", "How many lamps does the canal hold?"]
ROOT = Path(__file__).resolve().parent.parent


def _answer(rag: KVRag, question: str) -> list[int]:
    return rag.answer(question, k=2, max_new_tokens=4).token_ids


@pytest.fixture(scope="module")
def clean(tiny_model_dir: Path, tiny_lm, tmp_path_factory: pytest.TempPathFactory):
    """A raw and a cachegen index, built without interruption, with their answers."""
    out = {}
    for codec in ("raw", "cachegen"):
        path = tmp_path_factory.mktemp(f"clean-{codec}") / "idx"
        rag = KVRag.build(DOCS, path, model=tiny_lm, split=SPLIT, codec=codec, batch_tokens=1, show_progress=False,
                          codec_state="index")  # every file in the folder, damaged copy by copy
        out[codec] = (path, [_answer(rag, q) for q in QUESTIONS])
        rag.close()
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- (b) every file kind damaged in every way ----------------------------------------------------------


def _damage(file: Path, how: str, rng: random.Random) -> None:
    data = file.read_bytes() if file.exists() else b""
    if how == "delete":
        file.unlink()
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "truncate":
        file.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif how == "bitflip":
        buf = bytearray(data)
        for _ in range(3):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(buf))
    elif how == "zero":
        start = rng.randrange(len(data))
        stop = min(len(data), start + rng.randrange(1, 512))
        file.write_bytes(data[:start] + bytes(stop - start) + data[stop:])
    else:
        raise ValueError(how)


def _files(path: Path, kind: str) -> list[Path]:
    if kind == "cache":
        return sorted((path / "chunks").glob("*/*.kvc"))[:1]
    if kind == "codec":
        return sorted((path / "codec").glob("cachegen.*"))
    return [path / kind]


def _outcome(path: Path, tiny_lm, expected: list[list[int]]) -> str:
    """``"error"`` (one clear KVRagError), ``"same"`` (the clean answers), ``"silent"`` or ``"unclear"``."""
    try:
        rag = KVRag.open(path, model=tiny_lm)
        try:
            got = [_answer(rag, q) for q in QUESTIONS]
        finally:
            rag.close()
    except KVRagError as exc:
        text = str(exc)
        return "error" if "\n" not in text and str(path) in text else "unclear"
    except Exception:
        return "unclear"
    return "same" if got == expected else "silent"


def run_damage_case(clean_path: Path, expected: list[list[int]], work: Path, kind: str, how: str, seed: int,
                    tiny_lm, repair: bool = True) -> dict[str, str]:
    """Damage one file of a copy of the clean index; check the answer, then repair and check it again."""
    rng = random.Random(seed)
    path = _copy(clean_path, work / f"{kind.replace('.', '_')}-{how}-{seed}")
    targets = _files(path, kind)
    for file in targets[:1] if how != "delete" else targets:
        _damage(file, how, rng)
    result = {"first": _outcome(path, tiny_lm, expected)}
    report = verify_index(path)
    result["verify"] = "ok" if report.ok else "damaged"
    if repair and not report.ok:
        try:
            fixed = repair_index(path, model=tiny_lm)
            # texts whose only copy was damaged are named in the report: the answer may then differ
            result["repaired"] = "named" if fixed.lost and fixed.ok else _outcome(path, tiny_lm, expected)
        except IndexCorruptError as exc:  # what cannot be rebuilt is named in one line
            result["repaired"] = "error" if str(path) in str(exc) and "\n" not in str(exc) else "unclear"
    shutil.rmtree(path, ignore_errors=True)
    return result


DAMAGES = ("truncate", "empty", "bitflip", "delete", "zero")


@pytest.mark.parametrize("kind", ["manifest.json", "chunks.sqlite", "vectors.faiss", "cache"])
def test_damaged_raw_index_is_detected_or_recovered(clean, tiny_lm, tmp_path, kind):
    path, expected = clean["raw"]
    for seed, how in enumerate(DAMAGES):
        result = run_damage_case(path, expected, tmp_path, kind, how, seed, tiny_lm)
        assert result["first"] in ("error", "same"), (kind, how, result)
        if kind == "vectors.faiss" or (kind == "manifest.json" and how != "zero"):
            assert result["first"] == "error" and result["verify"] == "damaged", (kind, how, result)
        if "repaired" in result:  # the repaired index answers as the clean one, or names what is lost
            assert result["repaired"] in ("same", "error", "named"), (kind, how, result)
        if kind in ("manifest.json", "vectors.faiss", "cache"):
            assert result.get("repaired", "same") == "same", (kind, how, result)


def test_damaged_codec_state_is_detected_and_refitted(clean, tiny_lm, tmp_path):
    path, expected = clean["cachegen"]
    for seed, how in enumerate(DAMAGES):
        result = run_damage_case(path, expected, tmp_path, "codec", how, seed, tiny_lm, repair=False)
        assert result["first"] in ("error", "same") and result["verify"] == "damaged", (how, result)
    work = _copy(path, tmp_path / "refit")
    _damage(work / "codec" / "cachegen.npz", "bitflip", random.Random(1))
    with pytest.raises(IndexCorruptError, match=r"codec: is damaged.*kvrag repair"):
        KVRag.open(work, model=tiny_lm)
    report = repair_index(work, model=tiny_lm)
    assert report.ok and any("fitted again" in line for line in report.rebuilt)
    rag = KVRag.open(work, model=tiny_lm)
    assert len(rag.index) == len(KVRag.open(path, model=tiny_lm).index)
    assert [_answer(rag, q) for q in QUESTIONS] == expected  # refitted on the same chunks: the same state


def test_a_shared_codec_state_lost_or_damaged_is_named_and_refitted_by_repair(tiny_lm, tmp_path, monkeypatch):
    import shutil as sh

    from kvrag.storage import codec_state

    monkeypatch.setenv("KVRAG_CACHE_DIR", str(tmp_path / "user-cache"))
    path = tmp_path / "idx"
    rag = KVRag.build(DOCS, path, model=tiny_lm, split=SPLIT, codec="cachegen", show_progress=False)
    expected = [_answer(rag, q) for q in QUESTIONS]
    rag.close()
    assert not list((path / "codec").glob("cachegen.*"))  # the state is the model's, not the index's
    name, digest = codec_state.read_ref(path / "codec")
    folder = codec_state.states_root() / name / digest
    other = KVRag.build(DOCS, tmp_path / "other", model=tiny_lm, split=SPLIT, show_progress=False)
    assert codec_state.read_ref(other.path / "codec") == (name, digest)  # the same fit: one folder for both
    other.close()
    for damage in ("bitflip", "delete"):
        if damage == "delete":
            sh.rmtree(folder)
        else:
            _damage(folder / "cachegen.npz", damage, random.Random(3))
        with pytest.raises(IndexCorruptError, match=r"codec: is damaged: the shared codec state .*kvrag repair"):
            KVRag.open(path, model=tiny_lm)
        assert not verify_index(path).ok
        report = repair_index(path, model=tiny_lm)
        assert report.ok and any("fitted again" in line for line in report.rebuilt)
        rag = KVRag.open(path, model=tiny_lm)
        assert [_answer(rag, q) for q in QUESTIONS] == expected  # refitted on the same chunks: the same state
        rag.close()
        assert verify_index(tmp_path / "other").ok  # the other index reads the refitted state too


def test_a_shared_state_reference_that_leaves_the_states_folder_is_refused(tmp_path, monkeypatch):
    import json

    from kvrag.storage import codec_state

    monkeypatch.setenv("KVRAG_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(codec_state, "RETRY_S", 0.0)
    digest = "0" * 24
    outside = codec_state.states_root() / ".." / "elsewhere" / digest  # a folder an index must not reach
    outside.mkdir(parents=True)
    codec = tmp_path / "idx" / "codec"
    codec.mkdir(parents=True)
    for name in ("../elsewhere", "..", "a/b", ".hidden", ""):
        (codec / codec_state.REF).write_text(json.dumps({"name": name, "digest": digest}))
        with pytest.raises(codec_state.SharedStateError, match="is damaged: .* not a codec state name"):
            codec_state.read_ref(codec)
        with pytest.raises(codec_state.SharedStateError, match="not a codec state name"):
            codec_state.load_from_folder(object(), name, digest)
    (codec / codec_state.REF).write_text(json.dumps({"name": "cachegen-abc.1_x", "digest": digest}))
    assert codec_state.read_ref(codec) == ("cachegen-abc.1_x", digest)


def test_a_changed_text_in_the_database_is_an_error_and_repair_names_it(clean, tiny_lm, tmp_path):
    path, expected = clean["raw"]
    work = _copy(path, tmp_path / "text")
    with sqlite3.connect(str(work / "chunks.sqlite")) as conn:
        conn.execute("UPDATE chunks SET text = text || '.'")  # every row, so a retrieved one
    rag = KVRag.open(work, model=tiny_lm)
    with pytest.raises(IndexCorruptError, match=r"chunks.sqlite: chunk row \d+ does not match its checksum"):
        _answer(rag, QUESTIONS[0])
    rag.close()
    assert main(["verify", str(work)]) == 1
    with pytest.raises(IndexCorruptError, match="is lost"):  # every text is damaged: nothing to keep
        repair_index(work, model=tiny_lm)


def test_verify_and_repair_commands(clean, tiny_lm, tmp_path, capsys):
    path, expected = clean["raw"]
    assert main(["verify", str(path)]) == 0
    assert "ok (" in capsys.readouterr().out
    work = _copy(path, tmp_path / "cmd")
    (work / "vectors.faiss").write_bytes(b"")
    (work / "manifest.json").write_text("{")
    assert main(["verify", str(work)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("manifest:") for line in out)
    assert main(["ask", str(work), "Who keeps the reactor?"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "manifest.json" in err and "kvrag repair" in err
    report = repair_index(work, model=tiny_lm)
    assert report.ok, report.lines()
    rag = KVRag.open(work, model=tiny_lm)
    assert [_answer(rag, q) for q in QUESTIONS] == expected


# -- (c) hostile indexes ---------------------------------------------------------------------------------


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_link_out_of_the_index_is_refused_and_nothing_outside_is_touched(clean, tiny_lm, tmp_path, capsys):
    path, _ = clean["raw"]
    work = _copy(path, tmp_path / "links")
    outside = tmp_path / "outside"
    shutil.move(str(work / "chunks"), str(outside))
    (work / "chunks").symlink_to(outside, target_is_directory=True)
    before = _listing(outside)
    with pytest.raises(IndexCorruptError, match="outside the index"):
        KVRag.open(work, model=tiny_lm)
    with pytest.raises(IndexCorruptError, match="outside the index"):
        KVRag.build(["A new document about lamps."], work, model=tiny_lm, show_progress=False)
    doc = tmp_path / "new.txt"
    doc.write_text("A new document about lamps and salt.")
    assert main(["index", str(doc), "--index", str(work)]) == 2
    assert "outside the index" in capsys.readouterr().err
    with pytest.raises(IndexCorruptError, match="remove the link"):
        repair_index(work, model=tiny_lm)
    assert _listing(outside) == before


def test_traversal_keys_pickles_and_absurd_headers_run_nothing(clean, tiny_lm, tmp_path, tiny_model_dir):
    path, expected = clean["raw"]
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = pickle.dumps(Payload())
    work = _copy(path, tmp_path / "keys")
    with sqlite3.connect(str(work / "chunks.sqlite")) as conn:
        row = conn.execute("SELECT row, key, doc_id, seq, text, n_tokens, source FROM chunks WHERE row = 0").fetchone()
        key = "../../../../" + "a" * 28
        conn.execute("UPDATE chunks SET key = ?, digest = ? WHERE row = 0", (key, row_digest(key, *row[2:])))
    with pytest.raises(IndexCorruptError, match="never writes"):
        KVRag.open(work, model=tiny_lm)
    for file in ("vectors.faiss", "manifest.json"):
        work = _copy(path, tmp_path / f"pickle-{file}")
        (work / file).write_bytes(evil)
        with pytest.raises(IndexCorruptError):
            KVRag.open(work, model=tiny_lm)
    work = _copy(path, tmp_path / "blobs")  # every cache a pickle, then absurd header sizes: recomputed
    blobs = sorted((work / "chunks").glob("*/*.kvc"))
    for i, blob in enumerate(blobs):
        data = blob.read_bytes()
        blob.write_bytes(evil if i % 2 else data[:4] + b"\x01\x00" + b"\xff\xff\xff\x7f" + data[10:])
    rag = KVRag.open(work, model=tiny_lm)
    assert [_answer(rag, q) for q in QUESTIONS] == expected
    rag.close()
    cg_path, _ = clean["cachegen"]
    work = _copy(cg_path, tmp_path / "npz")
    import io

    import numpy as np
    buf = io.BytesIO()
    np.savez(buf, mean=np.array([Payload()], dtype=object))
    (work / "codec" / "cachegen.npz").write_bytes(buf.getvalue())
    with pytest.raises(IndexCorruptError, match="codec"):
        KVRag.open(work, model=tiny_lm)
    model = tmp_path / "pickled-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(evil)
    from kvrag.model.loading import load_model
    with pytest.raises(KVRagError, match="pickle") as info:
        load_model(str(model), device="cpu")
    assert "\n" not in str(info.value)
    assert not marker.exists()


# -- bad inputs ------------------------------------------------------------------------------------------


def test_bad_inputs_are_input_errors(tiny_lm, tmp_path, capsys):
    from kvrag import InputError

    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(InputError, match="is a file"):
        KVRag.build(["text"], file, model=tiny_lm, show_progress=False)
    with pytest.raises(InputError, match="batch_tokens"):
        KVRag.build(["text"], tmp_path / "b", model=tiny_lm, batch_tokens=0, show_progress=False)
    with pytest.raises(InputError, match="does not exist"):
        KVRag.build([tmp_path / "missing.txt"], tmp_path / "c", model=tiny_lm, show_progress=False)
    doc = tmp_path / "doc.txt"
    doc.write_text("A document.")
    assert main(["index", str(doc), "--index", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrag: error:") and "is a file" in err and err.count("\n") == 1


def test_build_killed_before_the_codec_state_resumes(tiny_lm, tmp_path, monkeypatch):
    from kvrag.indexing import build

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_fit_codec", killed)
    with pytest.raises(KeyboardInterrupt):
        KVRag.build(DOCS[:6], tmp_path / "idx", model=tiny_lm, split=SPLIT, codec="cachegen", show_progress=False,
                    codec_state="index")
    monkeypatch.undo()
    assert not list((tmp_path / "idx" / "chunks").glob("*/*.kvc"))
    rag = KVRag.build(DOCS[:6], tmp_path / "idx", model=tiny_lm, split=SPLIT, codec="cachegen", show_progress=False)
    assert len(rag.index) > 0 and verify_index(rag.path).ok


# -- (a) kill -9 at random points, then resume --------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    import kvrag.indexing.build as b
    b.GROUP_CHUNKS = 4  # many commits, so a kill lands between them too
    from tests.test_faults import DOCS, SPLIT
    op, path, model, codec = sys.argv[1:5]
    if op == "cli":
        from kvrag.cli import main
        print("go", flush=True)
        sys.exit(main(["index", *sys.argv[5:], "--index", path, "--model", model, "--codec", codec,
                       "--split", "fixed", "--max-tokens", "24", "--min-tokens", "4", "--batch-tokens", "1", "-q"]))
    from kvrag import KVRag
    from kvrag.model.loading import load_model
    lm = load_model(model, device="cpu")
    docs = DOCS if op == "build" else DOCS[6:]
    print("go", flush=True)
    KVRag.build(docs, path, model=lm, split=SPLIT, codec=codec, batch_tokens=1, show_progress=False)
""")


def _killed_run(args: list[str], delay: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, cwd=ROOT)
    assert proc.stdout is not None
    proc.stdout.readline()  # "go": the model is loaded, the work starts
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)


def kill_and_resume(op: str, codec: str, seed: int, clean_path: Path, work: Path, tiny_model_dir: Path,
                    tiny_lm, prefills: dict[str, int]) -> dict[str, int]:
    """Kill ``op`` after a random delay, resume it, and compare with the uninterrupted index."""
    rng = random.Random(seed)
    path = work / f"{op}-{codec}-{seed}"
    if op == "add":  # an index of the first six documents, then the others appended
        KVRag.build(DOCS[:6], path, model=tiny_lm, split=SPLIT, codec=codec, batch_tokens=1,
                    show_progress=False).close()
    docs_dir = work / "docs"
    if op == "cli" and not docs_dir.exists():
        docs_dir.mkdir()
        for doc_id, text in DOCS:
            (docs_dir / f"{doc_id}.txt").write_text(text)
    extra = [str(docs_dir)] if op == "cli" else []
    _killed_run([op, str(path), str(tiny_model_dir), codec, *extra], rng.uniform(0.0, 2.5))
    keys_cached = {p.stem for p in (path / "chunks").glob("*/*.kvc")} if path.exists() else set()
    docs = [Path(docs_dir)] if op == "cli" else DOCS
    prefills["n"] = 0
    rag = KVRag.build(docs, path, model=tiny_lm, split=SPLIT, codec=codec, batch_tokens=1, show_progress=False)
    stats = rag.add(docs, show_progress=False)  # a second pass finds nothing to do
    keys = rag.index.keys()
    clean = KVRag.open(clean_path, model=tiny_lm)
    assert keys == clean.index.keys() and stats.prefilled_chunks == 0
    assert verify_index(path).ok
    if codec == "raw":  # the same cache bytes as the uninterrupted build
        for key in keys:
            assert (path / "chunks" / key[:2] / f"{key}.kvc").read_bytes() == \
                   (clean_path / "chunks" / key[:2] / f"{key}.kvc").read_bytes()
    clean.close()
    rag.close()
    return {"cached_before_resume": len(keys_cached & keys), "chunks": len(keys)}


@pytest.mark.parametrize("op,codec,seed", [("build", "raw", 0), ("build", "cachegen", 1), ("add", "raw", 2),
                                           ("cli", "raw", 3)])
def test_killed_at_a_random_point_resumes_to_the_same_index(clean, tiny_model_dir, tiny_lm, tmp_path, op, codec,
                                                            seed, monkeypatch):
    from kvrag.indexing import build

    counted = {"n": 0}
    original = build.chunk_caches

    def counting(lm, prefix, chunks, *args, **kwargs):
        for item in original(lm, prefix, chunks, *args, **kwargs):
            counted["n"] += 1
            yield item

    monkeypatch.setattr(build, "chunk_caches", counting)
    result = kill_and_resume(op, codec, seed, clean[codec][0], tmp_path, tiny_model_dir, tiny_lm, counted)
    # only the chunks whose caches were missing after the kill were prefilled again, each once
    assert counted["n"] == result["chunks"] - result["cached_before_resume"], result


# -- (d) one writer, three readers --------------------------------------------------------------------------


def test_one_writer_three_readers(clean, tiny_lm, tmp_path):
    path = tmp_path / "rw"
    KVRag.build(DOCS[:6], path, model=tiny_lm, split=SPLIT, batch_tokens=1, show_progress=False).close()
    base = KVRag.open(path, model=tiny_lm)
    keys = [r.key for r in base.index.records()[:2]]
    expected = base.answer(QUESTIONS[0], chunks=keys, max_new_tokens=4).token_ids
    base.close()
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            with KVRag.open(path, model=tiny_lm) as rag:
                for i in range(6, len(DOCS), 2):
                    rag.add(DOCS[i:i + 2], show_progress=False)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            with KVRag.open(path, model=tiny_lm) as rag:
                while not done.is_set():
                    assert rag.answer(QUESTIONS[0], chunks=keys, max_new_tokens=4).token_ids == expected
                    for chunk in rag.retrieve(QUESTIONS[1], k=3):
                        rag.kvstore.load(chunk.key)  # a chunk visible to readers has its whole cache
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert verify_index(path).ok


# -- soak ---------------------------------------------------------------------------------------------------


@pytest.mark.soak
def test_soak(clean, tiny_lm, tmp_path, request):
    if "soak" not in (request.config.getoption("-m") or ""):
        pytest.skip("the soak runs with: pytest -m soak tests/test_faults.py")
    cases = int(os.environ.get("KVRAG_SOAK_CASES", "200"))
    rng = random.Random(2024)
    figures = {"cases": 0, "error": 0, "same": 0, "silent": 0, "unclear": 0, "repaired": 0, "outside": 0}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("untouched")
    for i in range(cases):
        codec = rng.choice(["raw", "cachegen"])
        kind = rng.choice(["manifest.json", "chunks.sqlite", "vectors.faiss", "cache"] + (["codec"] if codec ==
                                                                                           "cachegen" else []))
        path, expected = clean[codec]
        result = run_damage_case(path, expected, tmp_path, kind, rng.choice(DAMAGES), i, tiny_lm,
                                 repair=codec == "raw")
        figures["cases"] += 1
        figures[result["first"]] += 1
        figures["repaired"] += result.get("repaired") == "same"
        if result.get("repaired") in ("silent", "unclear"):
            figures[result["repaired"]] += 1
    figures["outside"] = int(_listing(outside) != {"keep.txt": b"untouched"})
    print(f"\nsoak figures: {figures}")
    assert figures["silent"] == 0 and figures["unclear"] == 0 and figures["outside"] == 0
