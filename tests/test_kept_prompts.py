"""Whole prompts kept exact (`kvrag.query.head_cache.HeadCache.keep_prompt`): under the gate, a prompt answered from
exact rows is kept, and a later prompt reads the passages a kept prompt holds from its rows instead of fusing their
stored caches. A prompt asked again, and the same context before a new question, give a full prefill's answer; an
explicit mode computes what it names. The tiny random Llama stands in for a user's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrag.passages import PassageCache, find_passages, open_cache_store
from kvrag.query.head_cache import HeadCache
from kvrag.query.locate import chat_prompt, lay_out_prompt
from tests.test_passage_cache import FUSE, PASSAGES, _prompt

CONTEXT_FIRST = "Context:\n{context}\n\nQuestion: {question}\nAnswer:"


@pytest.fixture()
def cache(tiny_lm, tmp_path: Path):
    with PassageCache(tiny_lm, open_cache_store(f"file://{tmp_path}/cache?max_bytes=50MB")) as opened:
        yield opened


def _ask(cache: PassageCache, raw: str, passages: list[str] = PASSAGES, **options):
    return cache.answer_prompt(chat_prompt(cache.lm.tokenizer, raw), passages=passages, max_new_tokens=5,
                               **options)


def test_a_prompt_asked_again_reads_its_kept_rows_and_gives_the_full_prefills_answer(cache: PassageCache):
    raw = _prompt("Who designed the alpha reactor?")
    first = _ask(cache, raw, gate=FUSE)  # passages unseen: a full prefill, its rows kept
    assert first.chunks == [] and cache.flush(60) and cache.stats.stored == 3
    heads = cache.context.heads
    reused = heads.reused_tokens
    again = _ask(cache, raw, gate=FUSE)
    assert again.gate.decision == "kept" and [c.text for c in again.chunks] == PASSAGES  # read from the kept rows
    assert heads.reused_tokens - reused == first.n_prompt_tokens - 1  # all but the last token read
    assert again.token_ids == first.token_ids == _ask(cache, raw, mode="full").token_ids
    fused = _ask(cache, raw, mode="probe")  # an explicit mode fuses as it names, kept rows or not
    assert [c.text for c in fused.chunks] == PASSAGES


def test_a_cache_url_bounds_the_kept_prompts_and_info_reports_them(tiny_lm, tmp_path: Path):
    raw = _prompt("Who designed the alpha reactor?")
    url = f"file://{tmp_path}/cache?max_bytes=50MB&prompt_bytes=0"
    with PassageCache.open(tiny_lm, url) as off:  # prompt_bytes=0: no prompt is kept
        _ask(off, raw, gate=FUSE)
        assert off.flush(60) and _ask(off, raw, gate=FUSE).gate.decision != "kept"
        assert off.info()["kept_prompts"] == 0 and off.info()["kept_prompt_max_bytes"] == 0
    with PassageCache.open(tiny_lm, f"file://{tmp_path}/other?prompt_bytes=64MiB") as on:
        _ask(on, raw, gate=FUSE)
        info = on.info()
        assert info["kept_prompts"] == 1 and 0 < info["kept_prompt_bytes"] <= info["kept_prompt_max_bytes"] == 64 << 20
        assert on.flush(60) and _ask(on, raw, gate=FUSE).gate.decision == "kept"


def test_the_same_context_before_a_new_question_is_read_from_the_kept_rows(cache: PassageCache):
    def ask(question: str, **options):
        raw = CONTEXT_FIRST.format(context="\n\n".join(PASSAGES), question=question)
        return _ask(cache, raw, find_passages(raw), **options)

    ask("Who designed the alpha reactor?", gate=FUSE)
    cache.flush(60)
    new = ask("When was the gamma bridge finished?", gate=FUSE)
    assert new.gate.decision == "kept"  # the passages come before the question: all in the kept rows
    assert new.token_ids == ask("When was the gamma bridge finished?", mode="full").token_ids
    assert len(cache.context.heads) >= 2  # the new prompt, computed exactly after the kept rows, is kept too


def test_passages_after_the_kept_run_are_fused_from_their_stored_caches(cache: PassageCache):
    raw = _prompt("Who built the telescope?")
    _ask(cache, raw, gate=FUSE)  # kept, and its three passages stored
    delta = "The delta tower stands on a hill above the harbour; its lamp was first lit in 1902 by the town's mayor."
    cache.flush(60)
    cache.warm([delta], show_progress=False)
    other = [*PASSAGES[:2], delta]
    prompt = chat_prompt(cache.lm.tokenizer, _prompt("Who built the telescope?", other))
    found, _, _ = cache._lookup(prompt, other)
    laid = lay_out_prompt(cache.context, prompt, found, kept=True)
    assert [c.text for c in laid.kept] == other[:2]  # inside the kept prompt's rows: read from them
    assert [c.text for c in laid.chunks if c is not None] == [delta]  # after them: its stored cache fused
    partly = cache.answer_prompt(prompt, passages=other, max_new_tokens=5, gate=FUSE)
    assert partly.gate.decision == "fused" and [c.text for c in partly.chunks] == other
    unkept = lay_out_prompt(cache.context, prompt, found)  # an explicit mode: all three fused
    assert unkept.kept == [] and [c.text for c in unkept.chunks if c is not None] == other


def test_kept_prompts_hold_a_bound_of_their_own():
    layers = [(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)) for _ in range(2)]  # 1,280 bytes for 10 rows
    none = HeadCache(prompt_bytes=0)
    none.keep_prompt(list(range(10)), layers)
    assert len(none) == 0 and none.covered(list(range(10))) == 0
    two = HeadCache(max_bytes=0, prompt_bytes=2 * 1280)
    for start in (100, 200, 300):
        two.keep_prompt(list(range(start, start + 10)), layers)
    assert len(two) == 2 and two.nbytes == 2 * 1280  # the oldest evicted
    assert two.covered(list(range(100, 120))) == 0 and two.covered(list(range(300, 305)) + [7]) == 5
    two.keep_prompt(list(range(300, 308)), layers)  # a prompt a kept one holds whole is not kept again
    assert len(two) == 2
    two.clear_prompts()
    assert len(two) == 0
    with pytest.raises(ValueError, match="prompt_bytes"):
        HeadCache(prompt_bytes=-1)


def test_a_chat_turn_with_its_context_in_a_system_message_asked_again_reads_the_kept_rows(cache: PassageCache):
    messages = [{"role": "system", "content": "Answer from this context:\n\n" + "\n\n".join(PASSAGES)},
                {"role": "user", "content": "Who designed the alpha reactor?"}]
    first = cache.chat(messages, max_new_tokens=5, gate=FUSE)
    cache.flush(60)
    again = cache.chat(messages, max_new_tokens=5, gate=FUSE)
    assert again.gate.decision == "kept" and again.token_ids == first.token_ids
    assert again.token_ids == cache.chat(messages, mode="full", max_new_tokens=5).token_ids
    new = [messages[0], {"role": "user", "content": "Where was the beta telescope built?"}]
    answer = cache.chat(new, max_new_tokens=5, gate=FUSE)  # the context comes first: all of it in the kept rows
    assert answer.gate.decision == "kept"
    assert answer.token_ids == cache.chat(new, mode="full", max_new_tokens=5).token_ids

