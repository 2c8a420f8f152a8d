"""`ChatKVRag`: LangChain's standard chat-model suites, message conversion, streaming, async, the lock, and
conversations whose second turn reuses the first turn's KV (tiny random model; SmolLM2 for the slow tier).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrag import KVRag, SplitConfig
from kvrag.errors import InputError

pytest.importorskip("langchain_core")
from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from kvrag.generation.trimmed import trimmed  # noqa: E402
from kvrag.integrations.langchain import ChatKVRag  # noqa: E402
from kvrag.integrations.langchain_chat import to_kvrag_messages  # noqa: E402

QUESTION = "In what year was the album Milk and Honey released?"
GOLD = "1984"
DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987.\n\nIt runs on molten salt."),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes."),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay."),
]
TINY_Q = "Who designed the alpha reactor?"


@pytest.fixture(scope="module")
def rag(lennon_rag: KVRag) -> KVRag:
    return lennon_rag


@pytest.fixture(scope="module")
def tiny_rag(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVRag]:
    path = tmp_path_factory.mktemp("lc-chat-tiny") / "idx"
    with KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(mode="document"),
                     show_progress=False) as built:
        yield built


class _Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def _joined(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full


# -- messages -----------------------------------------------------------------------------------------


def test_messages_become_kvrag_dicts():
    messages = [
        SystemMessage("Be brief."), SystemMessage([{"type": "text", "text": "Cite."}]),
        HumanMessage([{"type": "text", "text": "Hello "}, "there", {"type": "text", "text": "!"}], name="u"),
        AIMessage([{"type": "reasoning", "reasoning": "greet back"}, {"type": "text", "text": "Hi."}]),
        ChatMessage(role="human", content="And you?"), ChatMessage(role="assistant", content="Fine."),
        ChatMessage(role="developer", content="late"), ChatMessage(role="user", content="Bye"),
    ]
    assert to_kvrag_messages(messages) == [
        {"role": "system", "content": "Be brief.\n\nCite."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And you?"},
        {"role": "assistant", "content": "Fine."},
        {"role": "system", "content": "late"},  # not leading: kvrag rejects it
        {"role": "user", "content": "Bye"},
    ]
    chunk = AIMessageChunk(content="streamed")
    assert to_kvrag_messages([HumanMessage("q"), chunk, HumanMessage("r")])[1] == {
        "role": "assistant", "content": "streamed"}
    assert to_kvrag_messages([ToolMessage("3", tool_call_id="1")]) == [{"role": "tool", "content": "3"}]


def test_non_text_blocks_are_refused():
    image = {"type": "image", "url": "https://example.org/cat.png"}
    with pytest.raises(ValueError, match=r"message 0 holds a 'image' block"):
        to_kvrag_messages([HumanMessage([{"type": "text", "text": "What is this?"}, image])])


def test_trimmed_streams_what_answer_text_holds():
    pieces = ["\n ", " Hel", "lo", " ", "\n", "world", " \n"]
    assert list(trimmed(iter(pieces))) == ["Hel", "lo", " \nworld"]
    assert "".join(trimmed(iter(pieces))) == "".join(pieces).strip()
    assert list(trimmed(iter([" ", "\n"]))) == []


def test_kvrag_rejects_what_it_cannot_render(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, max_new_tokens=2)
    with pytest.raises(InputError, match="role 'tool'"):
        chat.invoke([HumanMessage("What is 1 + 2?"), AIMessage("calling"), ToolMessage("3", tool_call_id="1")])
    with pytest.raises(InputError, match="only the first message"):
        chat.invoke([HumanMessage("Hi"), AIMessage("Hello"), SystemMessage("Be brief."), HumanMessage("Bye")])
    with pytest.raises(InputError, match="last message must be the user's"):
        chat.invoke([HumanMessage("Hi"), AIMessage("Hello")])


# -- one index, tiny model ----------------------------------------------------------------------------


def test_invoke_reports_usage_and_fused_chunks(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, k=2, max_new_tokens=4)
    assert chat._llm_type == "kvrag-chat"
    assert {"index", "model", "k", "mode", "ratio", "history_cache"} <= set(chat._identifying_params)
    msg = chat.invoke(TINY_Q)
    answer = chat.last_answer
    assert isinstance(msg, AIMessage) and msg.content == answer.text
    assert msg.usage_metadata == {
        "input_tokens": answer.n_prompt_tokens, "output_tokens": len(answer.token_ids),
        "total_tokens": answer.n_prompt_tokens + len(answer.token_ids),
        "input_token_details": {"cache_read": answer.history.reused_tokens}}
    meta = msg.response_metadata
    assert meta["chunks"] == [c.key for c in tiny_rag.retrieve(TINY_Q, k=2)] == [c.key for c in answer.chunks]
    assert meta["sources"] == [c.source for c in answer.chunks]
    assert meta["model_name"] == tiny_rag.lm.source and meta["mode"] == answer.mode and meta["ttft_s"] > 0
    assert meta["history"] == answer.history.to_json()
    assert meta["gate"] == (answer.gate.to_json() if answer.gate is not None else None)
    assert meta["finish_reason"] in ("stop", "length")
    # per-call overrides: no retrieval, fewer tokens (max_tokens is LangChain's name for max_new_tokens)
    plain = chat.invoke(TINY_Q, retrieve=False, max_tokens=1)
    assert plain.response_metadata["chunks"] == [] and plain.usage_metadata["output_tokens"] <= 1
    assert chat.invoke(TINY_Q, k=1).response_metadata["chunks"] == meta["chunks"][:1]
    assert ChatKVRag(rag=tiny_rag, k=0, max_tokens=1).invoke(TINY_Q).response_metadata["chunks"] == []


def test_stream_joins_to_invoke_and_fires_each_token_once(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, k=2, max_new_tokens=6)
    text = chat.invoke(TINY_Q).content
    handler = _Tokens()
    chunks = list(chat.stream(TINY_Q, config={"callbacks": [handler]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    last = chunks[-1]
    assert last.chunk_position == "last" and last.content == "" and last.usage_metadata["output_tokens"] > 0
    assert all(c.usage_metadata is None and "chunks" not in c.response_metadata for c in chunks[:-1])
    full = _joined(chunks)
    assert full.content == text
    assert full.response_metadata["chunks"] == [c.key for c in chat.last_answer.chunks]
    assert full.usage_metadata == chat.invoke(TINY_Q).usage_metadata
    assert [t for t in handler.tokens if t] == [c.content for c in chunks if c.content]
    # streaming=True routes invoke through the stream, to the same answer
    assert ChatKVRag(rag=tiny_rag, k=2, max_new_tokens=6, streaming=True).invoke(TINY_Q).content == text


def test_stop_ends_the_answer(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, k=1, max_new_tokens=8, retrieve=False)
    text = chat.invoke(TINY_Q).content
    if len(text) < 2:
        pytest.skip("the random model's answer is too short to cut")
    stop = text[1:3]
    assert chat.invoke(TINY_Q, stop=[stop]).content == text[: text.index(stop)].strip()
    assert ChatKVRag(rag=tiny_rag, k=1, max_new_tokens=8, retrieve=False, stop=[stop]).invoke(TINY_Q).content == \
        text[: text.index(stop)].strip()


def test_async_variants_match_sync(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, k=2, max_new_tokens=4)
    text = chat.invoke(TINY_Q).content

    async def run() -> tuple[str, list[AIMessageChunk], list[Any]]:
        one = await chat.ainvoke(TINY_Q)
        chunks = [c async for c in chat.astream(TINY_Q)]
        both = await chat.abatch([TINY_Q, TINY_Q])
        return one.content, chunks, both

    one, chunks, both = asyncio.run(run())
    assert one == text and _joined(chunks).content == text and chunks[-1].chunk_position == "last"
    assert _joined(chunks).usage_metadata is not None
    assert [m.content for m in both] == [text, text]


def test_calls_on_one_index_wait_for_each_other(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag, k=2, max_new_tokens=4)
    questions = [TINY_Q, "Who commands Beta station?", "What are gamma rays?", TINY_Q]
    alone = [chat.invoke(q).content for q in questions]
    assert [m.content for m in chat.batch(questions, config={"max_concurrency": 4})] == alone

    async def abandon_then_ask() -> str:
        async for _ in chat.astream(TINY_Q):
            break  # the stream's thread ends after its next piece and frees the index
        return (await asyncio.wait_for(chat.ainvoke(questions[1]), timeout=120)).content

    assert asyncio.run(abandon_then_ask()) == alone[1]
    for _ in chat.stream(TINY_Q):
        break  # a sync stream left early frees the index as its generator closes
    assert chat.invoke(questions[2]).content == alone[2]
    assert alone[0]  # so the stream below is still running after its first piece
    stream = chat.stream(TINY_Q)
    next(stream)
    with pytest.raises(RuntimeError, match="still running in this thread"):
        chat.invoke(TINY_Q)  # would wait forever for the stream this thread is reading
    stream.close()
    assert chat.invoke(questions[3]).content == alone[3]


def test_no_tools_no_structured_output_one_model(tiny_rag):
    chat = ChatKVRag(rag=tiny_rag)
    with pytest.raises(NotImplementedError):
        chat.bind_tools([])
    with pytest.raises(NotImplementedError):
        chat.with_structured_output({"title": "Joke", "type": "object", "properties": {}})
    with pytest.raises(ValueError, match="index's model"):
        chat.invoke(TINY_Q, model="gpt-4o")
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"  # traces name what was asked for
    with pytest.raises(ValidationError, match="opened kvrag.KVRag"):
        ChatKVRag(rag="./idx")


# -- the standard suites ------------------------------------------------------------------------------

try:
    from langchain_tests.integration_tests import ChatModelIntegrationTests
    from langchain_tests.unit_tests import ChatModelUnitTests
except ImportError:  # pragma: no cover - langchain-tests is a dev extra
    ChatModelIntegrationTests = ChatModelUnitTests = None


class _Offers:
    """What `ChatKVRag` offers the standard suites (the reasons are in the test classes' docstrings)."""

    @property
    def chat_model_class(self) -> type[ChatKVRag]:
        return ChatKVRag

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False


if ChatModelUnitTests is not None:

    class TestChatKVRagUnit(_Offers, ChatModelUnitTests):
        """LangChain's standard chat-model unit suite over a tiny random model's index.

        Unsupported, as in `TestChatKVRagIntegration`: tool calling (and tool choice), structured output
        and JSON mode, per-call model override. The suite's ``api_key``, ``timeout`` and ``max_retries``
        mean nothing to a local model and are ignored; ``max_tokens`` is ``max_new_tokens``.
        """

        _rag: KVRag | None = None

        @pytest.fixture(autouse=True)
        def _bind(self, tiny_rag: KVRag) -> None:
            type(self)._rag = tiny_rag

        @property
        def chat_model_params(self) -> dict[str, Any]:
            return {"rag": self._rag, "k": 2, "max_new_tokens": 4}


if ChatModelIntegrationTests is not None:

    @pytest.mark.slow
    @pytest.mark.asyncio  # the suite's async tests; pytest-asyncio runs in strict mode here
    @pytest.mark.filterwarnings("ignore:The test .* is marked with '@pytest.mark.asyncio'")
    class TestChatKVRagIntegration(_Offers, ChatModelIntegrationTests):
        """LangChain's standard chat-model integration suite with the real SmolLM2-135M-Instruct.

        Marked unsupported, and why:

        - Tool calling (``has_tool_calling``, ``has_tool_choice``): kvrag renders the chat template without
          tool schemas and decodes free text (no tool-call parsing, no constrained decoding), and
          SmolLM2-135M-Instruct was not trained to call tools, so ``bind_tools`` raises
          `NotImplementedError` rather than return tool calls that would never come.
        - Structured output (``has_structured_output``, ``supports_json_mode``): ``function_calling`` needs
          tool calls and ``json_schema`` needs constrained decoding, neither of which kvrag has; ``json_mode``
          by prompting alone was tried with this model on the suite's prompts (a JSON schema in the system
          message, 80 new tokens) and it returned the schema back, or prose, never a valid
          ``{"setup", "punchline"}`` object, so ``with_structured_output`` keeps LangChain's default
          (`NotImplementedError` without tools).
        - Per-call model override (``supports_model_override``): an index's stored caches belong to the
          model that computed them, so ``model=`` may only name that model (anything else raises).
        - Images, audio, PDFs, Anthropic-style blocks: the model reads text only (the suite's defaults).

        Usage details: ``input_token_details.cache_read`` counts the history tokens whose kept KV a turn
        reused (checked on a second turn, invoked and streamed).
        """

        _rag: KVRag | None = None

        @pytest.fixture(autouse=True)
        def _bind(self, rag: KVRag) -> None:
            type(self)._rag = rag

        @property
        def chat_model_params(self) -> dict[str, Any]:
            return {"rag": self._rag, "k": 1, "max_new_tokens": 5}  # short prompts and answers: a quick suite

        @property
        def supported_usage_metadata_details(self) -> dict[str, list[str]]:
            return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

        def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
            chat = ChatKVRag(**self.chat_model_params)
            first = chat.invoke("Hello")
            turn = [HumanMessage("Hello"), first, HumanMessage("Which album is it?")]
            msg = _joined(list(chat.stream(turn))) if stream else chat.invoke(turn)
            assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
            return msg


# -- conversations and chains with SmolLM2 ------------------------------------------------------------


@pytest.mark.slow
def test_second_turn_reuses_the_first_turns_kv_and_answers_the_same(rag):
    chat = ChatKVRag(rag=rag, k=2, max_new_tokens=8)
    first = chat.invoke([HumanMessage(QUESTION)])
    turn = [HumanMessage(QUESTION), first, HumanMessage("Who recorded it?")]
    second = chat.invoke(turn)
    baseline = chat.invoke(turn, history_cache=False)
    kept, fresh = second.response_metadata["history"], baseline.response_metadata["history"]
    assert kept["reused_tokens"] > 0 and kept["tier"] is not None
    assert fresh["reused_tokens"] == 0 and fresh["history_cache"] is False
    assert kept["reused_tokens"] + kept["prefilled_tokens"] == fresh["prefilled_tokens"]
    assert second.usage_metadata["input_token_details"]["cache_read"] == kept["reused_tokens"]
    assert second.usage_metadata["input_tokens"] == baseline.usage_metadata["input_tokens"]
    assert second.content == baseline.content  # greedy: the kept KV is exact
    streamed = _joined(list(chat.stream(turn)))
    assert streamed.content == second.content and streamed.response_metadata["history"]["reused_tokens"] > 0


@pytest.mark.slow
def test_lcel_chain_prompt_chat_parser(rag):
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chat = ChatKVRag(rag=rag, k=2, max_new_tokens=16)
    chain = prompt | chat | StrOutputParser()
    out = chain.invoke({"question": QUESTION})
    assert isinstance(out, str) and GOLD in out
    assert chat.last_answer.chunks[0].source == "Milk and Honey (album)"
    assert "".join(chain.stream({"question": QUESTION})) == out
