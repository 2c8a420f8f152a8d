"""Conversations: kept KV reused exactly across turns, truncation without recompute, the tiers' bounds.

The tiny random model checks the mechanics (what is reused, dropped, kept where); the real SmolLM2 checks
that reusing a conversation's KV gives the answer a full prefill of the same messages gives.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import reference_generate

from kvrag import KVRag, SessionConfig, SplitConfig
from kvrag.chat.history import HistoryKV, extend, plan_drop, truncated
from kvrag.chat.messages import conversation
from kvrag.chat.tiers import SessionTiers
from kvrag.chat.turn import conversation_for
from kvrag.errors import InputError
from kvrag.model import rope_at, unapply_rope
from kvrag.prompt import chunk_token_ids

DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987. It runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("chat") / "idx"
    rag = KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(mode="document"),
                      show_progress=False, codec="raw")
    yield rag
    rag.close()


def turns(rag: KVRag, questions: list[str], **options) -> list:
    """Ask ``questions`` in one conversation, each answer fed back as the assistant's message."""
    messages, answers = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        answer = rag.chat(list(messages), **options)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.text})
    return answers


# -- mechanics (tiny model) ----------------------------------------------------------------------


def test_the_second_turn_reuses_the_first_turns_kept_kv(tiny):
    tiny.configure_sessions(SessionConfig())
    first, second, third = turns(tiny, ["Who designed the alpha reactor?", "And the beta station?",
                                        "What are gamma rays?"], k=2, max_new_tokens=6)
    assert first.history.reused_tokens == 0 and first.history.tier is None
    assert second.history.reused_tokens > 0 and second.history.prefilled_tokens == 0
    # the first turn's prompt, its passages included, and its answer are all in the kept KV
    assert second.history.reused_tokens > first.n_prompt_tokens + len(first.token_ids)
    assert second.history.tier == "host"
    assert third.history.reused_tokens > second.history.reused_tokens
    assert second.to_json()["history"]["reused_tokens"] == second.history.reused_tokens
    stats = tiny.sessions.stats()
    assert stats["tiers"]["host"]["hits"] >= 2 and stats["saves"] >= 2
    other = tiny.chat([{"role": "user", "content": "What are gamma rays?"}], k=1, max_new_tokens=2)
    assert other.history.reused_tokens > 0 and other.history.prefilled_tokens == 0  # the system message's KV


def test_history_cache_off_prefills_everything_and_answers_the_same(tiny):
    tiny.configure_sessions(SessionConfig())
    on = turns(tiny, ["Who designed the alpha reactor?", "Who commands beta station?"], k=2, mode="full",
               max_new_tokens=6)
    off = turns(tiny, ["Who designed the alpha reactor?", "Who commands beta station?"], k=2, mode="full",
                max_new_tokens=6, history_cache=False)
    assert off[1].history.reused_tokens == 0 and off[1].history.prefilled_tokens > 0
    assert [a.token_ids for a in on] == [a.token_ids for a in off]


def test_a_turn_without_passages_prefills_only_its_message(tiny):
    tiny.configure_sessions(SessionConfig())
    answer = tiny.chat([{"role": "user", "content": "Hello there"}], retrieve=False, max_new_tokens=4)
    assert answer.chunks == [] and answer.mode == "full"
    again = tiny.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], k=0,
                      max_new_tokens=4)
    assert again.chunks == []


@pytest.mark.parametrize(("messages", "match"), [
    ([], "empty"),
    ("hello", "list"),
    ([{"role": "assistant", "content": "hi"}], "last message"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
     "only the first"),
    ([{"role": "tool", "content": "x"}, {"role": "user", "content": "c"}], "role 'tool'"),
    ([{"role": "user", "content": 3}], "must be a str"),
    ([{"role": "user", "content": "  "}], "empty"),
])
def test_bad_messages_raise_one_line_input_errors(tiny, messages, match):
    with pytest.raises(InputError, match=match):
        tiny.chat(messages, max_new_tokens=2)


