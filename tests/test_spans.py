"""Span matching in flat prompts, and flat-prompt fusion on a tiny random Llama (exactness)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrag import KVRag, SplitConfig
from kvrag.query.answer import RetrievedChunk
from kvrag.query.locate import chat_prompt, encode, index_chunks, lay_out_prompt
from kvrag.query.pipeline import LaidOut
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


def _laid_out(rag: KVRag, prompt: str, chunks: list[RetrievedChunk] | None = None) -> LaidOut:
    return lay_out_prompt(rag.context, prompt, chunks if chunks is not None else index_chunks(rag.context))


def _token_ids(laid: LaidOut) -> list[int]:
    return laid.prefix.ids.tolist() + [t for p in laid.piece_ids for t in p.tolist()] + laid.suffix_ids.tolist()


def _greedy(rag: KVRag, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(_plain_logits(rag, ids + out).argmax()))
    eos = rag.lm.tokenizer.eos_token_id
    return out[: out.index(eos)] if eos in out else out


@pytest.mark.parametrize("sep", [None, "\n"])
@pytest.mark.parametrize("mode", ["full", "cacheblend"])
def test_flat_fusion_recomputing_everything_equals_plain_forward(tiny_rag, mode, sep):
    prompt, _ = _flat_prompt(tiny_rag, sep=sep)
    fused = tiny_rag.prepare_prompt(prompt, mode=mode, ratio=1.0)
    ids = _token_ids(_laid_out(tiny_rag, prompt))
    assert ids == encode(tiny_rag.lm.tokenizer, prompt)  # the prompt's own tokens, as a full prefill runs them
    assert (fused.fused.logits - _plain_logits(tiny_rag, ids)).abs().max().item() <= 1e-4


def test_flat_layout_keeps_the_chunk_tokens_exact(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    prompt, chunks = _flat_prompt(tiny_rag)
    laid = _laid_out(tiny_rag, prompt, chunks)
    assert [c.key for c in laid.used] == [c.key for c in chunks] and not laid.rows_prefix
    for ids, chunk in zip(laid.piece_ids, laid.chunks, strict=True):
        if chunk is not None:
            assert ids.tolist() == chunk_token_ids(tiny_rag.lm.tokenizer, chunk.text)
    # the head is the fusion prefix, exact, and no chunk sits where kvrag's own prefix would put it
    assert laid.reuse_prefix and not laid.first_exact and laid.stale_tokens == sum(
        int(ids.numel()) for c, ids in zip(laid.chunks, laid.piece_ids) if c is not None)


def test_answer_prompt_reports_chunks_and_matches_full(tiny_rag):
    prompt, chunks = _flat_prompt(tiny_rag)
    full = tiny_rag.answer_prompt(prompt, mode="full", max_new_tokens=5)
    blend_all = tiny_rag.answer_prompt(prompt, mode="cacheblend", ratio=1.0, max_new_tokens=5)
    blend = tiny_rag.answer_prompt(prompt, mode="cacheblend", ratio=0.15, max_new_tokens=5,
                                   candidates=[c.key for c in chunks])
    expected = _greedy(tiny_rag, _token_ids(_laid_out(tiny_rag, prompt)), 5)
    assert full.token_ids == blend_all.token_ids == expected
    assert [c.key for c in blend.chunks] == [c.key for c in chunks]
    assert 0 < blend.recompute_fraction < 1 and blend.mode == "cacheblend" and blend.ttft_s > 0
    assert full.gate is None and blend.gate is None  # a fixed mode runs no gate


def test_the_default_answers_a_short_prompt_as_a_full_prefill(tiny_rag):
    prompt, chunks = _flat_prompt(tiny_rag)
    default = tiny_rag.answer_prompt(prompt, max_new_tokens=5)
    assert default.gate.decision == "short" and default.gate.attempts[-1]["mode"] == "full"
    assert default.token_ids == _greedy(tiny_rag, _token_ids(_laid_out(tiny_rag, prompt)), 5)
    assert [c.key for c in default.chunks] == [c.key for c in chunks]


def test_a_long_prompt_goes_through_the_gate_and_its_ladder(tiny_rag):
    from kvrag.config import GateConfig

    prompt, _ = _flat_prompt(tiny_rag)
    tiny_rag.context.heads.clear_prompts()  # an earlier test's exact answer to this prompt would be read instead
    never = GateConfig(fuse=True, full_below_tokens=0, min_margin=1e9, ladder=(0.5,))
    gated = tiny_rag.answer_prompt(prompt, gate=never, max_new_tokens=3)
    assert gated.gate.decision == "escalated" and [a["mode"] for a in gated.gate.attempts] == [
        "probe", "probe", "full"]
    assert gated.token_ids == _greedy(tiny_rag, _token_ids(_laid_out(tiny_rag, prompt)), 3)
    trusted = tiny_rag.answer_prompt(prompt, gate=GateConfig(fuse=True, full_below_tokens=0), max_new_tokens=3)
    assert trusted.gate.decision == "fused" and trusted.mode == "probe" and trusted.recompute_fraction < 1


def test_a_prompt_the_gate_answered_in_full_is_read_again_from_its_kept_rows(tiny_rag):
    from kvrag.config import GateConfig

    prompt, chunks = _flat_prompt(tiny_rag)
    tiny_rag.context.heads.clear_prompts()
    every = GateConfig(full_below_tokens=10**6, short_mode="full")  # every stale token recomputed: exact rows
    first = tiny_rag.answer_prompt(prompt, gate=every, max_new_tokens=3)
    again = tiny_rag.answer_prompt(prompt, gate=every, max_new_tokens=3)
    assert first.gate.decision == "short" and again.gate.decision == "kept"
    assert [c.key for c in again.chunks] == [c.key for c in first.chunks] == [c.key for c in chunks]
    assert again.token_ids == first.token_ids == tiny_rag.answer_prompt(prompt, "full", max_new_tokens=3).token_ids


def test_kvrags_own_prompt_reads_the_first_chunk_as_exact(tiny_rag):
    chunks = [RetrievedChunk.from_record(r) for r in tiny_rag.index.records()]
    prompt = tiny_rag.prompt_text("Who commands beta station?", chunks)
    laid = _laid_out(tiny_rag, prompt, chunks)
    assert laid.first_exact and laid.prefix is tiny_rag.context.prefix and len(laid.used) == len(chunks)
    answer = tiny_rag.answer_prompt(prompt, max_new_tokens=3)
    assert answer.gate.attempts[-1]["mode"] == "prefix"  # the short path reads the exact first chunk


def test_a_template_head_is_prefilled_once(tiny_rag):
    _, chunks = _flat_prompt(tiny_rag)
    heads = tiny_rag.context.heads

    def prompt(question: str) -> str:  # the question before the context, as LangChain's tutorial prompt has it
        body = "Answer from the context.\nQuestion: " + question + "\nContext: " + _fmt(*chunks) + "Answer:"
        return chat_prompt(tiny_rag.lm.tokenizer, body)

    tiny_rag.answer_prompt(prompt("Who commands beta station?"), max_new_tokens=2)
    reused, prefilled = heads.reused_tokens, heads.prefilled_tokens
    laid = _laid_out(tiny_rag, prompt("Who commands beta station?"), chunks)
    assert heads.prefilled_tokens == prefilled and heads.reused_tokens > reused  # the same head: all kept
    assert laid.chunks[0] is not None  # no head token left to recompute
    laid = _laid_out(tiny_rag, prompt("Where is alpha station?"), chunks)
    head = laid.prefix.length + int(laid.piece_ids[0].numel())
    # a new question: the template's kept rows are the prefix, only the question's tokens are recomputed
    assert heads.prefilled_tokens == prefilled and laid.chunks[0] is None and 0 < laid.piece_ids[0].numel() < head // 2
    answer = tiny_rag.answer_prompt(prompt("Where is alpha station?"), max_new_tokens=3)
    assert answer.gate.decision == "short" and answer.token_ids == _greedy(tiny_rag, _token_ids(laid), 3)


def test_the_head_cache_is_bounded_in_bytes(tiny_rag):
    from kvrag.query.head_cache import HeadCache

    cache = HeadCache(max_bytes=1)
    assert cache.prefix_for(tiny_rag.lm, [5, 6, 7]).length == 3 and len(cache) == 0 and cache.nbytes == 0
    one = HeadCache()
    first = one.prefix_for(tiny_rag.lm, [5, 6, 7])
    size = one.nbytes
    two = HeadCache(max_bytes=2 * size)
    for start in range(4):
        two.prefix_for(tiny_rag.lm, [start + 10, 6, 7])
    assert len(two) == 2 and two.nbytes == 2 * size
    again = one.prefix_for(tiny_rag.lm, [5, 6, 7, 8])
    for (k1, v1), (k2, v2) in zip(first.kv, again.kv):
        assert torch.equal(k1, k2[:, :, :3]) and torch.equal(v1, v2[:, :, :3])
    plain = HeadCache(max_bytes=0).prefix_for(tiny_rag.lm, [5, 6, 7, 8])
    for (k1, _), (k2, _) in zip(plain.kv, again.kv):
        assert (k1 - k2).abs().max().item() <= 1e-5


def test_chunks_without_separator_reuse_their_leading_cache_rows(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    prompt, chunks = _flat_prompt(tiny_rag, sep="\n- ")
    laid = _laid_out(tiny_rag, prompt, chunks)
    assert [c.key for c in laid.used] == [c.key for c in chunks] and laid.rows_prefix
    assert _token_ids(laid) == encode(tiny_rag.lm.tokenizer, prompt)
    # after "- " a chunk's first word carries the space: it is text, and the chunk reads its stored rows from 1 on
    assert laid.row_starts is not None and sorted(set(laid.row_starts)) == [0, 1]
    for ids, chunk, row in zip(laid.piece_ids, laid.chunks, laid.row_starts, strict=True):
        if chunk is not None:
            stored = chunk_token_ids(tiny_rag.lm.tokenizer, chunk.text)
            assert 0 < row + len(ids) < len(stored) and stored[row : row + len(ids)] == ids.tolist()
    answer = tiny_rag.answer_prompt(prompt, mode="cacheblend", max_new_tokens=3)
    assert [c.key for c in answer.chunks] == [c.key for c in chunks] and answer.recompute_fraction < 1
    exact = tiny_rag.answer_prompt(prompt, mode="cacheblend", ratio=1.0, max_new_tokens=3)
    assert exact.token_ids == _greedy(tiny_rag, _token_ids(laid), 3)


def test_prompt_without_chunks_is_a_plain_full_prefill(tiny_rag):
    prompt = chat_prompt(tiny_rag.lm.tokenizer, "Tell me about the weather in London.")
    answer = tiny_rag.answer_prompt(prompt, mode="cacheblend", max_new_tokens=4)
    assert answer.mode == "full" and answer.chunks == []
    ids = list(tiny_rag.lm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert answer.token_ids == _greedy(tiny_rag, ids, 4)


def test_chunks_at_the_very_start_and_end_are_recomputed(tiny_rag):
    from kvrag.prompt import chunk_token_ids

    _, chunks = _flat_prompt(tiny_rag)
    tok = tiny_rag.lm.tokenizer
    prompt = _fmt(*chunks)
    laid = _laid_out(tiny_rag, prompt, chunks)
    # the first becomes the head (a prefix is needed), the last the tail (its logits are needed)
    assert [c.key for c in laid.used] == [chunks[1].key]
    assert laid.prefix.ids.tolist() == chunk_token_ids(tok, chunks[0].text)
    assert laid.suffix_ids.tolist() == chunk_token_ids(tok, chunks[2].text)
    assert _laid_out(tiny_rag, _fmt(chunks[0]), chunks).used == []


def test_a_span_covers_the_tokens_that_hold_it_and_whitespace_only():
    from kvrag.query.prompt_tokens import PromptTokens, common_prefix

    #  "Context: The cat.\n\nA dog." as a BPE tokenizer cuts it: " The" carries the space before the passage
    prompt = "Context: The cat.\n\nA dog."
    cuts = [(0, 7), (7, 8), (8, 12), (12, 16), (16, 17), (17, 18), (18, 19), (19, 20), (20, 24), (24, 25)]
    tokens = PromptTokens(prompt, list(range(len(cuts))), [a for a, _ in cuts], [b for _, b in cuts])
    assert tokens.cover(prompt.index("The"), prompt.index("\n")) == (2, 5)
    assert tokens.cover(prompt.index("A dog"), len(prompt)) == (7, 10)
    assert tokens.cover(prompt.index("he cat"), prompt.index("\n")) is None  # "The" joins the span to "T"
    assert tokens.cover(prompt.index("The"), prompt.index("cat") + 2) is None  # "cat" runs past the span's end
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_a_tokenizer_without_offsets_lays_the_pieces_out_one_by_one(tiny_rag, monkeypatch):
    import kvrag.query.locate as locate

    monkeypatch.setattr(locate, "tokenize_prompt", lambda tokenizer, prompt: None)  # a slow tokenizer
    prompt, chunks = _flat_prompt(tiny_rag)
    laid = _laid_out(tiny_rag, prompt, chunks)
    assert [c.key for c in laid.used] == [c.key for c in chunks]
    fused = tiny_rag.prepare_prompt(prompt, mode="cacheblend", ratio=1.0)
    assert (fused.fused.logits - _plain_logits(tiny_rag, _token_ids(laid))).abs().max().item() <= 1e-4
