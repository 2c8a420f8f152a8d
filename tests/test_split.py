"""KVSplit: budget, losslessness, paragraph/semantic boundaries, both Punkt paths, errors, speed."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import time

import nltk
import numpy as np
import pytest
from _tokenizer import make_metaspace_tokenizer, make_tokenizer
from conftest import DATA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.config import SplitConfig
from kvrag.errors import InputError
from kvrag.indexing import split as split_mod
from kvrag.indexing.split import Chunk, KVSplitter

NLTK_DATA = DATA / "nltk_data"
CORPUS = DATA / "corpus" / "2wikimultihopqa_corpus.json"
TOKENIZERS = [make_tokenizer, make_metaspace_tokenizer]

PARAGRAPHS = [
    (
        "The index stores one entry per chunk. Each entry holds the chunk's text, its embedding and "
        "the key of its compressed cache on disk. Dr. Smith designed the format in 2021, e.g. for "
        "laptops with slow disks."
    ),
    (
        "Queries arrive one at a time. The retriever embeds the question, searches the index and "
        "returns the ids of the best chunks. Their caches are loaded layer by layer while the model "
        "recomputes a few tokens!"
    ),
    (
        "Was the answer correct? A second model grades it against the gold answer. The scores are "
        "averaged over the data set, and the report lists the speed-up at every context length."
    ),
    (
        "Naïve caching fails when chunks move: their positions change, so the rotary embedding must be "
        "applied again. Storing the keys before rotation makes this exact — no approximation at all."
    ),
]
DOC = "\n\n".join(PARAGRAPHS) + "\n"


def tokens(text: str, tokenizer=None) -> int:
    tokenizer = tokenizer or make_tokenizer()
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def assert_valid(chunks: list[Chunk], text: str, max_tokens: int, tokenizer=None) -> None:
    """The module contract: exact contiguous slices, nothing lost, every chunk within budget."""
    if not text.strip():
        assert chunks == []
        return
    assert "".join(c.text for c in chunks) == text
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for a, b in itertools.pairwise(chunks):
        assert a.end == b.start
    for c in chunks:
        assert c.text and c.text == text[c.start : c.end]
        assert c.n_tokens == tokens(c.text, tokenizer) <= max_tokens


@pytest.fixture
def no_pretrained_punkt(monkeypatch, tmp_path):
    """NLTK sees only an empty data directory, so Punkt must be trained on the documents."""
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    assert split_mod.load_pretrained_punkt() is None


@pytest.fixture
def pretrained_punkt(monkeypatch):
    monkeypatch.setattr(nltk.data, "path", [str(NLTK_DATA)])
    assert split_mod.load_pretrained_punkt() is not None


@pytest.fixture
def train_calls(monkeypatch) -> list[list[str]]:
    """Records the documents of every Punkt training run."""
    calls: list[list[str]] = []
    real = split_mod.train_punkt

    def spy(texts):
        calls.append(list(texts))
        return real(texts)

    monkeypatch.setattr(split_mod, "train_punkt", spy)
    return calls


def splitter(mode="semantic", max_tokens=64, min_tokens=16, embed=None, tokenizer=None):
    config = SplitConfig(mode=mode, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
    return KVSplitter(tokenizer or make_tokenizer(), config, embed=embed)


@pytest.fixture(scope="module")
def corpus_text() -> str:
    """~200 KB of real Wikipedia passages (title line, then text), separated by blank lines."""
    passages = json.loads(CORPUS.read_text(encoding="utf-8"))
    return "\n\n".join(f"{p['title']}\n{p['text']}" for p in passages[:700])[:200_000]


# -- the contract on real-looking text ---------------------------------------------------------


@pytest.mark.parametrize("make", TOKENIZERS)
@pytest.mark.parametrize("mode", ["semantic", "fixed", "document"])
@pytest.mark.parametrize("max_tokens,min_tokens", [(8, 0), (32, 8), (64, 16), (256, 64), (4096, 0)])
def test_contract_on_prose(make, mode, max_tokens, min_tokens):
    tok = make()
    for text in (DOC, "  \n" + DOC + "\n\n  ", DOC.replace("\n\n", "\r\n\r\n"), PARAGRAPHS[0]):
        chunks = splitter(mode, max_tokens, min_tokens, tokenizer=tok).split(text)
        assert_valid(chunks, text, max_tokens, tok)


@pytest.mark.parametrize("make", TOKENIZERS)
@pytest.mark.parametrize("mode", ["semantic", "fixed"])
def test_contract_on_real_corpus(corpus_text, make, mode):
    text, tok = corpus_text[:40_000], make()
    assert_valid(splitter(mode, 96, 24, tokenizer=tok).split(text), text, 96, tok)


@pytest.mark.parametrize("mode", ["semantic", "fixed", "document"])
@pytest.mark.parametrize("text", ["", " ", "\n\n\t \r\n"])
def test_empty_and_whitespace_only_give_no_chunks(mode, text):
    assert splitter(mode).split(text) == []
    assert splitter(mode).split_many([text, "Hello."])[0] == []


def test_chunk_is_frozen():
    chunk = splitter().split("Hello there.")[0]
    assert chunk == Chunk("Hello there.", 0, 12, tokens("Hello there."))
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.start = 1  # type: ignore[misc]


# -- properties --------------------------------------------------------------------------------

WORDS = ["the", "cache", "Dr.", "Smith", "naïve", "日本語", "🎉", "e.g.", "5", "p.m.", "A", "—", "x" * 40]
SENTENCE = st.builds(
    lambda words, end: " ".join(words) + end,
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
    st.sampled_from([".", "!", "?", "", "...", ".)"]),
)
SEPARATOR = st.sampled_from([" ", "  ", "\n", "\n\n", " \n \n ", "\t", "\r\n\r\n", ""])
PROSE = st.builds(
    lambda lead, parts: lead + "".join(s + sep for s, sep in parts),
    st.sampled_from(["", " ", "\n\n"]),
    st.lists(st.tuples(SENTENCE, SEPARATOR), max_size=25),
)
CONFIGS = st.builds(
    lambda mode, max_tokens, frac: SplitConfig(mode, max_tokens, int(frac * max_tokens)),
    st.sampled_from(["semantic", "fixed", "document"]),
    st.integers(8, 80),
    st.floats(0, 1),
)
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hashed_embed(sentences: list[str]) -> np.ndarray:
    """A deterministic fake embedder: one random unit vector per sentence text."""
    rows = []
    for s in sentences:
        seed = int.from_bytes(hashlib.sha256(s.encode()).digest()[:4], "little")
        rows.append(np.random.default_rng(seed).standard_normal(8))
    emb = np.asarray(rows, dtype=np.float32)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)


@PROPERTY
@given(text=PROSE, config=CONFIGS, use_embed=st.booleans(), make=st.sampled_from(TOKENIZERS))
def test_property_prose(text, config, use_embed, make):
    embed = hashed_embed if use_embed else None
    chunks = KVSplitter(make(), config, embed=embed).split(text)
    assert_valid(chunks, text, config.max_tokens, make())


@PROPERTY
@given(text=st.text(max_size=300), config=CONFIGS, make=st.sampled_from(TOKENIZERS))
def test_property_any_unicode(text, config, make):
    assert_valid(KVSplitter(make(), config).split(text), text, config.max_tokens, make())


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(PROSE, max_size=4), config=CONFIGS)
def test_property_split_many(texts, config):
    results = KVSplitter(make_tokenizer(), config).split_many(texts)
    assert len(results) == len(texts)
    for chunks, text in zip(results, texts, strict=True):
        assert_valid(chunks, text, config.max_tokens)


# -- semantic boundaries -----------------------------------------------------------------------


def test_paragraph_breaks_are_preferred():
    sizes = [tokens(p) for p in PARAGRAPHS]
    max_tokens = 2 * max(sizes) - 1  # each paragraph fits, no two together do
    assert sum(sizes) > max_tokens
    chunks = splitter("semantic", max_tokens, min(sizes) // 2).split(DOC)
    assert_valid(chunks, DOC, max_tokens)
    assert [c.text.strip() for c in chunks] == PARAGRAPHS


def test_small_paragraphs_are_grouped_up_to_min_tokens():
    text = "\n\n".join(["One short line."] * 12)
    line = tokens("One short line.\n\n")
    chunks = splitter("semantic", max_tokens=20 * line, min_tokens=3 * line).split(text)
    assert_valid(chunks, text, 20 * line)
    assert all(c.text.count("One") == 3 for c in chunks[:-1])  # closed at the first break >= min
    assert all(c.text.endswith("\n\n") for c in chunks[:-1])


def topic_embed(sentences: list[str]) -> np.ndarray:
    """Two orthogonal topics, with a little per-sentence variation."""
    rows = [[float("cache" in s), i % 3 / 10, float("cache" not in s)] for i, s in enumerate(sentences)]
    emb = np.asarray(rows, dtype=np.float32)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)


def test_semantic_shift_closes_a_chunk():
    cache = ["The cache is stored on disk.", "Each cache has a key.", "A cache is loaded fast."]
    cats = ["Cats sleep a lot.", "My cat likes fish.", "Cats chase mice at night."]
    text = " ".join(cache + cats)
    without = splitter("semantic", 1000, 5).split(text)
    assert len(without) == 1
    shifted = splitter("semantic", 1000, 5, embed=topic_embed).split(text)
    assert_valid(shifted, text, 1000)
    assert [c.text.strip() for c in shifted] == [" ".join(cache), " ".join(cats)]


def test_semantic_shift_waits_for_min_tokens():
    text = "The cache is here. Cats sleep. Cats eat. Cats play. Cats run. Cats nap."
    chunks = splitter("semantic", 1000, tokens(text), embed=topic_embed).split(text)
    assert [c.text for c in chunks] == [text]


def test_embedder_output_is_left_untouched():
    emb = np.asarray([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0], [4.0, 0.0]], dtype=np.float32)
    before, calls = emb.copy(), []

    def embed(sentences):
        calls.append(sentences)
        return emb

    splitter("semantic", 1000, 0, embed=embed).split("One. Two. Three. Four.")
    assert calls == [["One.", "Two.", "Three.", "Four."]]
    np.testing.assert_array_equal(emb, before)


def test_embedder_with_wrong_shape_is_rejected():
    def bad(sentences):
        return np.ones((len(sentences) + 1, 4), dtype=np.float32)

    with pytest.raises(ValueError, match="embed"):
        splitter("semantic", 1000, 0, embed=bad).split("One. Two. Three. Four.")


def test_long_sentence_is_cut_by_tokens():
    long = " ".join(["retrieval augmented generation with cached keys"] * 30) + "."
    text = f"Short start. {long} Short end."
    chunks = splitter("semantic", 24, 4).split(text)
    assert_valid(chunks, text, 24)
    assert len(chunks) >= tokens(long) // 24
    assert chunks[0].text == "Short start. "  # closed before the long sentence
    assert chunks[-1].text.endswith("Short end.")


# -- document mode -------------------------------------------------------------------------------


def test_document_mode_keeps_short_documents_whole(train_calls, no_pretrained_punkt):
    budget = tokens(PARAGRAPHS[0])
    long = DOC * 2
    results = splitter("document", budget, 8).split_many([PARAGRAPHS[0], "  ", long])
    assert results[0] == [Chunk(PARAGRAPHS[0], 0, len(PARAGRAPHS[0]), budget)]
    assert results[1] == []
    assert len(results[2]) > 1
    assert_valid(results[2], long, budget)
    assert train_calls == [[long]]  # Punkt only sees the documents it has to split


# -- fixed mode --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", TOKENIZERS)
def test_fixed_mode_fills_the_budget(make):
    tok = make()
    chunks = splitter("fixed", 50, tokenizer=tok).split(DOC)
    assert_valid(chunks, DOC, 50, tok)
    assert len(chunks) <= -(-tokens(DOC, tok) // 50) + 1  # a cut backs off only a token or two
    assert all(c.n_tokens >= 47 for c in chunks[:-1])


def test_fixed_mode_never_splits_a_character():
    text = "🎉" * 40 + " done"
    chunks = splitter("fixed", 6).split(text)
    assert_valid(chunks, text, 6)


def test_character_over_budget_is_an_input_error():
    rare = "\U0001d518"  # MATHEMATICAL FRAKTUR CAPITAL U: four byte tokens, never merged
    assert tokens(rare) > 2
    for mode in ("fixed", "semantic"):
        with pytest.raises(InputError, match="max_tokens"):
            splitter(mode, 2, 0).split("ab " + rare + " cd")


def test_group_over_budget_sheds_trailing_sentences():
    """Unit counts are estimates (BPE merges across sentences); the exact re-count decides."""
    starts = [0] + [m.end() for m in re.finditer(r"[.!?] ", PARAGRAPHS[1])]
    bounds = [*starts, len(PARAGRAPHS[1])]
    group = [split_mod._Unit(a, b, 1, False) for a, b in itertools.pairwise(bounds)]
    chunks = splitter("semantic", 40, 0)._fit(PARAGRAPHS[1], group)
    assert len(chunks) > 1
    assert_valid(chunks, PARAGRAPHS[1], 40)
    assert {c.start for c in chunks} <= set(starts)  # still cut at sentence starts


# -- Punkt: pretrained and trained -------------------------------------------------------------


ABBREV = "Dr. Smith arrived at 5 p.m. on Monday. He left on Tuesday. The end came soon."


def test_pretrained_punkt_is_used_when_present(pretrained_punkt, train_calls):
    punkt = split_mod.load_pretrained_punkt()
    sentences = split_mod._sentence_spans(ABBREV, punkt)
    assert [ABBREV[a:b] for a, b, _ in sentences] == [
        "Dr. Smith arrived at 5 p.m. on Monday.",
        "He left on Tuesday.",
        "The end came soon.",
    ]
    assert_valid(splitter("semantic", 32, 8).split(DOC), DOC, 32)
    assert train_calls == []


def test_punkt_is_trained_once_on_all_documents(no_pretrained_punkt, train_calls):
    texts = [DOC, "   ", PARAGRAPHS[1]]
    results = splitter("semantic", 32, 8).split_many(texts)
    assert train_calls == [[DOC, PARAGRAPHS[1]]]
    for chunks, text in zip(results, texts, strict=True):
        assert_valid(chunks, text, 32)


def test_fixed_mode_needs_no_punkt(no_pretrained_punkt, train_calls):
    assert_valid(splitter("fixed", 32).split(DOC), DOC, 32)
    assert train_calls == []


def test_paragraph_breaks_end_sentences_even_without_punctuation():
    punkt = split_mod.train_punkt([DOC])
    text = "A heading\n\nBody text follows here. And more."
    sentences = split_mod._sentence_spans(text, punkt)
    assert text[sentences[0][0] : sentences[0][1]] == "A heading"
    assert [para for _, _, para in sentences] == [True, False, False]


# -- errors and speed --------------------------------------------------------------------------


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="text must be str, got bytes"):
        splitter().split(b"hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="texts must be a sequence of str"):
        splitter().split_many("hello")
    with pytest.raises(TypeError, match=r"texts\[1\] must be str, got int"):
        splitter().split_many(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="tokenizer"):
        KVSplitter(object())
    with pytest.raises(TypeError, match="config"):
        KVSplitter(make_tokenizer(), {"max_tokens": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="embed"):
        KVSplitter(make_tokenizer(), embed="not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["semantic", "fixed"])
def test_200kb_document_is_fast(corpus_text, mode, no_pretrained_punkt):
    assert len(corpus_text) == 200_000
    t0 = time.perf_counter()
    chunks = splitter(mode, 256, 64).split(corpus_text)
    elapsed = time.perf_counter() - t0
    assert "".join(c.text for c in chunks) == corpus_text
    assert max(c.n_tokens for c in chunks) <= 256
    assert elapsed < 5.0, f"{mode} split of 200 KB took {elapsed:.2f} s"