def test_truncation_policy_drops_whole_oldest_turns_and_keeps_the_system_message():
    assert plan_drop([10, 5, 5, 5, 5], need=10, budget=100) == 0
    assert plan_drop([10, 5, 5, 5, 5], need=25, budget=46) == 2  # one user/assistant pair
    assert plan_drop([10, 5, 5, 5, 5], need=25, budget=36) == 4
    with pytest.raises(InputError, match="system message alone"):
        plan_drop([10, 5, 5], need=40, budget=30)


def test_truncated_history_moves_kept_rows_without_changing_their_content(tiny_lm):
    pieces = [(0, [2, 3, 4]), (1, [5, 6]), (2, [7, 8, 9]), (3, [10, 11]), (4, [12])]
    history = extend(tiny_lm, None, pieces)
    cut = truncated(tiny_lm, history, keep_from=3)
    assert [m for m, _ in cut.spans] == [0, 3, 4] and cut.ids == [2, 3, 4, 10, 11, 12]
    assert cut.dropped == 2
    old_rows = torch.tensor([0, 1, 2, 8, 9, 10])
    like = history.keys[:1, :1]
    before = unapply_rope(history.keys[:, :, old_rows], *rope_at(tiny_lm.model, old_rows, like))
    after = unapply_rope(cut.keys, *rope_at(tiny_lm.model, torch.arange(6), like))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)  # same pre-RoPE keys, new positions
    torch.testing.assert_close(cut.values, history.values[:, :, old_rows])
    torch.testing.assert_close(cut.keys[:, :, :3], history.keys[:, :, :3])  # the system message did not move


def test_a_long_conversation_drops_its_oldest_turns_to_fit_the_context(tiny):
    tiny.configure_sessions(SessionConfig(max_context=320))
    questions = [f"Question number {i}: who designed the alpha reactor and when?" for i in range(6)]
    on = turns(tiny, questions, k=1, mode="full", max_new_tokens=8)
    assert on[-1].history.dropped_messages > 0
    assert all(a.n_prompt_tokens + 8 <= 320 for a in on)
    off = turns(tiny, questions, k=1, mode="full", max_new_tokens=8, history_cache=False)
    assert off[-1].history.dropped_messages == on[-1].history.dropped_messages  # one policy either way


def _entry(n_tokens: int, layers: int = 2) -> HistoryKV:
    keys = torch.randn(layers, 2, n_tokens, 8)
    return HistoryKV(list(range(n_tokens)), [(0, n_tokens)], keys, keys.clone())


def test_tiers_are_bounded_move_down_and_count_hits(tmp_path):
    one = _entry(16).nbytes
    tiers = SessionTiers(SessionConfig(host_bytes=2 * one, disk_bytes=3 * one, disk_dir=str(tmp_path)),
                         torch.device("cpu"))
    for i in range(6):
        tiers.put(f"k{i}", _entry(16))
    stats = tiers.stats()["tiers"]
    assert stats["host"]["bytes"] <= 2 * one and stats["host"]["entries"] == 2
    assert stats["disk"]["bytes"] <= 3 * one and stats["disk"]["entries"] == 3
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert tiers.get("k0") is None  # fell off the bottom
    got = tiers.get("k2")  # on disk: read back layer by layer, moved to host
    assert got is not None and got[1] == "disk"
    assert got[0].keys.shape == (2, 2, 16, 8)
    assert tiers.get("k2")[1] == "host"
    stats = tiers.stats()
    assert stats["tiers"]["disk"]["hits"] == 1 and stats["tiers"]["host"]["hits"] == 1 and stats["misses"] == 1
    tiers.close()


def test_an_expected_entry_is_kept_and_read_ahead_from_disk(tmp_path):
    one = _entry(16).nbytes
    tiers = SessionTiers(SessionConfig(host_bytes=2 * one, disk_bytes=4 * one, disk_dir=str(tmp_path)),
                         torch.device("cpu"))
    tiers.put("a", _entry(16))
    tiers.put("b", _entry(16))
    tiers.expect("a")  # a queued request will read "a": the next eviction takes "b" although "a" is older
    tiers.put("c", _entry(16))
    assert "a" in tiers.tiers[0].entries and "b" in tiers.tiers[1].entries
    tiers.release("a")
    tiers.expect("b")  # on disk: brought up to host in the background
    for _ in range(200):
        if "b" in tiers.tiers[0].entries:
            break
        time.sleep(0.01)
    assert "b" in tiers.tiers[0].entries
    tiers.close()


