"""LlamaIndex adapter: retriever nodes, the LLM's interface, RetrieverQueryEngine and KVRagQueryEngine
(whole and streamed)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from typing import Any

import pytest

from kvrag import KVRag

pytest.importorskip("llama_index.core")
from llama_index.core.base.response.schema import Response, StreamingResponse  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import NodeWithScore  # noqa: E402

from kvrag.integrations.llama_index import KVCachedLLM, KVRagQueryEngine, KVRetriever  # noqa: E402

QUESTION = "In what year was the album Milk and Honey released?"
GOLD = "1984"


@pytest.fixture(scope="module")
def rag(lennon_rag: KVRag) -> KVRag:
    return lennon_rag


def test_missing_extra_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fail(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("llama_index"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "kvrag.integrations.llama_index")
    monkeypatch.setattr(builtins, "__import__", fail)
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[llamaindex\]'"):
        importlib.import_module("kvrag.integrations.llama_index")


@pytest.mark.slow
def test_retriever_returns_nodes_with_chunk_ids(rag):
    nodes = KVRetriever(rag=rag, k=2).retrieve(QUESTION)
    chunks = rag.retrieve(QUESTION, k=2)
    assert all(isinstance(n, NodeWithScore) for n in nodes)
    keys = [c.key for c in chunks]
    assert [n.node.metadata["chunk_id"] for n in nodes] == [n.node.node_id for n in nodes] == keys
    assert [n.score for n in nodes] == pytest.approx([c.score for c in chunks])
    # the LLM sees the chunk's exact text, not its metadata
    from llama_index.core.schema import MetadataMode

    assert nodes[0].node.get_content(metadata_mode=MetadataMode.LLM) == chunks[0].text
    with pytest.raises(ValueError, match="k must be"):
        KVRetriever(rag=rag, k=0)


@pytest.mark.slow
def test_llm_complete_stream_chat_and_metadata(rag):
    llm = KVCachedLLM(rag=rag, max_new_tokens=3)
    assert llm.metadata.context_window == rag.lm.spec.max_position and llm.metadata.num_output == 3
    done = llm.complete("Say hello.")
    info = done.additional_kwargs
    assert done.text and info["mode"] == "full" and info["chunk_ids"] == []
    pieces = list(llm.stream_complete("Say hello."))
    assert pieces[-1].text.strip() == done.text
    assert "".join(p.delta or "" for p in pieces).strip() == done.text
    assert asyncio.run(llm.acomplete("Say hello.")).text == done.text
    assert llm.chat([ChatMessage(role="user", content="Say hello.")]).message.content


def test_llm_samples_with_top_p_and_seed_as_kvrag_does(rag):
    sampled = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    llm = KVCachedLLM(rag=rag, mode="full", **sampled)
    done = llm.complete("Say hello.")
    assert llm.complete("Say hello.").text == done.text  # the same seed, the same draw
    nucleus_of_one = KVCachedLLM(rag=rag, mode="full", **{**sampled, "top_p": 1e-6}).complete("Say hello.")
    greedy = KVCachedLLM(rag=rag, mode="full", max_new_tokens=6).complete("Say hello.")
    assert nucleus_of_one.text == greedy.text  # top_p reaches the sampler: only the likeliest token is left
    with pytest.raises(ValueError):
        KVCachedLLM(rag=rag, top_p=0.0)


@pytest.mark.slow
def test_retriever_query_engine_fuses_the_retrieved_chunks(rag):
    retriever = KVRetriever(rag=rag, k=2)
    llm = KVCachedLLM(rag=rag, mode="cacheblend", ratio=0.15, max_new_tokens=14)
    response = RetrieverQueryEngine.from_args(retriever, llm=llm).query(QUESTION)
    assert GOLD in str(response)
    answer = llm.last_answer
    retrieved = [n.node.metadata["chunk_id"] for n in response.source_nodes]
    assert sorted(c.key for c in answer.chunks) == sorted(retrieved)
    assert answer.mode == "cacheblend" and 0 < answer.recompute_fraction < 1


@pytest.mark.slow
def test_kvrag_query_engine_passes_chunk_ids_to_fusion(rag):
    retriever = KVRetriever(rag=rag, k=2)
    llm = KVCachedLLM(rag=rag, mode="cacheblend", ratio=0.15, max_new_tokens=14)
    response = KVRagQueryEngine(retriever=retriever, llm=llm).query(QUESTION)
    assert GOLD in str(response)
    assert response.metadata["chunk_ids"] == [n.node.metadata["chunk_id"] for n in response.source_nodes]
    assert response.metadata["mode"] == "cacheblend" and 0 < response.metadata["recompute_fraction"] < 1
    assert llm.last_answer.text == str(response)


@pytest.mark.slow
def test_kvrag_query_engine_streams_pieces_as_they_are_generated(rag):
    retriever = KVRetriever(rag=rag, k=2)
    llm = KVCachedLLM(rag=rag, mode="cacheblend", ratio=0.15, max_new_tokens=14)
    whole = KVRagQueryEngine(retriever=retriever, llm=llm).query(QUESTION)
    assert isinstance(whole, Response) and GOLD in str(whole)
    n_tokens = len(llm.last_answer.token_ids)

    response = KVRagQueryEngine(retriever=retriever, llm=llm, streaming=True).query(QUESTION)
    assert isinstance(response, StreamingResponse) and inspect.isgenerator(response.response_gen)
    assert response.metadata == {}  # nothing decoded yet: generation runs as the pieces are read
    assert [n.node.node_id for n in response.source_nodes] == whole.metadata["chunk_ids"]
    first = next(response.response_gen)
    # the first piece arrives while decoding is under way, and the report is already there
    assert 0 < len(llm.last_answer.token_ids) < n_tokens
    assert response.metadata["ttft_s"] > 0 and response.metadata["chunk_ids"] == whole.metadata["chunk_ids"]
    pieces = [first, *response.response_gen]
    assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == str(whole) == llm.last_answer.text
    assert llm.last_answer.token_ids and len(llm.last_answer.token_ids) == n_tokens
    assert {k: v for k, v in response.metadata.items() if k not in ("ttft_s", "timings")} == {
        k: v for k, v in whole.metadata.items() if k not in ("ttft_s", "timings")}
    # LlamaIndex's own consumers see the same text
    again = KVRagQueryEngine(retriever=retriever, llm=llm, streaming=True).query(QUESTION)
    assert again.get_response().response == str(whole)


QUESTIONS = ["In what year was the album Milk and Honey released?", "Who recorded Milk and Honey?",
             "Where was John Lennon born?", "Which band was John Lennon in?"]


@pytest.mark.slow
def test_the_default_query_engine_gives_the_full_prefills_answer(rag):
    default, full = KVCachedLLM(rag=rag, max_new_tokens=8), KVCachedLLM(rag=rag, mode="full", max_new_tokens=8)
    rag.context.heads.clear_prompts()  # no exact answer of an earlier test read instead
    decisions = []
    for question in QUESTIONS[:2]:
        texts = [str(RetrieverQueryEngine.from_args(KVRetriever(rag, k=3), llm=llm).query(question))
                 for llm in (default, full)]
        assert texts[0] == texts[1]
        assert len(default.last_answer.chunks) == 3
        decisions.append(default.last_answer.gate.decision)
    # short: every stale token recomputed; then kept: the same passages before a new question, read from the exact
    # rows of the prompt before (LlamaIndex's template puts the context first)
    assert decisions == ["short", "kept"], decisions


@pytest.mark.slow
def test_concurrent_queries_each_get_their_own_answer_and_metadata(rag):
    llm = KVCachedLLM(rag=rag, max_new_tokens=6)
    engine = RetrieverQueryEngine.from_args(KVRetriever(rag, k=2), llm=llm)
    alone = [str(engine.query(q)) for q in QUESTIONS]

    async def together() -> list[Any]:
        return await asyncio.gather(*(engine.aquery(q) for q in QUESTIONS))

    assert [str(r) for r in asyncio.run(together())] == alone
    prompts = [f"Context:\n{c.text}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS for c in rag.retrieve(q, k=1)]

    async def completions() -> list[Any]:
        return await asyncio.gather(*(llm.acomplete(p) for p in prompts))

    for response, prompt, question in zip(asyncio.run(completions()), prompts, QUESTIONS):
        assert response.additional_kwargs["chunk_ids"] == [rag.retrieve(question, k=1)[0].key]
        assert response.text == llm.complete(prompt).text
