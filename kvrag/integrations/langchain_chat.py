r"""LangChain chat model over kvrag: `ChatKVRag`, a `BaseChatModel` over `KVRag.chat` / `KVRag.chat_stream`.

Contract:

- Messages: `SystemMessage`, `HumanMessage` and `AIMessage` (and `ChatMessage` with role ``system``,
  ``user`` or ``assistant``; ``developer``, ``human`` and ``ai`` are read as those) become kvrag's
  ``{"role", "content"}`` dicts (`to_kvrag_messages`): leading system messages are merged into one, a list
  content's text blocks are joined (reasoning blocks are left out; any other block raises `ValueError`),
  and kvrag applies the model's chat template itself. Other roles (tool, function) pass through and
  `KVRag.chat` rejects them with `kvrag.errors.InputError`, as it rejects a system message after the
  first message or a conversation that does not end with the user's message.
- Each call retrieves ``k`` chunks for the last user message and fuses their stored caches into that turn
  (``retrieve=False`` or ``k=0``: a plain chat turn), after the conversation's kept KV, which only the
  messages new since the last turn extend (``history_cache=False`` prefills the whole history). Answers
  are whitespace-trimmed (as kvrag keeps them), so an `AIMessage` sent back in the next turn matches the
  kept KV token for token.
- Every call may override ``k``, ``mode``, ``ratio``, ``retrieve``, ``max_new_tokens`` (or
  ``max_tokens``), ``temperature``, ``top_p``, ``seed`` and ``history_cache``, and pass ``gate`` or
  ``chunks`` (chunk keys to fuse instead of retrieving) on to `KVRag.chat`; ``stop`` replaces the
  model's ``stop``. ``model`` may only name the index's own model (its caches belong to it); other keyword
  arguments are ignored. Tool calling and structured output are not offered: ``bind_tools`` and
  ``with_structured_output`` raise `NotImplementedError`.
- Output: `AIMessage` with ``usage_metadata`` (``input_tokens`` = `Answer.n_prompt_tokens`,
  ``output_tokens`` = generated token ids, ``input_token_details.cache_read`` = history tokens whose kept
  KV was reused) and ``response_metadata``: ``model_name``, ``finish_reason``, ``chunks`` (fused chunk
  keys), ``sources``, ``ttft_s``, ``mode``, ``ratio``, ``recompute_fraction`` and ``history``
  (`HistoryReport.to_json()`, or None). Streaming yields one `AIMessageChunk` per text piece (token
  callbacks fire per piece) and a last empty chunk (``chunk_position="last"``) carrying the usage and the
  response metadata. ``last_answer`` holds the last call's `kvrag.Answer`.
- Without an index, ``ChatKVRag(model=..., cache=...)`` answers over a `kvrag.passages.PassageCache`: the chain
  puts the passages in the messages (a system message of context, say), and each call finds them there, reads
  the caches of those seen before and stores the others after the answer; ``k``, ``retrieve`` and
  ``history_cache`` then do nothing.
- `KVRag` is not thread-safe: calls on the same index wait for each other (one lock per index, held for
  a whole call or stream). Async calls run the sync work off the event loop; an async stream runs all of
  its model steps on one thread of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models import BaseChatModel, LangSmithParams
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        ChatMessage,
        HumanMessage,
        SystemMessage,
    )
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables.config import run_in_executor
    from pydantic import ConfigDict, Field
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError(
        "kvrag.integrations.langchain_chat needs langchain-core: pip install 'kvrag[langchain]'"
    ) from exc

from kvrag.backend import AnswerBackend
from kvrag.generation.trimmed import trimmed
from kvrag.integrations.fields import CHAT_OPTIONS, ChatFields

__all__ = ["ChatKVRag", "to_kvrag_messages"]

_PASSED = ("chunks",)  # per call only, handed to `KVRag.chat` as it is
_ROLES = {"human": "user", "ai": "assistant", "developer": "system"}
_SKIPPED_BLOCKS = ("reasoning", "thinking")


class _IndexLock:
    """Keeps calls on one index from overlapping. A plain `Lock` underneath (an async stream releases it on
    its own thread, a sync stream wherever its generator is closed); a call from the thread that holds it
    (e.g. an invoke while a stream on the same index is still being read) raises instead of waiting forever.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> None:
        if self._owner == threading.get_ident():
            raise RuntimeError("a ChatKVRag call on this index is still running in this thread (a stream not "
                               "read to the end?); kvrag runs one call per index at a time")
        self._lock.acquire()
        self._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()


