"""Prefill slices (`kvrag.fusion.slicing`): a fusion or prefill hands its thread back between slices and computes
bitwise what it computes whole; in `kvrag serve`'s worker the answers already streaming get tokens between the
slices of another's first step, and every answer equals the one it gives alone.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvrag import KVRag, SplitConfig
from kvrag.config import FuseConfig
from kvrag.fusion import slicing
from kvrag.serve.admission import ServiceTimes
from kvrag.serve.scheduler import Done, Job, Piece, Scheduler

DOCS = [f"Station {name} orbits planet {i}. Its commander is {who}, who trained pilots for {i + 3} years."
        for i, (name, who) in enumerate([("Alpha", "Mira Okafor"), ("Beta", "Jonas Reyes"), ("Gamma", "Ada Lind"),
                                         ("Delta", "Ravi Shah"), ("Epsilon", "Lea Novak"), ("Zeta", "Omar Haddad")])]
QUESTION = "Who commands station Gamma, and for how many years did they train pilots?"


@pytest.fixture(scope="module")
def rag(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("slices") / "idx"
    KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(mode="document"), show_progress=False).close()
    opened = KVRag.open(path)
    yield opened
    opened.close()


def test_a_slicer_rejects_a_budget_that_is_not_a_positive_int():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="budget_tokens must be a positive int"):
            slicing.Slicer(bad, lambda: None)  # type: ignore[arg-type]


def test_a_slicer_hands_back_once_per_budget_and_never_inside_its_own_callback():
    calls: list[int] = []
    slicer = slicing.Slicer(10, lambda: (calls.append(1), slicer.ran(1000, 1)))  # nested work: no nested hand-back
    for _ in range(8):
        slicer.ran(8, 2)  # 8 tokens through one of 2 layers: the budget is 10 tokens through both, 20 token-layers
    assert slicer.hand_backs == len(calls) == 2  # after every third report (24 token-layers), counted afresh
    slicing.ran(10_000, 1)  # none installed: nothing happens
    assert len(calls) == 2


def test_a_slicer_hands_back_only_once_its_interval_has_passed():
    calls: list[int] = []
    slicer = slicing.Slicer(1, lambda: calls.append(1), interval_s=3600.0)
    for _ in range(10):
        slicer.ran(100, 2)  # past the budget each time, but not past the interval
    slicer.boundary()
    assert calls == [] and slicer.hand_backs == 0
    slicer.interval_s = 0.0
    slicer.ran(100, 2)
    assert calls == [1]
    with pytest.raises(ValueError, match="interval_s"):
        slicing.Slicer(1, lambda: None, interval_s=-1.0)


@pytest.mark.parametrize("mode", ["full", "cacheblend", "probe"])
def test_a_sliced_fusion_computes_bitwise_what_the_whole_one_does(rag: KVRag, mode: str):
    whole = rag.prepare(QUESTION, k=4, fuse_config=FuseConfig(mode=mode, ratio=0.3)).fused
    between: list[int] = []
    slicer = slicing.Slicer(1, lambda: between.append(1))
    with slicing.installed(slicer):
        sliced = rag.prepare(QUESTION, k=4, fuse_config=FuseConfig(mode=mode, ratio=0.3)).fused
    assert slicing.current() is None  # the block restored what was installed before
    assert slicer.hand_backs == len(between) >= rag.lm.spec.n_layers  # a hand-back after every layer at least
    assert torch.equal(sliced.logits, whole.logits)
    assert torch.equal(sliced.selected, whole.selected) and sliced.n_selected == whole.n_selected
    for (k1, v1), (k2, v2) in zip(_layers(sliced.cache), _layers(whole.cache)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from kvrag.model import hf_compat

    return list(hf_compat.cache_layers(cache))


def _run_two(rag: KVRag, chunk_tokens: int | None) -> tuple[dict[str, list[int]], int, int, ServiceTimes]:
    """A long answer streaming, then a second conversation's first step: the answers' token ids, how many tokens the
    first answer gave while the second's first step ran, the scheduler's hand-backs and its measured times.
    """
    scheduler = Scheduler(rag, max_active=2, prefill_chunk_tokens=chunk_tokens, slice_interval_s=0.0)
    done: dict[str, list[int]] = {}
    finished = threading.Event()
    first_started = threading.Event()
    during: list[int] = []  # the first answer's steps when the second was submitted, and at its first token

    def emit_of(name: str):
        def emit(event) -> None:
            if isinstance(event, Piece) and name == "first":
                first_started.set()
            if isinstance(event, Piece) and name == "second" and len(during) == 1:
                during.append(streaming.steps)
            if isinstance(event, Done):
                done[name] = list(event.answer.token_ids)
                if len(done) == 2:
                    finished.set()
        return emit

    talk = [{"role": "user", "content": QUESTION}]
    streaming = Job(talk, {"k": 1, "max_new_tokens": 60}, emit_of("first"))
    second = Job([{"role": "user", "content": "List every station and its commander."}],
                 {"k": 6, "max_new_tokens": 4}, emit_of("second"))
    scheduler.start()
    try:
        scheduler.submit(streaming)
        assert first_started.wait(60)
        during.append(streaming.steps)
        scheduler.submit(second)
        assert finished.wait(120)
    finally:
        scheduler.stop()
    return done, during[1] - during[0], scheduler.prefill_slices(), scheduler.times


def test_answers_streaming_get_tokens_between_the_slices_of_another_first_step(rag: KVRag):
    sliced, during, hand_backs, times = _run_two(rag, chunk_tokens=1)
    whole, during_whole, none, times_whole = _run_two(rag, chunk_tokens=None)
    assert none == 0 and hand_backs >= rag.lm.spec.n_layers
    # admission learns what a round costs from the rounds run, between slices or not: one answer, or both
    assert times.rounds and {answers for answers, _ in times.rounds} <= {1, 2}
    assert times_whole.rounds and {answers for answers, _ in times_whole.rounds} <= {1, 2}
    assert during_whole <= 2 and during >= during_whole + 3  # a token after each slice, not only the round's one
    assert sliced == whole  # the same answers, sliced or whole
    alone = rag.chat([{"role": "user", "content": QUESTION}], k=1, max_new_tokens=60)
    assert sliced["first"] == list(alone.token_ids)


def test_a_history_prefilled_in_pieces_keeps_the_whole_prefills_rows(rag: KVRag):
    from kvrag.chat.history import extend

    ids = rag.lm.tokenizer(" ".join(DOCS))["input_ids"]
    pieces = [(0, ids[:40]), (1, ids[40:])]
    whole = extend(rag.lm, None, pieces)
    slicer = slicing.Slicer(16, lambda: None)
    with slicing.installed(slicer):
        sliced = extend(rag.lm, None, pieces)
    assert slicer.hand_backs == -(-len(ids) // 16)  # one before each piece of 16 tokens
    assert sliced.ids == whole.ids and sliced.spans == whole.spans
    torch.testing.assert_close(sliced.keys, whole.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sliced.values, whole.values, atol=1e-4, rtol=1e-4)


def test_the_serve_budget_is_auto_on_the_cpu_and_whole_elsewhere_unless_given():
    from kvrag.config import PREFILL_CHUNK_TOKENS, prefill_chunk_tokens

    assert prefill_chunk_tokens("auto", "cpu") == PREFILL_CHUNK_TOKENS
    assert prefill_chunk_tokens("auto", "cuda") is None
    assert prefill_chunk_tokens(128, "cuda") == 128 and prefill_chunk_tokens(0, "cpu") is None
    for bad in (-1, 2.5, "64"):
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            prefill_chunk_tokens(bad, "cpu")
