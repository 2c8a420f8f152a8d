"""Passage caches taken from the prompt that first held them (`kvrag.passages.prompt_rows`): each passage's rows in
the pass that answered are stored, pre-RoPE, as its cache, so it carries the passages before it as context. Placed
back where they stood, they are that pass's rows exactly; a passage the pass did not compute as a run is prefilled
alone. The tiny random Llama stands in for a user's model.
"""

from __future__ import annotations

import torch

from kvrag.model import hf_compat
from kvrag.model.rope import layer_ropes, rotate_layers
from kvrag.passages import PassageCache
from kvrag.passages.lookup import look_up
from kvrag.passages.prompt_rows import context_digest, find_run, rows_in_prompt
from kvrag.query.locate import chat_prompt, encode
from tests.test_passage_cache import PASSAGES, _prompt


def _full_rows(lm, ids: list[int]):
    with torch.no_grad():
        out = lm.model(torch.tensor([ids]), use_cache=True)
    return hf_compat.cache_layers(out.past_key_values)


def test_find_run_finds_the_first_occurrence_or_none():
    assert find_run([5, 1, 2, 3, 1, 2], [1, 2]) == 1
    assert find_run([5, 1, 2, 3, 1, 2], [1, 2], start=2) == 4
    assert find_run([5, 1, 2], [2, 5]) is None and find_run([5, 1], []) is None and find_run([1], [1, 2]) is None


def test_a_passage_is_stored_as_its_rows_in_the_prompt_that_first_held_it(raw_cache: PassageCache):
    lm = raw_cache.lm
    prompt = chat_prompt(lm.tokenizer, _prompt("Who designed the alpha reactor?"))
    assert raw_cache.answer_prompt(prompt, passages=PASSAGES, max_new_tokens=3).chunks == []  # first sight: a prefill
    assert raw_cache.flush(60) and raw_cache.stats.stored == 3
    found, missing, _ = raw_cache._lookup(prompt, PASSAGES)
    assert not missing and len(found) == 3
    prompt_ids = encode(lm.tokenizer, prompt)
    rows = _full_rows(lm, prompt_ids)
    for chunk in found:
        start = find_run(prompt_ids, chunk.ids)
        assert start is not None and start > 0
        keys, values = raw_cache.kvstore.load(chunk.key)
        n = len(chunk.ids)
        placed = rotate_layers(keys, layer_ropes(lm.model, lm.family, torch.arange(start, start + n), keys))
        torch.testing.assert_close(placed, torch.stack([k[0, :, start:start + n] for k, _ in rows]),
                                   atol=1e-5, rtol=1e-4)  # back where it stood: the prompt's rows
        torch.testing.assert_close(values, torch.stack([v[0, :, start:start + n] for _, v in rows]),
                                   atol=1e-5, rtol=1e-4)


def test_the_same_prompt_reusing_every_stored_passage_gives_the_full_prefills_tokens(raw_cache: PassageCache):
    prompt = chat_prompt(raw_cache.lm.tokenizer, _prompt("When was the gamma bridge finished?"))
    full = raw_cache.answer_prompt(prompt, "full", passages=PASSAGES, max_new_tokens=6)
    raw_cache.answer_prompt(prompt, passages=PASSAGES, max_new_tokens=1)  # first sight: rows stored after
    assert raw_cache.flush(60)
    reused = raw_cache.answer_prompt(prompt, "reuse", passages=PASSAGES, max_new_tokens=6)
    assert [c.text for c in reused.chunks] == PASSAGES  # every passage read from its stored rows, none recomputed
    assert reused.token_ids == full.token_ids  # rows with their context: what a full prefill computes


def test_rows_are_not_taken_from_a_cache_shorter_than_the_prompt_or_for_a_run_it_lacks(tiny_lm):
    ids = tiny_lm.tokenizer("one two three four five six", add_special_tokens=False)["input_ids"]
    rows = _full_rows(tiny_lm, ids)
    got = rows_in_prompt(tiny_lm, ids, rows, [ids[2:4], [max(ids) + 1]])
    assert set(got) == {0} and got[0].kv[0].shape[2] == 2  # the second run is not in the prompt: prefilled alone
    assert got[0].start == 2 and got[0].context == context_digest(ids[:2]) != context_digest(ids[:1])
    windowed = [(k[:, :, -2:], v[:, :, -2:]) for k, v in rows]  # a sliding window keeps fewer rows
    assert rows_in_prompt(tiny_lm, ids, windowed, [ids[2:4]]) == {}


def test_stored_rows_are_read_after_the_passage_they_followed_and_anywhere_by_a_fusing_answer(
        raw_cache: PassageCache):
    def prompt_of(order: list[str]) -> str:
        return chat_prompt(raw_cache.lm.tokenizer, _prompt("Who designed the alpha reactor?", order))

    def ask(order: list[str], **options):
        return raw_cache.answer_prompt(prompt_of(order), passages=order, max_new_tokens=1, **options)

    ask(PASSAGES)  # first sight: each passage's rows stored after the one before it
    assert raw_cache.flush(60)
    moved = [PASSAGES[0], PASSAGES[2], PASSAGES[1]]
    # an answer that does not fuse reads them only after the passage they followed: the others follow another now
    unfused, _, _, _ = look_up(raw_cache.keys, raw_cache.lm.tokenizer, raw_cache.passage_ids, prompt_of(moved), moved)
    assert [c.text for c in unfused] == PASSAGES[:1]
    # one that fuses reads every passage's rows wherever it stands: their context is what fusion recomputes
    assert [c.text for c in ask(moved, mode="probe").chunks] == moved
    assert raw_cache.flush(60)
    assert raw_cache.warm([PASSAGES[2]], show_progress=False) == 1  # computed alone: read wherever it stands
    # the warmed passage first; the next after the one it followed before; the last never stood after a passage
    # (its tokens there, after a line break, differ from its first ones, after "Context: "): recomputed
    assert [c.text for c in ask([PASSAGES[2], PASSAGES[1], PASSAGES[0]], mode="probe").chunks] == moved[1:]