_locks: weakref.WeakKeyDictionary[Any, _IndexLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()
_shared_lock = _IndexLock()


def _lock(rag: AnswerBackend) -> _IndexLock:
    """The lock of ``rag`` (one per index object)."""
    with _locks_guard:
        try:
            return _locks.setdefault(rag, _IndexLock())
        except TypeError:  # neither hashable nor weakly referenceable: one lock for all such objects
            return _shared_lock


def _text(content: str | list[Any], i: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif not (isinstance(block, dict) and block.get("type") in _SKIPPED_BLOCKS):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"message {i} holds a {kind!r} block; ChatKVRag takes text messages only")
    return "".join(parts)


def to_kvrag_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as kvrag's ``{"role", "content"}`` dicts (see the module contract).

    Raises:
        ValueError: a message holds a block other than text (an image, audio, a tool call...).
    """
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if isinstance(message, (SystemMessage, HumanMessage, AIMessage)):  # chunks too
            role = "system" if isinstance(message, SystemMessage) else "user" if isinstance(
                message, HumanMessage) else "assistant"
        else:  # ChatMessage's own role; tool, function... as LangChain names them
            role = message.role if isinstance(message, ChatMessage) else message.type
            role = _ROLES.get(role, role)
        content = _text(message.content, i)
        if role == "system" and out and all(m["role"] == "system" for m in out):  # leading system messages
            out[0]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    return out


class ChatKVRag(ChatFields, BaseChatModel):
    """A LangChain chat model over a kvrag index: retrieved chunks' caches fused, the conversation's KV reused.

    Example:
        >>> from langchain_core.messages import AIMessage, HumanMessage
        >>> chat = ChatKVRag(rag=KVRag.open("./idx"), k=4)  # doctest: +SKIP
        >>> first = chat.invoke([HumanMessage("Who designed the alpha reactor?")])  # doctest: +SKIP
        >>> first.response_metadata["chunks"]  # the fused chunks' keys  # doctest: +SKIP
        >>> again = chat.invoke([HumanMessage("Who designed the alpha reactor?"), first,
        ...                      HumanMessage("When?")])  # doctest: +SKIP
        >>> again.response_metadata["history"]["reused_tokens"]  # the first turn's KV, reused  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    streaming: bool = Field(default=False, description="Generate through the stream even on invoke.")

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    @property
    def model_name(self) -> str:
        """The index's model (as it was named when loaded)."""
        return str(self.backend.lm.source)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self.backend.describe(), **self.chat_options(), "gate": repr(self.gate)}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="kvrag", ls_model_name=kwargs.get("model") or self.model_name,
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens",
                                                                                       self.max_new_tokens)))
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or ())
        return params

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`KVRag.chat`'s keyword arguments for one call: the fields, then the call's overrides."""
        model = kwargs.get("model")
        if model is not None and model != self.model_name:
            raise ValueError(f"ChatKVRag answers with its index's model {self.model_name!r}, not {model!r}: "
                             "the stored caches belong to that model")
        options = self.chat_options()
        if "max_tokens" in kwargs:
            options["max_new_tokens"] = kwargs["max_tokens"]
        options.update((name, value) for name, value in kwargs.items() if name in CHAT_OPTIONS + _PASSED)
        options["stop"] = tuple(stop if stop is not None else self.stop or ())
        return options

    def _message(self, answer: Any, options: dict[str, Any], chunk: bool = False) -> AIMessage | AIMessageChunk:
        """The answer's text, usage and report as a message (an empty last chunk with ``chunk``)."""
        history = answer.history
        usage: Any = {"input_tokens": answer.n_prompt_tokens, "output_tokens": len(answer.token_ids),
                                 "total_tokens": answer.n_prompt_tokens + len(answer.token_ids)}
        if history is not None:
            usage["input_token_details"] = {"cache_read": history.reused_tokens}
        finish = "length" if len(answer.token_ids) >= options["max_new_tokens"] else "stop"
        metadata = {"model_name": self.model_name, "finish_reason": finish,
                    "chunks": [c.key for c in answer.chunks], "sources": [c.source for c in answer.chunks],
                    "ttft_s": answer.ttft_s, "mode": answer.mode, "ratio": answer.ratio,
                    "recompute_fraction": answer.recompute_fraction,
                    "gate": None if answer.gate is None else answer.gate.to_json(),
                    "history": None if history is None else history.to_json()}
        if chunk:
            return AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata,
                                  chunk_position="last")
        return AIMessage(content=answer.text, usage_metadata=usage, response_metadata=metadata)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        converted, options = to_kvrag_messages(messages), self._options(stop, kwargs)
        with _lock(self.backend):
            answer = self.backend.chat(converted, **options)
        self.last_answer = answer
        return ChatResult(generations=[ChatGeneration(message=self._message(answer, options))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await run_in_executor(None, self._generate, messages, stop, None, **kwargs)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Generator[ChatGenerationChunk, None, None]:
        converted, options = to_kvrag_messages(messages), self._options(stop, kwargs)
        rag = self.backend
        with _lock(rag):  # held until the stream ends or its generator is closed
            for piece in trimmed(rag.chat_stream(converted, **options)):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            answer = rag.last_answer
        self.last_answer = answer
        last = self._message(answer, options, chunk=True)
        assert isinstance(last, AIMessageChunk)
        yield ChatGenerationChunk(message=last)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[ChatGenerationChunk | None, BaseException | None]] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: tuple[ChatGenerationChunk | None, BaseException | None]) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                return False

        def produce() -> None:  # every model step of this stream on this one thread
            chunks, error = self._stream(messages, stop, None, **kwargs), None
            try:
                for chunk in chunks:
                    if cancelled.is_set() or not put((chunk, None)):
                        break
            except BaseException as exc:  # handed to the consumer, which raises it
                error = exc
            finally:
                chunks.close()  # releases the index's lock here, on this thread
            put((None, error))

        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(produce,), name="kvrag-chat-stream", daemon=True).start()
        try:
            while True:
                chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    return
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            cancelled.set()  # a consumer that stops early frees the thread (and the lock) after its next piece
