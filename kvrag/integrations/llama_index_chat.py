"""LlamaIndex chat over kvrag: `KVRagChatLLM` (a chat LLM) and `KVRagChatEngine` (a chat engine over the index).

Contract:

- `KVRagChatLLM` is a LlamaIndex chat model (``metadata.is_chat_model`` is True) over `KVRag.chat` /
  `KVRag.chat_stream`: the `ChatMessage` list becomes kvrag's ``{"role", "content"}`` messages (leading
  system messages merged into one; ``developer`` counts as system, ``chatbot``/``model`` as assistant), so
  kvrag renders the model's chat template and reuses the conversation's KV across turns. By default it
  does not retrieve (``retrieve=False``: a chat engine supplies the context); ``retrieve=True`` fuses the
  caches of the ``k`` chunks retrieved for the last user message. ``complete`` is a one-message chat.
  Every call may override ``retrieve``, ``k``, ``mode``, ``ratio``, ``max_new_tokens``, ``temperature``,
  ``top_p``, ``stop``, ``seed`` and ``history_cache``, and pass ``gate`` or ``chunks`` (chunk keys to fuse
  instead of retrieving) on to `KVRag.chat`; other keyword arguments are ignored.
  The response's ``additional_kwargs`` hold ``ttft_s``, ``chunk_ids``, ``mode``, ``recompute_fraction``,
  ``prompt_tokens`` and ``history`` (`HistoryReport.to_json()`, None without history); ``raw`` is
  `Answer.to_json()`; ``last_answer`` is the `kvrag.Answer`. Streamed text joins to the whole call's text.
- `KVRagChatEngine` keeps the conversation in a memory (a `ChatMemoryBuffer` counting the model's tokens by
  default) and sends it with each new user message to ``rag.chat(..., retrieve=True, k=k)``: the
  retrieved chunks' stored caches are fused into the last user turn and the earlier turns' KV is reused.
  ``source_nodes`` are the fused chunks (`KVRetriever`'s nodes). A failed turn leaves the memory as it
  was. ``stream_chat`` runs retrieval, fusion and the first token before it returns (errors raise there,
  and ``source_nodes`` are set); the rest is decoded as ``response_gen`` is read, and the turn enters the
  memory once it is read to the end. Its ``metadata`` attribute holds the report as for ``chat``.
- Async variants run kvrag's model steps on one shared worker thread, so the event loop stays free.
  `KVRag` is not thread-safe: do not run two calls on the same index at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvrag.backend import AnswerBackend
from kvrag.generation.trimmed import trimmed
from kvrag.integrations.fields import CHAT_OPTIONS, ChatFields
from kvrag.integrations.llama_index import KVRetriever, _node

try:
    from llama_index.core.base.llms.types import TextBlock
    from llama_index.core.callbacks import CallbackManager, trace_method
    from llama_index.core.chat_engine.types import AgentChatResponse, BaseChatEngine, StreamingAgentChatResponse
    from llama_index.core.llms import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        CustomLLM,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.memory import BaseMemory, ChatMemoryBuffer
    from llama_index.core.schema import NodeWithScore
    from llama_index.core.tools import ToolOutput
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - the import above already names the extra
    raise ImportError(
        "kvrag.integrations.llama_index_chat needs llama-index-core: pip install 'kvrag[llamaindex]'"
    ) from exc

__all__ = ["KVRagChatEngine", "KVRagChatLLM", "to_kvrag_messages"]

T = TypeVar("T")
_OPTIONS = (*CHAT_OPTIONS, "stop", "chunks")  # what a call may override; chunks: per call only
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant"}
_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def to_kvrag_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex `ChatMessage`s as kvrag's ``{"role", "content"}`` dicts (leading system messages merged).

    Roles kvrag does not take (tool, function) pass through, and `KVRag.chat` rejects them with `InputError`.

    Raises:
        ValueError: a message holds a block other than text (images, audio...).
    """
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if any(not isinstance(block, TextBlock) for block in message.blocks):
            raise ValueError(f"message {i} holds a non-text block; kvrag chat takes text messages only")
        role = getattr(message.role, "value", message.role)
        role = _ROLES.get(role, role)
        content = message.content or ""
        if role == "system" and len(out) == 1 and out[0]["role"] == "system":  # only system messages so far
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    return out


