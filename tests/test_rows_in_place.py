"""Passage rows read in place (`kvrag.passages.keys`, the gate's ``stored`` plan): rows a prompt's pass computed are
keyed by the tokens before them, so a prompt with those same tokens before the passage reads them with nothing but
its text recomputed, and gets the full prefill's answer. Elsewhere they are read through a link, only after the
passage they followed; a link never reaches another context's rows. The tiny random Llama stands in for a user's
model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrag.passages import PassageCache
from kvrag.passages.keys import PassageKeys
from kvrag.query.locate import chat_prompt
from tests.test_passage_cache import PASSAGES, _prompt


def _ask(cache: PassageCache, question: str, order: list[str] = PASSAGES, **options):
    prompt = chat_prompt(cache.lm.tokenizer, _prompt(question, order))
    return cache.answer_prompt(prompt, passages=order, max_new_tokens=options.pop("max_new_tokens", 6), **options)


def test_the_same_prompt_from_the_store_reads_every_passage_in_place_and_answers_as_a_full_prefill(
        raw_cache: PassageCache):
    question = "When was the gamma bridge finished?"
    full = _ask(raw_cache, question, mode="full")
    _ask(raw_cache, question, max_new_tokens=1)  # first sight: a prefill, its rows stored after the answer
    assert raw_cache.flush(60)
    raw_cache.heads.clear_prompts()  # as in a new process: nothing kept in memory but the template's head
    raw_cache.kvstore.decoded.clear()
    again = _ask(raw_cache, question)
    assert again.gate is not None and again.gate.decision == "stored"
    assert [c.text for c in again.chunks] == PASSAGES and all(c.in_place for c in again.chunks)
    assert again.token_ids == full.token_ids
    assert [a["mode"] for a in again.gate.attempts] == ["reuse"]  # one pass over the text, no check to escalate
    in_passages = sum(len(c.ids or ()) for c in again.chunks)
    assert again.recompute_fraction <= 1 - in_passages / again.n_prompt_tokens + 1e-6  # no passage row recomputed


def test_another_question_before_the_passages_reads_them_after_their_neighbours_not_in_place(raw_cache: PassageCache):
    _ask(raw_cache, "Who designed the alpha reactor?", max_new_tokens=1)
    assert raw_cache.flush(60)
    raw_cache.heads.clear_prompts()
    other = _ask(raw_cache, "Where was the beta telescope built?", mode="probe")  # the tutorial puts it first
    assert [c.text for c in other.chunks] == PASSAGES  # through the links: first, then after the same passage
    assert not any(c.in_place for c in other.chunks)  # their rows were computed after another question
    default = _ask(raw_cache, "Where was the beta telescope built?")
    assert default.gate is not None and default.gate.decision != "stored"


def test_a_blob_gone_after_the_lookup_is_answered_by_a_full_prefill(raw_cache: PassageCache):
    question = "Who designed the alpha reactor?"
    full = _ask(raw_cache, question, mode="full")
    _ask(raw_cache, question, max_new_tokens=1)
    assert raw_cache.flush(60)
    raw_cache.heads.clear_prompts()
    raw_cache.kvstore.decoded.clear()
    lookup = raw_cache._lookup

    def lookup_then_evict(prompt, texts):
        found, missing = lookup(prompt, texts)
        raw_cache.store.delete(found[1].key)  # another process evicts it between the lookup and the read
        return found, missing

    raw_cache._lookup = lookup_then_evict  # type: ignore[method-assign]
    again = _ask(raw_cache, question)
    assert raw_cache.recovered == 1  # read as a cache computed alone: no longer in place
    assert again.gate is not None and again.gate.decision != "stored"
    assert again.token_ids == full.token_ids


def test_a_link_reaches_only_the_blob_it_names_while_it_is_stored(raw_cache: PassageCache):
    keys: PassageKeys = raw_cache.keys
    keys.digest = keys.digest or "none"
    ids, before = [5, 6, 7], [1, 2]
    in_place = keys.key(ids, context="c" * 40)
    assert in_place is not None and in_place not in {keys.key(ids), keys.key(ids, before)}
    keys.link(ids, before, in_place)
    assert keys.stored(ids, before) is None  # the blob it names is not stored
    raw_cache.kvstore.store.put(in_place, b"blob")
    assert keys.stored(ids, before) == in_place and keys.stored(ids) is None
    assert keys.stored(ids, context="d" * 40) is None  # in-place keys are never reached through a link
    raw_cache.kvstore.store.delete(in_place)  # evicted: the dangling link is a miss, and the next link replaces it
    other = keys.key(ids, context="e" * 40)
    assert other is not None
    raw_cache.kvstore.store.put(other, b"blob")
    keys.link(ids, before, other)
    assert keys.stored(ids, before) == other


def test_passage_caches_default_to_int8_and_the_url_names_another_codec(tiny_lm, tmp_path: Path):
    with PassageCache.open(tiny_lm, f"file://{tmp_path}/a?max_bytes=50MB") as default:
        assert default.kvstore.codec.name == "int8"
    with PassageCache.open(tiny_lm, f"file://{tmp_path}/b?max_bytes=50MB&codec=cachegen") as chosen:
        assert chosen.kvstore.codec.name == "cachegen" and chosen.keys.digest is None  # fitted on the first passages
    with PassageCache.open(tiny_lm, f"file://{tmp_path}/c?codec=cachegen", codec="raw") as given:
        assert given.kvstore.codec.name == "raw"  # the argument wins over the URL
    with pytest.raises(ValueError, match="codec must be one of"):
        PassageCache.open(tiny_lm, f"file://{tmp_path}/d?codec=zip")


def test_rows_of_a_fused_pass_are_read_after_their_neighbour_never_in_place(raw_cache: PassageCache):
    question = "Who designed the alpha reactor?"
    _ask(raw_cache, question, max_new_tokens=1)  # a full prefill: each passage's rows stored in place
    assert raw_cache.flush(60)
    moved = [PASSAGES[0], PASSAGES[2], PASSAGES[1]]
    fused = _ask(raw_cache, question, moved, mode="probe", max_new_tokens=1)  # reads the first, recomputes the rest
    assert [c.text for c in fused.chunks] == PASSAGES[:1]
    assert raw_cache.flush(60)  # the others' rows in this pass attended to a stored cache: not a full prefill's
    raw_cache.heads.clear_prompts()
    again = _ask(raw_cache, question, moved)
    assert [c.text for c in again.chunks] == moved
    assert [c.in_place for c in again.chunks] == [True, False, False]
    assert again.gate is not None and again.gate.decision != "stored"