def test_template_pieces_are_stable_as_the_conversation_grows(tiny_lm):
    tok = tiny_lm.tokenizer
    short = conversation(tok, [{"role": "user", "content": "q1"}], "Be helpful.")
    longer = conversation(tok, [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                {"role": "user", "content": "q2"}], "Be helpful.")
    q_ids, a_ids = short.closing_pieces("a1")
    assert longer.history_ids == short.history_ids + q_ids + a_ids
    turn = short.user_turn(1)
    assert turn.head is not None and "q1" in turn.suffix


# -- exactness (SmolLM2) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(lennon_rag: KVRag) -> KVRag:
    return lennon_rag


QUESTIONS = ["In what year was the album Milk and Honey released?", "Who recorded it?",
             "What was their earlier album together?"]


def test_reusing_the_kept_kv_gives_the_answer_of_a_full_prefill_of_the_same_messages(real):
    real.configure_sessions(SessionConfig())
    answers = turns(real, QUESTIONS, k=2, mode="full", max_new_tokens=16)
    assert answers[-1].history.reused_tokens > 0
    # the whole conversation as the model saw it (each user message with its passages), prefilled at once
    messages = []
    for question, answer in zip(QUESTIONS, answers):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer.text}]
    conv = conversation_for(real.context, messages[:-1])
    tok = real.lm.tokenizer
    ids: list[int] = list(conv.pieces[0])
    for i, answer in enumerate(answers):
        turn = conv.user_turn(1 + 2 * i)
        ids += turn.head + [t for c in answer.chunks for t in chunk_token_ids(tok, c.text)]
        ids += tok(turn.suffix, add_special_tokens=False)["input_ids"]
        if i < len(answers) - 1:
            ids += conv.reply(1 + 2 * i, answer.text)
    assert len(ids) == answers[-1].n_prompt_tokens
    prompt = torch.tensor([ids])
    out = reference_generate(real.lm, prompt, max_new_tokens=16)
    full = out[0, prompt.shape[1]:].tolist()
    assert answers[-1].token_ids == full[: len(answers[-1].token_ids)]


def test_default_mode_answers_the_same_with_and_without_the_history_cache(real):
    real.configure_sessions(SessionConfig())
    on = turns(real, QUESTIONS[:2], k=3, max_new_tokens=16)
    off = turns(real, QUESTIONS[:2], k=3, max_new_tokens=16, history_cache=False)
    assert on[-1].history.reused_tokens > 0 and off[-1].history.reused_tokens == 0
    assert [a.text for a in on] == [a.text for a in off]


def test_a_conversation_is_held_once_and_its_earlier_turns_are_found_inside_it():
    earlier = HistoryKV(list(range(10)), [(0, 4), (1, 6)], torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8))
    later = HistoryKV(list(range(16)), [(0, 4), (1, 6), (2, 6)], torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8))
    tiers = SessionTiers(SessionConfig(disk_bytes=0), torch.device("cpu"))
    tiers.put("turn-1", earlier)
    tiers.put("turn-2", later, prefixes={"system": 4, "turn-1": 10})
    assert tiers.stats()["tiers"]["host"]["entries"] == 1  # the earlier turn's entry was dropped
    found, tier = tiers.get("turn-1")
    assert tier == "host" and found.ids == list(range(10)) and found.spans == [(0, 4), (1, 6)]
    torch.testing.assert_close(found.keys, later.keys[:, :, :10])
    assert tiers.get("system")[0].length == 4
    tiers.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_top_tier_is_device_memory(tmp_path):
    one = _entry(16).nbytes
    tiers = SessionTiers(SessionConfig(device_bytes=one, host_bytes=one, disk_bytes=4 * one, disk_dir=str(tmp_path)),
                         torch.device("cuda"))
    tiers.put("a", _entry(16))
    tiers.put("b", _entry(16))
    assert tiers.tiers[0].name == "device" and tiers.tiers[0].entries.peek("b").keys.is_cuda
    assert not tiers.tiers[1].entries.peek("a").keys.is_cuda
    found, tier = tiers.get("a")
    assert tier == "host" and found.keys.is_cuda
    tiers.close()