def _info(answer: Any) -> dict[str, Any]:
    history = getattr(answer, "history", None)
    return {"ttft_s": answer.ttft_s, "chunk_ids": [c.key for c in answer.chunks], "mode": answer.mode,
            "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.n_prompt_tokens,
            "history": None if history is None else history.to_json()}


def _executor() -> ThreadPoolExecutor:
    global _worker
    with _worker_lock:
        if _worker is None:  # one thread for every async call: kvrag's model steps never overlap
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-llama-index")
        return _worker


async def _in_worker(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the worker thread, in a copy of this context (LlamaIndex's spans live there)."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_executor(), context.run, fn, *args)


async def _aiter(items: Iterator[T]) -> AsyncGenerator[T, None]:
    """An async view of a generator whose every step runs on the worker thread."""
    done = object()
    while (item := await _in_worker(next, items, done)) is not done:
        yield item  # type: ignore[misc]


class KVRagChatLLM(ChatFields, CustomLLM):
    """A LlamaIndex chat LLM over `KVRag.chat`: the model's chat template, history KV reused across turns.

    Example:
        >>> llm = KVRagChatLLM(rag=KVRag.open("./idx"))  # doctest: +SKIP
        >>> llm.chat([ChatMessage(role="user", content="Hi!")]).message.content  # doctest: +SKIP
        >>> KVRagChatLLM(rag=rag, retrieve=True, k=4).complete("Who designed the reactor?")  # doctest: +SKIP
    """

    retrieve: bool = Field(default=False, description="Fuse the chunks retrieved for the last user message.")

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name for this class (used when serialising)."""
        return "kvrag_chat_llm"

    @property
    def metadata(self) -> LLMMetadata:
        """The model's context window; a chat model whose system role is ``system``."""
        lm = self.backend.lm
        return LLMMetadata(context_window=lm.spec.max_position, num_output=self.max_new_tokens,
                           is_chat_model=True, model_name=lm.source, system_role=MessageRole.SYSTEM)

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        options = {**self.chat_options(), "stop": self.stop}
        options.update((name, value) for name, value in kwargs.items() if name in _OPTIONS)
        options["stop"] = tuple(options["stop"] or ())
        return options

    def _answer(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        self.last_answer = answer = self.backend.chat(to_kvrag_messages(messages), **self._options(kwargs))
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text),
                            raw=answer.to_json(), additional_kwargs=_info(answer))

    def _stream(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        """Responses per text piece, then one with ``delta=""`` carrying the report.

        ``last_answer`` is set as soon as kvrag has the answer (with the first piece) and again at the end.
        """
        rag, options, converted = self.backend, self._options(kwargs), to_kvrag_messages(messages)

        def gen() -> ChatResponseGen:
            before = rag.last_answer

            def pieces() -> Iterator[str]:
                for piece in rag.chat_stream(converted, **options):
                    if rag.last_answer is not before:
                        self.last_answer = rag.last_answer
                    yield piece

            text = ""
            for delta in trimmed(pieces()):
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            self.last_answer = answer = rag.last_answer
            assert answer is not None  # the stream ended: its answer exists
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text), delta="",
                               raw=answer.to_json(), additional_kwargs=_info(answer))

        return gen()

    @staticmethod
    def _user(prompt: str) -> list[ChatMessage]:
        return [ChatMessage(role=MessageRole.USER, content=prompt)]

    @staticmethod
    def _completion(response: ChatResponse) -> CompletionResponse:
        return CompletionResponse(text=response.message.content or "", delta=response.delta, raw=response.raw,
                                  additional_kwargs=response.additional_kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the conversation's last user message (``retrieve=True``: from the retrieved chunks)."""
        return self._answer(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """As `chat`, a response per text piece; the last one (``delta=""``) carries the report."""
        return self._stream(messages, kwargs)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`chat` with ``prompt`` as the only (user) message."""
        return self._completion(self._answer(self._user(prompt), kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """`stream_chat` with ``prompt`` as the only (user) message."""
        return (self._completion(r) for r in self._stream(self._user(prompt), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """`chat` on the worker thread."""
        return await _in_worker(self._answer, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """`stream_chat`, each step on the worker thread."""
        return _aiter(self._stream(messages, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`complete` on the worker thread."""
        return self._completion(await _in_worker(self._answer, self._user(prompt), kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        """`stream_complete`, each step on the worker thread."""
        return _aiter(self._completion(r) for r in self._stream(self._user(prompt), kwargs))


def _model_tokens(rag: AnswerBackend) -> Callable[[str], list[int]]:
    tokenizer = rag.lm.tokenizer
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


class KVRagChatEngine(BaseChatEngine):
    """A chat engine whose every turn fuses the retrieved chunks' caches and reuses the conversation's KV.

    Args:
        llm: the `KVRagChatLLM` that answers (its decoding and fusion settings are used).
        memory: the conversation (default: a `ChatMemoryBuffer` over the model's tokens and context window).
        k: chunks retrieved per turn, for the last user message (0: plain chat).
        system_prompt: the system message (default: the index's instruction).

    Example:
        >>> engine = KVRagChatEngine.from_defaults(rag, k=4)  # doctest: +SKIP
        >>> engine.chat("Who designed the reactor?").source_nodes  # doctest: +SKIP
        >>> engine.chat("When was it built?").metadata["history"]["reused_tokens"]  # doctest: +SKIP
    """

    def __init__(self, llm: KVRagChatLLM, memory: BaseMemory | None = None, k: int = 4,
                 system_prompt: str | None = None, callback_manager: CallbackManager | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        self._llm, self._k, self._system_prompt = llm, k, system_prompt
        self._memory = memory if memory is not None else ChatMemoryBuffer.from_defaults(
            token_limit=llm.metadata.context_window, tokenizer_fn=_model_tokens(llm.backend))
        self.callback_manager = callback_manager or CallbackManager([])

    @classmethod
    def from_defaults(cls, rag: AnswerBackend | None = None, *, retriever: KVRetriever | None = None,
                      llm: KVRagChatLLM | None = None,
                      k: int | None = None, chat_history: list[ChatMessage] | None = None,
                      memory: BaseMemory | None = None, system_prompt: str | None = None,
                      token_limit: int | None = None, **llm_options: Any) -> KVRagChatEngine:
        """An engine over ``rag`` (or ``retriever``'s or ``llm``'s index); ``k`` defaults to ``retriever.k`` or 4.

        ``llm_options`` build the `KVRagChatLLM` when no ``llm`` is given (``max_new_tokens``, ``mode``...);
        ``token_limit`` bounds the default memory (default: the model's context window).
        """
        if retriever is not None and not isinstance(retriever, KVRetriever):
            raise ValueError(f"retriever must be a KVRetriever, got {type(retriever).__name__}")
        given: tuple[AnswerBackend | None, ...] = (rag, None if retriever is None else retriever.rag,
                                                   None if llm is None else llm.backend)
        indexes = {id(x): x for x in given if x is not None}
        if len(indexes) != 1:
            raise ValueError("give one kvrag index: rag, a KVRetriever or a KVRagChatLLM over the same KVRag")
        backend = next(iter(indexes.values()))
        if llm is None:
            llm = KVRagChatLLM(rag=backend, **llm_options)
        elif llm_options:
            raise ValueError(f"options {sorted(llm_options)} are for a new LLM; set them on the llm given")
        if memory is None:
            memory = ChatMemoryBuffer.from_defaults(token_limit=token_limit or llm.metadata.context_window,
                                                    tokenizer_fn=_model_tokens(backend))
        if chat_history is not None:
            memory.set(chat_history)
        k = k if k is not None else (retriever.k if retriever is not None else 4)
        return cls(llm=llm, memory=memory, k=k, system_prompt=system_prompt)

    @property
    def llm(self) -> KVRagChatLLM:
        """The LLM that answers; its ``last_answer`` is the last turn's `kvrag.Answer`."""
        return self._llm

    @property
    def chat_history(self) -> list[ChatMessage]:
        """Every message of the conversation so far."""
        return self._memory.get_all()

    def reset(self) -> None:
        """Forget the conversation."""
        self._memory.reset()

    def _messages(self, message: str, chat_history: list[ChatMessage] | None) -> list[ChatMessage]:
        if chat_history is not None:
            self._memory.set(chat_history)
        system = [ChatMessage(role=MessageRole.SYSTEM, content=self._system_prompt)] if self._system_prompt else []
        return [*system, *self._memory.get(input=message), ChatMessage(role=MessageRole.USER, content=message)]

    def _remember(self, message: str, answer: Any) -> None:
        # kvrag keeps the turn as (stripped question, answer text): the next turn's history must match it
        self._memory.put(ChatMessage(role=MessageRole.USER, content=message.strip()))
        self._memory.put(ChatMessage(role=MessageRole.ASSISTANT, content=answer.text))

    @staticmethod
    def _sources(message: str, nodes: list[NodeWithScore]) -> list[ToolOutput]:
        text = "\n\n".join(n.node.get_content() for n in nodes)
        return [ToolOutput(tool_name="retriever", content=text, raw_input={"message": message}, raw_output=nodes)]

    @trace_method("chat")
    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        """Answer ``message`` from the chunks retrieved for it, after the conversation so far."""
        self._llm.chat(self._messages(message, chat_history), retrieve=True, k=self._k)
        answer = self._llm.last_answer
        self._remember(message, answer)
        nodes = [_node(c) for c in answer.chunks]
        return AgentChatResponse(response=answer.text, sources=self._sources(message, nodes), source_nodes=nodes,
                                 metadata=_info(answer))

    def _start(self, message: str,
               chat_history: list[ChatMessage] | None
               ) -> tuple[StreamingAgentChatResponse, Generator[ChatResponse, None, None]]:
        """Run the turn up to its first piece; the response and the generator of the remaining pieces."""
        llm = self._llm
        before = llm.last_answer
        stream = llm.stream_chat(self._messages(message, chat_history), retrieve=True, k=self._k)
        first = next(stream)  # retrieval, fusion and the first token: errors raise here, memory untouched
        response = StreamingAgentChatResponse(is_writing_to_memory=False)
        response.metadata = {}  # type: ignore[attr-defined]  # the report, as AgentChatResponse.metadata

        def publish() -> None:
            answer = llm.last_answer
            if answer is before:
                return  # kvrag has not handed over the answer yet
            if not response.source_nodes:
                response.source_nodes.extend(_node(c) for c in answer.chunks)
                response.sources.extend(self._sources(message, response.source_nodes))
            response.metadata.update(_info(answer))  # type: ignore[attr-defined]

        def rest() -> Generator[ChatResponse, None, None]:
            for item in itertools.chain([first], stream):
                if item.delta:
                    yield item
            publish()
            self._remember(message, llm.last_answer)

        publish()
        return response, rest()

    @trace_method("chat")
    def stream_chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> StreamingAgentChatResponse:
        """As `chat`, returning once the first piece is decoded; read ``response_gen`` for the text."""
        response, rest = self._start(message, chat_history)
        response.chat_stream = rest
        return response

    @trace_method("chat")
    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        """`chat` on the worker thread."""
        return await _in_worker(self.chat, message, chat_history)

    @trace_method("chat")
    async def astream_chat(self, message: str,
                           chat_history: list[ChatMessage] | None = None) -> StreamingAgentChatResponse:
        """`stream_chat`, each step on the worker thread; read ``async_response_gen()`` for the text."""
        response, rest = await _in_worker(self._start, message, chat_history)
        response.achat_stream = _aiter(rest)
        return response
