"""Span matching in flat prompts, and flat-prompt fusion on a tiny random Llama (exactness)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrag import KVRag, SplitConfig
from kvrag.config import FuseConfig
from kvrag.fusion import FusionInput, fuse
from kvrag.indexing.kvgen import prefix_cache
from kvrag.query.answer import RetrievedChunk
from kvrag.query.flat import answer_flat_prompt, chat_prompt, plan_flat_prompt
from kvrag.query.spans import find_chunk_spans


def _chunk(key: str, text: str) -> RetrievedChunk:
    return RetrievedChunk(key, text, 1.0, key, "", 0)


A = _chunk("a", "The alpha reactor was designed by Mira Okafor in 1987. ")
B = _chunk("b", "Beta station orbits the moon.")
C = _chunk("c", "Gamma rays are photons of very high energy.")


def _fmt(*chunks: RetrievedChunk) -> str:
    return "".join(c.text.strip() + "\n\n" for c in chunks)


def _keys(spans) -> list[str]:
    return [s.chunk.key for s in spans]


def test_spans_follow_prompt_order_not_candidate_order():
    prompt = "Context:\n" + _fmt(C, A, B) + "Question: who?"
    spans = find_chunk_spans(prompt, [A, B, C])
    assert _keys(spans) == ["c", "a", "b"]
    assert all(s.cacheable for s in spans)
    for s in spans:
        assert prompt[s.start : s.end] == s.chunk.text.strip()
        assert prompt[s.end : s.stop] == "\n\n"


def test_repeated_chunk_is_matched_at_each_occurrence():
    prompt = "x " + _fmt(A, B, A) + "q"
    spans = find_chunk_spans(prompt, [A, B, A])
    assert _keys(spans) == ["a", "b", "a"]
    assert spans[0].start < spans[1].start < spans[2].start


def test_adjacent_chunks_without_separator_are_not_cacheable():
    prompt = "ctx: " + A.text.strip() + B.text.strip() + "\n\nq"
    spans = find_chunk_spans(prompt, [A, B])
    assert _keys(spans) == ["a", "b"]
    assert [s.cacheable for s in spans] == [False, True]


def test_missing_and_edited_chunks_are_not_matched():
    edited = A.text.strip().replace("Mira", "M.")
    prompt = "ctx: " + edited + "\n\n" + _fmt(B) + "q"
    assert _keys(find_chunk_spans(prompt, [A, B, C])) == ["b"]


def test_formatter_that_changes_the_separator_falls_back_to_text():
    prompt = "ctx:\n- " + A.text.strip() + "\n- " + B.text.strip() + "\nq"
    spans = find_chunk_spans(prompt, [A, B])
    assert _keys(spans) == ["a", "b"] and not any(s.cacheable for s in spans)


def test_prompt_without_chunks_and_empty_candidates():
    assert find_chunk_spans("Just a question?", [A, B]) == []
    assert find_chunk_spans(_fmt(A), []) == []
    assert find_chunk_spans(_fmt(A), [_chunk("e", "   ")]) == []


def test_overlapping_candidates_keep_the_earlier_longer_one():
    inner = _chunk("inner", "designed by Mira Okafor")
    spans = find_chunk_spans("ctx " + _fmt(A) + "q", [inner, A])
    assert _keys(spans) == ["a"]


# -- flat-prompt fusion on a tiny random model ---------------------------------------------------

DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987. It runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
]


@pytest.fixture(scope="module")
def tiny_rag(tiny_lm, tmp_path_factory: pytest.TempPathFactory) -> KVRag:
    path: Path = tmp_path_factory.mktemp("flat") / "idx"
    return KVRag.build(DOCS, path, model=tiny_lm, split=SplitConfig(mode="document"), show_progress=False)


def _flat_prompt(rag: KVRag, order=(2, 0, 1), sep: str | None = None) -> tuple[str, list[RetrievedChunk]]:
    chunks = [RetrievedChunk.from_record(r) for r in rag.index.records()]
    chunks = [chunks[i] for i in order]
    context = _fmt(*chunks) if sep is None else sep.join(c.text.strip() for c in chunks) + "\n"
    body = "Use the context.\nContext:\n" + context + "Question: Who commands beta station?\nAnswer:"
    return chat_prompt(rag.lm.tokenizer, body), chunks


def _plain_logits(rag: KVRag, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return rag.lm.model(torch.tensor([ids])).logits[0, -1].float()


def _plan_logits(rag: KVRag, prompt: str, mode: str, ratio: float = 1.0) -> tuple[torch.Tensor, list[int]]:
    plan = plan_flat_prompt(rag.lm.tokenizer, prompt, find_chunk_spans(prompt, rag.resolve_chunks(
        [r.key for r in rag.index.records()])))
    assert plan is not None
    kv = [None if c is None or mode == "full" else tuple(t[:, :, : len(ids)] for t in rag.load_chunk(c))
          for c, ids in zip(plan.chunks, plan.piece_ids, strict=True)]
    inp = FusionInput(prefix_cache(rag.lm, plan.sink_ids), [torch.tensor(i) for i in plan.piece_ids], kv,
                      torch.tensor(plan.tail_ids))
    return fuse(rag.lm, inp, FuseConfig(mode=mode, ratio=ratio)).logits, plan.token_ids()


@pytest.mark.parametrize("sep", [None, "\n"])
@pytest.mark.parametrize("mode", ["full", "cacheblend"])
def test_flat_fusion_recomputing_everything_equals_plain_forward(tiny_rag, mode, sep):
    prompt, _ = _flat_prompt(tiny_rag, sep=sep)
    logits, ids = _plan_logits(tiny_rag, prompt, mode, ratio=1.0)
    assert (logits - _plain_logits(tiny_rag, ids)).abs().max().item() <= 1e-4


def test_flat_plan_keeps_the_chunk_tokens_exact(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    prompt, chunks = _flat_prompt(tiny_rag)
    plan = plan_flat_prompt(tiny_rag.lm.tokenizer, prompt, find_chunk_spans(prompt, chunks))
    assert plan is not None and [c.key for c in plan.chunks if c is not None] == [c.key for c in chunks]
    for ids, chunk in zip(plan.piece_ids, plan.chunks, strict=True):
        if chunk is not None:
            assert ids == chunk_token_ids(tiny_rag.lm.tokenizer, chunk.text)


def _greedy(rag: KVRag, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(_plain_logits(rag, ids + out).argmax()))
    return out


def test_answer_flat_prompt_reports_chunks_and_matches_full(tiny_rag):
    prompt, chunks = _flat_prompt(tiny_rag)
    full = answer_flat_prompt(tiny_rag, prompt, mode="full", max_new_tokens=5)
    blend_all = answer_flat_prompt(tiny_rag, prompt, mode="cacheblend", ratio=1.0, max_new_tokens=5)
    blend = answer_flat_prompt(tiny_rag, prompt, mode="cacheblend", ratio=0.15, max_new_tokens=5,
                               candidates=[c.key for c in chunks])
    _, ids = _plan_logits(tiny_rag, prompt, "full")
    eos = tiny_rag.lm.tokenizer.eos_token_id
    expected = _greedy(tiny_rag, ids, 5)
    expected = expected[: expected.index(eos)] if eos in expected else expected
    assert full.token_ids == blend_all.token_ids == expected
    assert [c.key for c in blend.chunks] == [c.key for c in chunks]
    assert 0 < blend.recompute_fraction < 1 and blend.mode == "cacheblend" and blend.ttft_s > 0
    assert full.recompute_fraction == 1.0


def test_chunks_without_separator_reuse_their_leading_cache_rows(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    prompt, chunks = _flat_prompt(tiny_rag, sep="\n- ")
    plan = plan_flat_prompt(tiny_rag.lm.tokenizer, prompt, find_chunk_spans(prompt, chunks))
    assert plan is not None and [c.key for c in plan.chunks if c is not None] == [c.key for c in chunks]
    for ids, chunk in zip(plan.piece_ids, plan.chunks, strict=True):
        if chunk is not None:
            stored = chunk_token_ids(tiny_rag.lm.tokenizer, chunk.text)
            assert 0 < len(ids) < len(stored) and stored[: len(ids)] == ids
    answer = answer_flat_prompt(tiny_rag, prompt, mode="cacheblend", max_new_tokens=3)
    assert [c.key for c in answer.chunks] == [c.key for c in chunks] and answer.recompute_fraction < 1


def test_prompt_without_chunks_is_a_plain_full_prefill(tiny_rag):
    prompt = chat_prompt(tiny_rag.lm.tokenizer, "Tell me about the weather in London.")
    answer = answer_flat_prompt(tiny_rag, prompt, mode="cacheblend", max_new_tokens=4)
    assert answer.mode == "full" and answer.chunks == [] and answer.recompute_fraction == 1.0
    ids = list(tiny_rag.lm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    eos = tiny_rag.lm.tokenizer.eos_token_id
    expected = _greedy(tiny_rag, ids, 4)
    assert answer.token_ids == (expected[: expected.index(eos)] if eos in expected else expected)


def test_chunks_at_the_very_start_and_end_are_recomputed(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    _, chunks = _flat_prompt(tiny_rag)
    tok = tiny_rag.lm.tokenizer
    prompt = _fmt(*chunks)
    plan = plan_flat_prompt(tok, prompt, find_chunk_spans(prompt, chunks))
    # the first becomes the head (a prefix is prefilled anyway), the last the tail (its logits are needed)
    assert plan is not None and [c.key for c in plan.chunks if c is not None] == [chunks[1].key]
    assert plan.sink_ids + plan.piece_ids[0] == chunk_token_ids(tok, chunks[0].text)
    assert plan.tail_ids == chunk_token_ids(tok, chunks[2].text)
    assert plan_flat_prompt(tok, _fmt(chunks[0]), find_chunk_spans(_fmt(chunks[0]), chunks)) is None
