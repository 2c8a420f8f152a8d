"""End to end on a tiny random model: build, open, answer, append, resume, mismatches, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrag import FuseConfig, GenerateConfig, KVRag, SplitConfig
from kvrag.errors import CorruptChunkError, IndexMismatchError, IndexNotFoundError, InputError
from kvrag.storage.integrity import write_manifest

DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987.\n\nIt runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
    ("delta", "The delta of a river is where it meets the sea. Sediment builds up there."),
]
SPLIT = SplitConfig(mode="semantic", max_tokens=48, min_tokens=8)


@pytest.fixture(scope="module")
def built(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rag") / "idx"
    # lossless caches: these tests check exactness (recomputing everything reproduces a full prefill); the
    # first chunk's stored cache is exact only when stored losslessly
    rag = KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SPLIT, show_progress=False, codec="raw")
    return rag, path


def test_build_open_answer_round_trip(built, tiny_lm):
    rag, path = built
    assert len(rag.index) >= len(DOCS)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["model"]["fingerprint"] == rag.lm.fingerprint
    assert manifest["codec"]["name"] == "raw"
    reopened = KVRag.open(path, model=tiny_lm)
    answer = reopened.answer("Who designed the alpha reactor?", k=3, mode="cacheblend", max_new_tokens=5)
    assert len(answer.chunks) == 3 and all(c.key in rag.index for c in answer.chunks)
    assert answer.ttft_s > 0 and set(answer.timings) >= {"retrieve_s", "load_s", "fuse_s"}
    assert 0 < answer.recompute_fraction < 1
    assert len(answer.token_ids) <= 5


def test_every_mode_answers_and_recompute_everything_matches_full(built):
    rag, _ = built
    q = "Who commands beta station?"
    full = rag.answer(q, k=4, mode="full", max_new_tokens=6)
    blend_all = rag.answer(q, k=4, mode="cacheblend", ratio=1.0, max_new_tokens=6)
    assert blend_all.token_ids == full.token_ids
    for mode in ("prefix", "reuse", "attnlink"):
        assert rag.answer(q, k=4, mode=mode, max_new_tokens=3).mode == mode
    assert full.recompute_fraction == 1.0


def test_answering_and_scoring_raise_no_library_deprecation_warning(built):
    import warnings

    rag, _ = built
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = rag.prepare("Who commands beta station?", k=2)
        fused.generate(GenerateConfig(max_new_tokens=3))
        fused.nll([1, 2, 3])
        rag.answer("Who commands beta station?", k=2, mode="full", max_new_tokens=2)
    noisy = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not noisy, noisy


def test_stream_yields_the_answer_text(built):
    rag, _ = built
    pieces = list(rag.stream("What are gamma rays?", k=2, mode="attnlink", max_new_tokens=6))
    assert rag.last_answer is not None
    assert "".join(pieces).strip() == rag.last_answer.text


def test_direct_chunk_ids_and_nll(built):
    rag, _ = built
    keys = [r.key for r in rag.index.records()[:2]]
    answer = rag.answer("Where is sediment?", chunks=keys, mode="reuse", max_new_tokens=4)
    assert [c.key for c in answer.chunks] == keys
    assert rag.prompt_text("Where is sediment?", keys).count("\n\n") >= 2
    full_nll = rag.nll("Where is sediment?", [5, 6, 7], keys, mode="full")
    same = rag.nll("Where is sediment?", [5, 6, 7], keys, fuse_config=FuseConfig(mode="cacheblend", ratio=1.0))
    assert abs(full_nll - same) < 1e-4
    with pytest.raises(KeyError, match="nope"):
        rag.answer("q?", chunks=["nope"])


@pytest.mark.parametrize("mode", ["full", "cacheblend", "reuse"])
def test_scoring_during_an_answer_equals_nll_and_greedy_logprobs_score_the_answer(built, mode):
    rag, _ = built
    keys = [c.key for c in rag.retrieve("Where is sediment?", k=3)]
    full = rag.answer("Where is sediment?", chunks=keys, mode="full", max_new_tokens=6)
    assert len(full.token_logprobs) == len(full.token_ids) > 0
    assert all(lp <= 0 for lp in full.token_logprobs)
    own = rag.nll("Where is sediment?", full.token_ids, keys, mode="full")
    assert -sum(full.token_logprobs) / len(full.token_logprobs) == pytest.approx(own, abs=1e-4)
    if mode == "full":  # teacher-forced, full's rows pick its greedy tokens with the log-probs decoding saw
        rows = rag.teacher_logprobs("Where is sediment?", full.token_ids, keys, mode="full")
        assert rows.shape == (len(full.token_ids), rag.lm.model.config.vocab_size)
        assert rows.argmax(-1).tolist() == full.token_ids
        picked = rows.gather(1, torch.tensor(full.token_ids)[:, None]).squeeze(1)
        assert picked.tolist() == pytest.approx(full.token_logprobs, abs=1e-4)
    fused = rag.prepare("Where is sediment?", chunks=keys, mode=mode)
    answered = fused.generate(GenerateConfig(max_new_tokens=6))
    scored = fused.nll(full.token_ids)  # on the cache it answered from: generation is rewound first
    assert scored == pytest.approx(rag.nll("Where is sediment?", full.token_ids, keys, mode=mode), abs=1e-4)
    assert fused.nll(full.token_ids) == pytest.approx(scored, abs=1e-6)  # and again: scoring rewinds too
    again = fused.generate(GenerateConfig(max_new_tokens=6))
    assert again.token_ids == answered.token_ids and again.ttft_s >= answered.ttft_s


def test_answer_from_given_caches_equals_the_stored_ones_and_counts_are_checked(built):
    rag, _ = built
    keys = [r.key for r in rag.index.records()[:3]]
    q = "Who commands beta station?"
    caches = [rag.kvstore.load(k) for k in keys]
    for mode in ("reuse", "cacheblend"):
        stored = rag.answer(q, chunks=keys, mode=mode, max_new_tokens=5)
        given_prompt = rag.prepare(q, chunks=keys, mode=mode, caches=caches)
        given = given_prompt.generate(GenerateConfig(max_new_tokens=5))
        assert given.token_ids == stored.token_ids
        assert given.token_logprobs == pytest.approx(stored.token_logprobs, abs=1e-6)
        zeroed = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
        other = rag.prepare(q, chunks=keys, mode=mode, caches=zeroed).nll(stored.token_ids)
        assert other != pytest.approx(given_prompt.nll(stored.token_ids), abs=1e-4)  # the given caches are fused
    reuse = rag.answer(q, chunks=keys, mode="reuse", max_new_tokens=1, caches=caches)
    one_recomputed = rag.answer(q, chunks=keys, mode="reuse", max_new_tokens=1, caches=[None, *caches[1:]])
    assert one_recomputed.recompute_fraction > reuse.recompute_fraction
    with pytest.raises(ValueError, match="caches has 2 entries but chunks has 3"):
        rag.answer(q, chunks=keys, caches=caches[:2])
    with pytest.raises(ValueError, match="caches= needs chunks="):
        rag.answer(q, k=2, caches=caches[:2])
    with pytest.raises(ValueError, match="does not fit"):
        rag.answer(q, chunks=keys, mode="reuse", caches=[caches[1], caches[0], caches[2]])


def test_given_caches_not_computed_after_the_prefix_leave_the_first_chunk_to_the_selector(built):
    rag, _ = built
    keys = [r.key for r in rag.index.records()[:3]]
    q = "Who commands beta station?"
    caches = [rag.kvstore.load(k) for k in keys]
    wrong_first = [tuple(torch.zeros_like(t) for t in caches[0]), *caches[1:]]
    full = rag.answer(q, chunks=keys, mode="full", max_new_tokens=5)
    everything = FuseConfig(mode="cacheblend", ratio=1.0)
    # every chunk token recomputed: the first chunk's given cache is not used, the prefill is exact
    fresh_prompt = rag.prepare(q, chunks=keys, fuse_config=everything, caches=wrong_first, first_exact=False)
    fresh = fresh_prompt.generate(GenerateConfig(max_new_tokens=5))
    assert fresh.token_ids == full.token_ids
    fresh_nll = fresh_prompt.nll(full.token_ids)
    assert fresh_nll == pytest.approx(rag.nll(q, full.token_ids, keys), abs=1e-4)
    # taken as exact (the default), the first chunk keeps its given rows whatever the ratio
    kept_prompt = rag.prepare(q, chunks=keys, fuse_config=everything, caches=wrong_first)
    assert kept_prompt.nll(full.token_ids) != pytest.approx(fresh_nll, abs=1e-3)
    assert kept_prompt.fused.recompute_fraction < fresh.recompute_fraction
    boundary = [rag.answer(q, chunks=keys, mode="attnlink", max_new_tokens=1, caches=caches, first_exact=exact)
                for exact in (True, False)]
    assert boundary[1].recompute_fraction > boundary[0].recompute_fraction  # the first chunk's boundary too
    with pytest.raises(ValueError, match="first_exact=False describes caches="):
        rag.answer(q, chunks=keys, first_exact=False)


def test_rebuild_with_one_more_document_computes_only_its_chunks(built, tiny_model_dir):
    rag, path = built
    before = len(rag.index)
    extra = ("epsilon", "Epsilon is a small positive number in analysis.")
    again = KVRag.build(DOCS + [extra], path, model=str(tiny_model_dir), show_progress=False)
    stats = again.add(DOCS + [extra], show_progress=False)  # a second add changes nothing
    assert len(again.index) == before + 1
    assert stats.new_chunks == 0 and stats.prefilled_chunks == 0


def test_killed_build_resumes_without_recomputing_stored_caches(tiny_model_dir, tmp_path, monkeypatch):
    from kvrag.storage.chunk_index import ChunkIndex

    path = tmp_path / "idx"
    calls = {"n": 0}
    original = ChunkIndex.add

    def dying_add(self, records, vectors):  # the process "dies" after caches were written
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(ChunkIndex, "add", dying_add)
    with pytest.raises(KeyboardInterrupt):
        KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SPLIT, show_progress=False)
    monkeypatch.setattr(ChunkIndex, "add", original)
    rag = KVRag.open(path)
    assert len(rag.index) == 0
    stats = rag.add(DOCS, show_progress=False)
    assert stats.new_chunks > 0 and stats.prefilled_chunks == 0  # caches on disk were reused
    assert len(rag.index) == stats.new_chunks


def test_opening_with_a_different_model_names_both_fingerprints(built, other_model_dir):
    rag, path = built
    with pytest.raises(IndexMismatchError) as err:
        KVRag.open(path, model=str(other_model_dir))
    assert rag.lm.fingerprint in str(err.value)
    assert str(other_model_dir) in str(err.value)


def test_corrupt_or_missing_chunk_file_is_recomputed(built):
    rag, _ = built
    q = "Who designed the alpha reactor?"
    chunks = rag.retrieve(q, k=2)
    reference = rag.answer(q, chunks=[c.key for c in chunks], mode="reuse", max_new_tokens=4)
    target = rag.kvstore.store._path(chunks[0].key)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match=chunks[0].key):
        rag.kvstore.load(chunks[0].key)
    held = rag.answer(q, chunks=[c.key for c in chunks], mode="reuse", max_new_tokens=4)
    assert held.token_ids == reference.token_ids and not rag.kvstore.is_valid(chunks[0].key)  # the decoded tier's
    rag.kvstore.decoded.clear()  # a new process: the file is read
    repaired = rag.answer(q, chunks=[c.key for c in chunks], mode="reuse", max_new_tokens=4)
    assert repaired.token_ids == reference.token_ids
    assert rag.kvstore.is_valid(chunks[0].key)  # re-stored
    target.unlink()
    rag.kvstore.decoded.clear()
    assert rag.answer(q, chunks=[c.key for c in chunks], mode="reuse", max_new_tokens=4).token_ids == \
        reference.token_ids


@pytest.mark.parametrize("kwargs, error, match", [
    ({"question": ""}, InputError, "question is empty"),
    ({"question": "   "}, InputError, "question is empty"),
    ({"question": "q?", "k": 0}, ValueError, "k must be"),
    ({"question": "q?", "mode": "magic"}, ValueError, "unknown fusion mode 'magic'"),
    ({"question": "q?", "ratio": 0.0}, ValueError, r"ratio must be in \(0, 1\]"),
    ({"question": "q?", "ratio": 1.5}, ValueError, r"ratio must be in \(0, 1\]"),
])
def test_bad_queries_raise_clear_errors(built, kwargs, error, match):
    rag, _ = built
    with pytest.raises(error, match=match):
        rag.answer(**kwargs)


def test_k_larger_than_index_uses_every_chunk(built):
    rag, _ = built
    assert len(rag.retrieve("anything?", k=10_000)) == len(rag.index)


def test_question_longer_than_the_context_window(built):
    rag, _ = built
    with pytest.raises(InputError, match="context window"):
        rag.answer("why " * 5000, k=1, max_new_tokens=2)


def test_bad_documents(tiny_model_dir, tmp_path):
    with pytest.raises(InputError, match="no documents"):
        KVRag.build([], tmp_path / "a", model=str(tiny_model_dir), show_progress=False)
    with pytest.raises(InputError, match="no documents"):
        KVRag.build(["", "  \n\t "], tmp_path / "b", model=str(tiny_model_dir), show_progress=False)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "bad.txt").write_bytes(b"caf\xe9 \xff\xfe broken")
    (folder / "bin.txt").write_bytes(b"\x00\x01\x02 binary")
    (folder / "good.txt").write_text("A good document about rivers and seas.")
    rag = KVRag.build([folder], tmp_path / "c", model=str(tiny_model_dir), show_progress=False)
    assert {r.source for r in rag.index.records()} == {str(folder / "good.txt")}
    with pytest.raises(TypeError, match="documents must be"):
        KVRag.build([42], tmp_path / "d", model=str(tiny_model_dir), show_progress=False)


def test_a_document_ten_times_the_context_window_is_chunked(tiny_model_dir, tmp_path, tiny_lm):
    sentence = "The river carries sediment to the delta every spring. "
    n_ctx = tiny_lm.spec.max_position
    per = len(tiny_lm.tokenizer(sentence)["input_ids"])
    long_doc = sentence * (10 * n_ctx // per + 1)
    rag = KVRag.build([("long", long_doc)], tmp_path / "idx", model=tiny_lm,
                      split=SplitConfig(max_tokens=256, min_tokens=32), show_progress=False)
    records = rag.index.records()  # repeated chunks are stored once, so few distinct records
    sep = len(tiny_lm.tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    assert records and all(r.text in long_doc for r in records)
    assert all(r.n_tokens <= 256 + sep for r in records)
    assert rag.answer("Where does the sediment go?", k=2, max_new_tokens=3).chunks


def test_open_missing_index(tmp_path):
    with pytest.raises(IndexNotFoundError):
        KVRag.open(tmp_path / "nothing")


def test_chunks_indexed_without_caches_are_computed_on_first_use(tiny_model_dir, tiny_lm, tmp_path):
    path = tmp_path / "idx"
    rag = KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SPLIT, show_progress=False, caches=False,
                      codec="raw")
    keys = [r.key for r in rag.index.records()]
    assert len(keys) >= len(DOCS) and not any(rag.kvstore.contains(k) for k in keys)
    q = "Who designed the alpha reactor?"
    first = rag.answer(q, k=2, mode="reuse", max_new_tokens=3)
    used = [c.key for c in first.chunks]
    assert all(rag.kvstore.is_valid(k) for k in used)  # computed and stored on first use
    assert sum(rag.kvstore.contains(k) for k in keys) == len(used)
    eager = KVRag.build(DOCS, tmp_path / "eager", model=tiny_lm, split=SPLIT, show_progress=False, codec="raw")
    assert eager.answer(q, chunks=used, mode="reuse", max_new_tokens=3).token_ids == \
        rag.answer(q, chunks=used, mode="reuse", max_new_tokens=3).token_ids == first.token_ids
    stats = rag.add(DOCS, show_progress=False)  # the caches still missing
    assert stats.new_chunks == 0 and stats.prefilled_chunks == len(keys) - len(used)
    assert all(rag.kvstore.is_valid(k) for k in keys)


def test_the_default_codec_is_cachegen_at_level_2(tiny_lm, tmp_path):
    rag = KVRag.build(DOCS[:2], tmp_path / "idx", model=tiny_lm, split=SPLIT, show_progress=False)
    codec = json.loads((tmp_path / "idx" / "manifest.json").read_text())["codec"]
    assert (codec["name"], codec["level"]) == ("cachegen", 2) and rag.kvstore.codec.level == 2


def test_a_lazy_index_fits_its_codec_on_a_sample_and_computes_the_rest_on_first_use(tiny_lm, tmp_path):
    rag = KVRag.build(DOCS, tmp_path / "idx", model=tiny_lm, split=SPLIT, show_progress=False, caches=False,
                      codec_state="index")  # fitted here (a shared state of the model would be adopted instead)
    assert rag.kvstore.codec.name == "cachegen" and (tmp_path / "idx" / "codec" / "fitted").is_file()
    keys = [r.key for r in rag.index.records()]
    stored = {k for k in keys if rag.kvstore.contains(k)}  # the fitting sample, stored rather than wasted
    answer = rag.answer("Who designed the alpha reactor?", k=len(keys), mode="reuse", max_new_tokens=2)
    assert len(answer.chunks) == len(keys) and all(rag.kvstore.is_valid(k) for k in keys)
    reopened = KVRag.open(tmp_path / "idx", model=tiny_lm)  # the fitted state is read back
    assert reopened.answer("Who designed the alpha reactor?", k=len(keys), mode="reuse",
                           max_new_tokens=2).token_ids == answer.token_ids
    assert stored


def test_every_entry_point_defaults_to_the_same_mode():
    import importlib
    import inspect

    from kvrag.cli import build_parser
    from kvrag.config import DEFAULT_MODE, FuseConfig
    from kvrag.rag import KVRag

    assert DEFAULT_MODE == "probe" and FuseConfig().mode == DEFAULT_MODE
    entry_points = (KVRag.answer, KVRag.stream, KVRag.prepare, KVRag.answer_prompt, KVRag.stream_prompt,
                    KVRag.prepare_prompt)
    for fn in entry_points:  # None: the default mode, under the gate
        assert inspect.signature(fn).parameters["mode"].default is None, fn.__qualname__
        assert inspect.signature(fn).parameters["gate"].default is None, fn.__qualname__
    assert build_parser().parse_args(["ask", "./idx", "q?"]).mode is None  # as KVRag.answer: the default mode, gated
    for name in ("langchain", "llama_index"):
        module = importlib.import_module(f"kvrag.integrations.{name}")
        fields = module.KVCachedLLM.model_fields
        assert fields["mode"].default is None and fields["ratio"].default is None, name
        assert fields["gate"].default is None, name


def test_question_tail_follows_the_question_and_leaves_the_prefix_alone(tiny_lm):
    from kvrag.prompt import build_layout, suffix_text

    plain = build_layout(tiny_lm.tokenizer)
    tailed = build_layout(tiny_lm.tokenizer, question_tail="Answer in one word.")
    assert tailed.prefix_ids == plain.prefix_ids  # the chunk caches do not depend on the tail
    assert "Who?\nAnswer in one word." in suffix_text(tailed, "Who?")
    assert "Answer in one word." not in suffix_text(plain, "Who?") and plain.question_tail == ""
    assert tailed.digest() != plain.digest()


def test_index_keeps_its_question_tail_and_older_indexes_have_none(built, tiny_lm, tmp_path, caplog):
    _, path = built
    assert KVRag.open(path, model=tiny_lm).layout.question_tail == ""
    custom = KVRag.build(DOCS[:1], tmp_path / "custom", model=tiny_lm, split=SPLIT, question_tail=" Be brief. ",
                         show_progress=False, caches=False)
    assert KVRag.open(custom.path, model=tiny_lm).layout.question_tail == "Be brief."
    with caplog.at_level("WARNING", logger="kvrag.rag"):
        KVRag.build(DOCS[1:2], custom.path, model=tiny_lm, question_tail="Other.", show_progress=False, caches=False)
    assert "keeps the prompt it was built with" in caplog.text
    assert KVRag.open(custom.path, model=tiny_lm).layout.question_tail == "Be brief."
    older = KVRag.build(DOCS[:1], tmp_path / "older", model=tiny_lm, split=SPLIT, question_tail="",
                        show_progress=False, caches=False)
    manifest_path = older.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["prompt"]["question_tail"]  # as written before the setting existed
    write_manifest(manifest_path, manifest)
    assert KVRag.open(older.path, model=tiny_lm).layout.question_tail == ""
