"""Passage rows read in place (`kvrag.passages.keys`, the gate's ``stored`` plan): rows a prompt's pass computed are
keyed by the tokens before them, so a prompt with those same tokens before the passage reads them with nothing but
its text recomputed, and gets the full prefill's answer. Elsewhere they are read through a link, only after the
passage they followed; a link never reaches another context's rows. A passage read from another context (warmed, or
through a link) in a prompt answered from exact rows gets its in-place entry from that answer; a fused pass stores
none, but a run of passages fused a second time is prefilled after the answer and read in place from then on. The
tiny random Llama stands in for a user's model.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from kvrag.codec import make_codec
from kvrag.model.rope import layer_ropes, rotate_layers
from kvrag.passages import PassageCache, open_cache_store
from kvrag.passages.exact_pass import prompt_pass
from kvrag.passages.keys import PassageKeys
from kvrag.passages.pending import FoundPassage
from kvrag.passages.prompt_rows import find_run
from kvrag.query.locate import chat_prompt, encode
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import BoundedRedisStore
from tests.test_passage_cache import PASSAGES, _prompt
from tests.test_prompt_rows import _full_rows


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

    def lookup_then_evict(prompt, texts, anywhere=False):
        found, missing, reached = lookup(prompt, texts, anywhere)
        raw_cache.store.delete(found[1].key)  # another process evicts it between the lookup and the read
        return found, missing, reached

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
    assert keys.stored(ids, seen=True) == in_place  # found wherever the passage stands, by a fusing answer
    assert keys.stored(ids, context="d" * 40) is None  # in-place keys are never reached through a link
    raw_cache.kvstore.store.delete(in_place)  # evicted: the dangling link is a miss, and the next link replaces it
    assert keys.stored(ids, seen=True) is None
    other = keys.key(ids, context="e" * 40)
    assert other is not None
    raw_cache.kvstore.store.put(other, b"blob")
    keys.link(ids, before, other)
    assert keys.stored(ids, before) == other == keys.stored(ids, seen=True)
    first = keys.key([8, 9], context="f" * 40)  # a prompt's first passage: its plain key is the link, no seen one
    assert first is not None
    raw_cache.kvstore.store.put(first, b"blob")
    keys.link([8, 9], (), first)
    assert keys.stored([8, 9]) == first and keys.stored([8, 9], seen=True) is None




def test_passages_stored_after_an_answer_wait_on_probation_until_a_prompt_asks_for_them(raw_cache: PassageCache):
    question = "Who designed the alpha reactor?"
    _ask(raw_cache, question, max_new_tokens=1)
    assert raw_cache.flush(60)
    assert len(raw_cache.kvstore.decoded) > 0  # read back and held decoded in memory, for the next prompt
    assert raw_cache.store.protected.keys() == set()  # yet not counted as asked for again
    raw_cache.heads.clear_prompts()
    again = _ask(raw_cache, question)
    assert again.chunks and raw_cache.store.protected.keys() >= {c.key for c in again.chunks}

def test_a_passage_in_use_keeps_every_link_to_its_rows_under_a_byte_bound(tiny_lm, tmp_path: Path):
    """Read after the same passage each time, a passage's seen link is never opened; without `keep` it ages on
    probation and is evicted while its blob, read each time, is protected: the passage is then lost to any prompt
    that places it after another passage.
    """
    store_url = f"file://{tmp_path}/c?max_bytes=100kB"
    with PassageCache(tiny_lm, open_cache_store(store_url), codec=make_codec("raw")) as cache:
        keys, store = cache.keys, cache.store
        keys.digest = keys.digest or "none"
        kept, aged = ((5, 6, 7), (1, 2)), ((8, 9), (3, 4))
        blobs = {}
        for ids, before in (kept, aged):
            blobs[ids] = keys.key(ids, context=str(ids[0]) * 40)
            store.put(blobs[ids], b"r" * 5_000)
            keys.link(ids, before, blobs[ids])
        for i in range(60):  # a stream of other passages, each stored once and never read again
            store.put(f"{i:040x}", b"o" * 5_000)
            for ids, before in (kept, aged):
                assert keys.stored(ids, before) == blobs[ids]  # found after the same passage, as before
                cache.kvstore.touch(blobs[ids])  # and read (fusion opens it, or the decoded tier touches it)
            keys.keep([FoundPassage(kept[0], kept[1], blobs[kept[0]], prompt_rows=True)])
        assert store.contains(blobs[kept[0]]) and store.contains(blobs[aged[0]])  # both blobs still held
        assert keys.stored(kept[0], seen=True) == blobs[kept[0]]  # found wherever it stands, by a fusing answer
        assert keys.stored(aged[0], seen=True) is None  # its seen link was evicted under the blob it names


def test_keep_points_a_dangling_seen_key_at_rows_a_prompt_computed_not_at_a_plain_cache(raw_cache: PassageCache):
    keys, store = raw_cache.keys, raw_cache.store
    keys.digest = keys.digest or "none"
    ids, before = (5, 6, 7), (1, 2)
    in_place = keys.key(ids, context="c" * 40)
    plain = keys.key((8, 9))
    assert in_place is not None and plain is not None
    for key in (in_place, plain):
        store.put(key, b"blob")
    assert keys.stored(ids, seen=True) is None and keys.stored((8, 9), seen=True) is None  # never linked
    keys.keep([FoundPassage(ids, before, in_place, prompt_rows=True), FoundPassage((8, 9), (1, 2), plain, False)])
    assert keys.stored(ids, seen=True) == in_place  # rows computed in a prompt: what a seen key describes
    assert keys.stored((8, 9), seen=True) is None  # a cache computed alone is read through its plain key


def test_keeping_links_after_an_answer_skips_a_store_that_cannot_be_reached():
    with socket.socket() as sock:  # a port nothing listens on: the connection is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = BoundedRedisStore(f"redis://127.0.0.1:{port}/0", max_bytes=10**6)
    keys = PassageKeys(store, KVStore(store, make_codec("raw"), "model"), "model", [1], "none")
    keys.keep([FoundPassage((5, 6), (1, 2), "a" * 40, prompt_rows=True)])  # the answer stands; nothing raises

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
    _ask(raw_cache, question, PASSAGES[:2], max_new_tokens=1)  # a full prefill: these passages' rows stored in place
    assert raw_cache.flush(60)
    moved = [PASSAGES[0], PASSAGES[2], PASSAGES[1]]
    fused = _ask(raw_cache, question, moved, mode="probe", max_new_tokens=1)  # the new passage recomputed
    assert [c.text for c in fused.chunks] == [PASSAGES[0], PASSAGES[1]]
    assert raw_cache.flush(60)  # the new one's rows in this pass attended to stored caches: not a full prefill's
    raw_cache.heads.clear_prompts()
    again = _ask(raw_cache, question, moved)  # the default gate: no rows computed after other text but after the same
    assert [c.text for c in again.chunks] == moved[:2]
    assert [c.in_place for c in again.chunks] == [True, False]
    assert again.gate is not None and again.gate.decision != "stored"


def _assert_rows_are_the_full_prefills(cache: PassageCache, question: str) -> None:
    """Every passage's stored in-place rows, placed back, equal a full prefill's rows of the prompt there."""
    lm = cache.lm
    prompt = chat_prompt(lm.tokenizer, _prompt(question))
    found, missing, _ = cache._lookup(prompt, PASSAGES)
    assert not missing and [c.in_place for c in found] == [True] * len(PASSAGES)
    ids = encode(lm.tokenizer, prompt)
    rows = _full_rows(lm, ids)
    for chunk in found:
        start, n = find_run(ids, chunk.ids), len(chunk.ids or ())
        assert start is not None
        keys, values = cache.kvstore.load(chunk.key)
        placed = rotate_layers(keys, layer_ropes(lm.model, lm.family, torch.arange(start, start + n), keys))
        torch.testing.assert_close(placed, torch.stack([k[0, :, start:start + n] for k, _ in rows]),
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(values, torch.stack([v[0, :, start:start + n] for _, v in rows]),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("earlier", ["warmed", "one warmed", "another question"])
def test_passages_found_elsewhere_in_a_prompt_answered_exactly_are_read_in_place_when_it_comes_back(
        raw_cache: PassageCache, earlier: str):
    question = "Where was the beta telescope built?"
    full = _ask(raw_cache, question, mode="full")
    if earlier == "another question":  # rows after another question: found through the links, never in place
        _ask(raw_cache, "Who designed the alpha reactor?", max_new_tokens=1)
    else:
        raw_cache.warm(PASSAGES if earlier == "warmed" else PASSAGES[1:2], show_progress=False)
    assert raw_cache.flush(60)
    raw_cache.heads.clear_prompts()
    first = _ask(raw_cache, question)  # the caches found were computed elsewhere: a short prompt, prefilled in full
    assert first.gate is not None and first.gate.decision == "short" and first.chunks
    assert not any(c.in_place for c in first.chunks) and first.token_ids == full.token_ids
    assert raw_cache.flush(60)  # that full prefill's rows of every passage, stored in place
    raw_cache.heads.clear_prompts()  # as in a new process
    raw_cache.kvstore.decoded.clear()
    again = _ask(raw_cache, question)
    assert again.gate is not None and again.gate.decision == "stored"
    assert [c.text for c in again.chunks] == PASSAGES and all(c.in_place for c in again.chunks)
    assert again.token_ids == full.token_ids == _ask(raw_cache, question, mode="full").token_ids
    _assert_rows_are_the_full_prefills(raw_cache, question)


def test_a_fused_pass_or_a_full_one_stores_no_rows_in_place_for_passages_found_elsewhere(raw_cache: PassageCache):
    question = "Where was the beta telescope built?"
    assert raw_cache.warm(PASSAGES, show_progress=False) == 3
    stored = raw_cache.stats.stored
    fused = _ask(raw_cache, question, mode="probe", max_new_tokens=1)  # the warmed caches fused: no exact rows
    full = _ask(raw_cache, question, mode="full", max_new_tokens=1)  # nothing looked up, nothing stored
    assert [c.text for c in fused.chunks] == PASSAGES and full.chunks == []
    assert raw_cache.flush(60) and raw_cache.stats.stored == stored
    raw_cache.heads.clear_prompts()
    found, missing, _ = raw_cache._lookup(chat_prompt(raw_cache.lm.tokenizer, _prompt(question)), PASSAGES)
    assert [c.text for c in found] == PASSAGES and not any(c.in_place for c in found)
    assert all(m.elsewhere for m in missing)  # to be stored in place only from an exact answer


def test_a_run_of_passages_fused_twice_is_prefilled_after_the_answer_and_read_in_place_next(raw_cache: PassageCache):
    question = "Where was the beta telescope built?"
    full = _ask(raw_cache, question, mode="full")
    assert raw_cache.warm(PASSAGES, show_progress=False) == 3  # stored alone: found, never in place
    for seen in (1, 2):
        fused = _ask(raw_cache, question, mode="probe", max_new_tokens=1)
        assert [c.text for c in fused.chunks] == PASSAGES and not any(c.in_place for c in fused.chunks)
        assert raw_cache.flush(60)
        assert raw_cache.exact_passes.passes == seen - 1  # the second answer over the same run pays for one
    assert raw_cache.info()["exact_passes"] == 1
    raw_cache.heads.clear_prompts()  # as in a new process
    raw_cache.kvstore.decoded.clear()
    again = _ask(raw_cache, question)
    assert again.gate is not None and again.gate.decision == "stored"
    assert all(c.in_place for c in again.chunks) and again.token_ids == full.token_ids
    _assert_rows_are_the_full_prefills(raw_cache, question)
    _ask(raw_cache, question, mode="probe", max_new_tokens=1)  # read in place now: nothing left to prefill
    assert raw_cache.flush(60) and raw_cache.exact_passes.passes == 1


def test_a_prompt_pass_in_slices_gives_a_whole_prefills_rows(raw_cache: PassageCache):
    lm = raw_cache.lm
    ids = encode(lm.tokenizer, chat_prompt(lm.tokenizer, _prompt("Who designed the alpha reactor?")))
    lock = threading.RLock()
    whole, sliced = prompt_pass(lm, ids, lock, len(ids)), prompt_pass(lm, ids, lock, 7)
    assert whole[0] == sliced[0] == ids
    for (k1, v1), (k2, v2), (k3, v3) in zip(whole[1], sliced[1], _full_rows(lm, ids)):
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(k1[:, :, :len(ids)], k3[:, :, :len(ids)], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v1[:, :, :len(ids)], v3[:, :, :len(ids)], atol=1e-5, rtol=1e-4)
