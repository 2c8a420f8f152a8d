"""LlamaIndex chat: `KVRagChatLLM` (chat, streamed, async, completion), `KVRagChatEngine` over a conversation
(history KV reused, fused chunks as source nodes, streaming, reset, bad input) and the stock
`CondensePlusContextChatEngine` over `KVRetriever` and the chat LLM, on the real SmolLM2."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvrag import InputError, KVRag

pytest.importorskip("llama_index.core")
from llama_index.core.base.llms.types import ImageBlock, TextBlock  # noqa: E402
from llama_index.core.chat_engine import CondensePlusContextChatEngine  # noqa: E402
from llama_index.core.chat_engine.types import AgentChatResponse, StreamingAgentChatResponse  # noqa: E402
from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402

from kvrag.integrations.llama_index import KVRagChatEngine, KVRagChatLLM, KVRetriever  # noqa: E402
from kvrag.integrations.llama_index_chat import to_kvrag_messages  # noqa: E402

QUESTION = "In what year was the album Milk and Honey released?"
FOLLOW_UP = "Who recorded it?"
GOLD = "1984"
TOKENS = 16


@pytest.fixture(scope="module")
def rag(lennon_rag: KVRag) -> KVRag:
    return lennon_rag


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


def keys(nodes: list[Any]) -> list[str]:
    return [n.node.node_id for n in nodes]


async def collect(stream: Any) -> list[Any]:
    return [item async for item in await stream]


def test_messages_become_kvrag_dicts():
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="developer", content="No lists."),
                ChatMessage(role="user", content="Hi"), ChatMessage(role="model", content="Hello"),
                ChatMessage(role="chatbot", content="again"), ChatMessage(role="user", content="Bye")]
    assert to_kvrag_messages(messages) == [
        {"role": "system", "content": "Be brief.\n\nNo lists."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "assistant", "content": "again"},
        {"role": "user", "content": "Bye"}]
    picture = ChatMessage(role="user", blocks=[TextBlock(text="What is this?"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(ValueError, match="non-text block"):
        to_kvrag_messages([picture])


@pytest.mark.slow
def test_chat_llm_chat_and_stream_chat_give_the_same_text(rag):
    llm = KVRagChatLLM(rag=rag, max_new_tokens=8)
    assert llm.metadata.is_chat_model and llm.metadata.context_window == rag.lm.spec.max_position
    whole = llm.chat(user("Say hello."))
    assert whole.message.role == MessageRole.ASSISTANT and whole.message.content == llm.last_answer.text != ""
    info = whole.additional_kwargs
    assert info["chunk_ids"] == [] and info["ttft_s"] > 0 and info["history"]["history_cache"] is True
    assert whole.raw["answer"] == whole.message.content and "history" in whole.raw
    pieces = list(llm.stream_chat(user("Say hello.")))
    assert len(pieces) > 2 and pieces[-1].message.content == whole.message.content
    assert "".join(p.delta for p in pieces) == whole.message.content
    assert pieces[-1].delta == "" and pieces[-1].additional_kwargs["chunk_ids"] == []
    assert llm.complete("Say hello.").text == whole.message.content
    assert list(llm.stream_complete("Say hello."))[-1].text == whole.message.content


@pytest.mark.slow
def test_chat_llm_async_variants(rag):
    llm = KVRagChatLLM(rag=rag, max_new_tokens=8)
    text = llm.chat(user("Say hello.")).message.content
    assert asyncio.run(llm.achat(user("Say hello."))).message.content == text
    pieces = asyncio.run(collect(llm.astream_chat(user("Say hello."))))
    assert pieces[-1].message.content == "".join(p.delta for p in pieces) == text
    assert asyncio.run(llm.acomplete("Say hello.")).text == text
    assert asyncio.run(collect(llm.astream_complete("Say hello.")))[-1].text == text


@pytest.mark.slow
def test_engine_reuses_the_history_and_fuses_the_retrieved_chunks(rag):
    engine = KVRagChatEngine.from_defaults(retriever=KVRetriever(rag=rag, k=2), max_new_tokens=TOKENS)
    first = engine.chat(QUESTION)
    assert isinstance(first, AgentChatResponse) and GOLD in first.response
    assert keys(first.source_nodes) == first.metadata["chunk_ids"] == [c.key for c in rag.retrieve(QUESTION, k=2)]
    assert first.sources[0].raw_output == first.source_nodes

    second = engine.chat(FOLLOW_UP)
    answer = engine.llm.last_answer
    assert keys(second.source_nodes) == [c.key for c in answer.chunks] == second.metadata["chunk_ids"]
    history = second.metadata["history"]
    assert history["reused_tokens"] > 0 and history["prefilled_tokens"] == 0 and history["tier"] is not None
    assert [(m.role, m.content) for m in engine.chat_history] == [
        (MessageRole.USER, QUESTION), (MessageRole.ASSISTANT, first.response),
        (MessageRole.USER, FOLLOW_UP), (MessageRole.ASSISTANT, second.response)]
    # the same turn with the history prefilled from scratch answers the same
    baseline = KVRagChatLLM(rag=rag, history_cache=False, max_new_tokens=TOKENS)
    again = baseline.chat(engine.chat_history[:-1], retrieve=True, k=2)
    assert again.message.content == second.response
    assert again.additional_kwargs["history"]["reused_tokens"] == 0
    assert again.additional_kwargs["chunk_ids"] == second.metadata["chunk_ids"]

    # a streamed third turn: source nodes and report are there once stream_chat returns
    third = engine.stream_chat("When was it released?")
    assert isinstance(third, StreamingAgentChatResponse) and len(engine.chat_history) == 4
    assert keys(third.source_nodes) == third.metadata["chunk_ids"] and len(third.source_nodes) == 2
    assert third.metadata["history"]["reused_tokens"] > history["reused_tokens"]
    pieces = list(third.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == third.response == engine.llm.last_answer.text
    assert len(engine.chat_history) == 6 and engine.chat_history[-1].content == third.response

    engine.reset()
    assert engine.chat_history == []


@pytest.mark.slow
def test_engine_async_variants_answer_as_the_llm_retrieving_itself(rag):
    llm = KVRagChatLLM(rag=rag, retrieve=True, k=2, max_new_tokens=TOKENS)
    direct = llm.complete(QUESTION)
    assert GOLD in direct.text
    assert direct.additional_kwargs["chunk_ids"] == [c.key for c in rag.retrieve(QUESTION, k=2)]
    assert direct.additional_kwargs["chunk_ids"] == [c.key for c in llm.last_answer.chunks]

    engine = KVRagChatEngine.from_defaults(rag, k=2, max_new_tokens=TOKENS)
    first = asyncio.run(engine.achat(QUESTION))
    assert first.response == direct.text and first.metadata["chunk_ids"] == direct.additional_kwargs["chunk_ids"]

    async def stream() -> tuple[StreamingAgentChatResponse, list[str]]:
        response = await engine.astream_chat(FOLLOW_UP)
        return response, [piece async for piece in response.async_response_gen()]

    response, pieces = asyncio.run(stream())
    assert "".join(pieces) == response.response == engine.llm.last_answer.text
    assert response.metadata["history"]["reused_tokens"] > 0 and len(response.source_nodes) == 2
    assert len(engine.chat_history) == 4


@pytest.mark.slow
def test_bad_input_is_refused_and_leaves_the_memory_alone(rag):
    engine = KVRagChatEngine.from_defaults(rag, k=2, max_new_tokens=4, chat_history=[
        ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello!")])
    with pytest.raises(InputError, match="empty"):
        engine.chat("")
    with pytest.raises(InputError, match="empty"):
        engine.stream_chat("   ")  # raised when called, not when the stream is read
    with pytest.raises(InputError, match="empty"):
        asyncio.run(engine.achat(""))
    assert [m.content for m in engine.chat_history] == ["Hi", "Hello!"]
    llm = engine.llm
    with pytest.raises(InputError, match="messages is empty"):
        llm.chat([])
    with pytest.raises(InputError, match="role 'tool'"):
        llm.chat([ChatMessage(role="tool", content="42"), *user("Why?")])
    with pytest.raises(InputError, match="last message"):
        llm.chat([ChatMessage(role="assistant", content="Hello")])
    with pytest.raises(ValueError, match="k must be"):
        KVRagChatEngine(llm=llm, k=-1)
    with pytest.raises(ValueError, match="one kvrag index"):
        KVRagChatEngine.from_defaults()
    with pytest.raises(ValueError, match="KVRetriever"):
        KVRagChatEngine.from_defaults(rag, retriever=object())  # type: ignore[arg-type]


@pytest.mark.slow
def test_condense_plus_context_engine_runs_over_kvrag(rag):
    retriever = KVRetriever(rag=rag, k=2)
    llm = KVRagChatLLM(rag=rag, max_new_tokens=TOKENS)
    engine = CondensePlusContextChatEngine.from_defaults(retriever=retriever, llm=llm)
    first = engine.chat(QUESTION)
    assert GOLD in first.response and keys(first.source_nodes) == keys(retriever.retrieve(QUESTION))
    # the passages went into the system prompt as text: the LLM itself fused no chunk
    assert llm.last_answer.chunks == [] and llm.last_answer.text == first.response
    second = engine.chat(FOLLOW_UP)  # condenses the follow-up with llm.complete, then answers
    assert second.response == llm.last_answer.text and len(second.source_nodes) == 2
    assert len(engine.chat_history) == 4
