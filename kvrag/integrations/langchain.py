r"""LangChain adapter: `KVRetriever` (chunks as `Document`s), `KVCachedLLM` (answers a chain's prompt, reusing the
caches of the chunks it finds in it) and `ChatKVRag` (a chat model over `KVRag.chat`, defined in
`kvrag.integrations.langchain_chat`).

A LangChain LLM only ever sees a flat prompt string. `KVCachedLLM` hands it to `KVRag.stream_prompt`: the
stored chunk texts in it read their caches, the template's head is kept between calls, and the answer is made
as `KVRag.answer` makes it, by default under the correctness gate. Any stuff layout works; LangChain's own
``"\n\n".join(doc.page_content for doc in docs)`` reads every passage's cache::

    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from kvrag import KVRag
    from kvrag.integrations.langchain import KVCachedLLM, KVRetriever, format_docs

    rag = KVRag.open("./idx")
    retriever, llm = KVRetriever(rag=rag, k=4), KVCachedLLM(rag=rag)
    prompt = PromptTemplate.from_template("Question: {question}\nContext: {context}\nAnswer:")
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    chain.invoke("Who designed the alpha reactor?")

Each generation's ``generation_info`` describes its own call (``ttft_s``, ``chunk_ids``, ``mode``, ``gate``, …),
also under `batch` and `abatch`.

`ChatKVRag` takes LangChain messages instead: kvrag applies the model's chat template, fuses the
chunks retrieved for the last user message and reuses the conversation's KV across turns::

    from kvrag.integrations.langchain import ChatKVRag

    chat = ChatKVRag(rag=rag, k=4)
    chat.invoke("Who designed the alpha reactor?").response_metadata["chunks"]

Installed with ``pip install 'kvrag[langchain]'``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Iterator, Sequence
from functools import partial
from typing import Any

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.language_models.llms import LLM
    from langchain_core.outputs import Generation, GenerationChunk, LLMResult
    from langchain_core.retrievers import BaseRetriever
    from pydantic import ConfigDict, Field
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError(
        "kvrag.integrations.langchain needs langchain-core: pip install 'kvrag[langchain]'"
    ) from exc

from kvrag.integrations.fields import PromptFields
from kvrag.integrations.langchain_chat import ChatKVRag
from kvrag.integrations.prompt_llm import answer_metadata, stream_prompt_answer
from kvrag.query.answer import finish
from kvrag.rag import KVRag

__all__ = ["ChatKVRag", "KVCachedLLM", "KVRetriever", "format_docs"]


def format_docs(docs: Sequence[Document]) -> str:
    r"""Join retrieved documents the way kvrag stores chunks (``text.strip() + "\n\n"`` each).

    Every passage then reads its whole stored cache. LangChain's ``"\n\n".join(...)`` works as well (its
    last passage reads the first rows of its cache); a layout that changes a passage's tokens recomputes it.
    """
    return "".join(doc.page_content.strip() + "\n\n" for doc in docs)


class KVRetriever(BaseRetriever):
    """Retrieve kvrag chunks as `Document`s.

    ``metadata`` carries ``chunk_id`` (the chunk key), ``score``, ``source``, ``doc_id`` and ``seq``.
    ``invoke(query, k=...)`` overrides ``k`` for one call.

    Example:
        >>> KVRetriever(rag=KVRag.open("./idx"), k=4).invoke("Who?")  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: KVRag = Field(description="An opened `kvrag.KVRag`.")
    k: int = Field(default=4, gt=0, description="How many chunks to retrieve.")

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        chunks = self.rag.retrieve(query, k=k or self.k)
        return [
            Document(page_content=c.text, id=c.key, metadata={
                "chunk_id": c.key, "score": c.score, "source": c.source, "doc_id": c.doc_id, "seq": c.seq})
            for c in chunks
        ]


class KVCachedLLM(PromptFields, LLM):
    r"""A LangChain LLM over a kvrag index's model that reuses the caches of the chunks in its prompt.

    By default each answer is made as `KVRag.answer` makes it: under the correctness gate, which gives the full
    prefill's answer (``gate=GateConfig(fuse=True)`` fuses long prompts). ``mode``/``ratio`` fix a fusion mode (no
    gate unless ``gate=True``); ``mode="full"`` recomputes everything. Each generation's ``generation_info``
    reports its own call: ``ttft_s``, ``chunk_ids``, ``mode``, ``recompute_fraction``, ``prompt_tokens``,
    ``timings`` and ``gate``. ``last_answer`` holds the last call's `kvrag.Answer` (with concurrent calls, any one
    of them).

    Example:
        >>> llm = KVCachedLLM(rag=KVRag.open("./idx"))  # doctest: +SKIP
        >>> llm.invoke("Context:\n" + format_docs(docs) + "Question: Who?")  # doctest: +SKIP
    """

    def warm(self, documents: Sequence[Document | str], show_progress: bool = True) -> int:
        """Compute and store now the caches of ``documents`` (LangChain `Document`s or texts), as a vector store's
        ``add_documents`` takes them: later prompts that hold them read their caches from the first call. Needs
        the passage cache (``model=``); returns how many caches were stored.
        """
        texts = [d if isinstance(d, str) else d.page_content for d in documents]
        return int(self.backend.warm(texts, show_progress=show_progress))

    def warm_on_add(self, store: Any) -> Any:
        """Have ``store`` (any LangChain ``VectorStore``) warm what it is given from now on: after each
        ``add_documents`` or ``add_texts`` on it, the new texts' caches are computed and stored (`warm`), so the
        first prompt that holds them reads their caches. Returns ``store``; calling it twice changes nothing.
        Needs the passage cache (``model=``).
        """
        self.backend.warm([], show_progress=False)  # an index refuses here, in one line, before the store is changed
        if getattr(store, "_kvrag_warms", None) is not None:
            return store
        adding = threading.local()  # add_documents may call add_texts: warm once, at the outer call

        def warming(method: Any, texts_of: Any) -> Any:
            def added(items: Any, *args: Any, **kwargs: Any) -> Any:
                items = list(items)
                outer = not getattr(adding, "depth", 0)
                adding.depth = getattr(adding, "depth", 0) + 1
                try:
                    ids = method(items, *args, **kwargs)
                finally:
                    adding.depth -= 1
                if outer:
                    self.warm(texts_of(items), show_progress=False)
                return ids
            return added

        store.add_documents = warming(store.add_documents, lambda docs: [d.page_content for d in docs])
        store.add_texts = warming(store.add_texts, lambda texts: [str(t) for t in texts])
        store._kvrag_warms = self
        return store

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self.backend.describe(), "mode": self.mode,
                "ratio": self.ratio, "gate": repr(self.gate), "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "chat_template": self.chat_template}

    def _answer(self, prompt: str, stop: list[str] | None, **kwargs: Any) -> Generator[str, None, Any]:
        """Yield this call's text pieces; return its `kvrag.Answer`."""
        answer = yield from stream_prompt_answer(self.backend, prompt, self.chat_template, self.answer_options(),
                                                 {**kwargs, "stop": stop})
        self.last_answer = answer
        return answer

    def _complete(self, prompt: str, stop: list[str] | None, **kwargs: Any) -> Generation:
        answer = finish(self._answer(prompt, stop, **kwargs))
        return Generation(text=answer.text, generation_info=answer_metadata(answer))

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return self._complete(prompt, stop, **kwargs).text

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return LLMResult(generations=[[self._complete(p, stop, **kwargs)] for p in prompts])

    async def _agenerate(
        self, prompts: list[str], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> LLMResult:
        run = partial(self._generate, prompts, stop, None, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(None, run)

    def _stream(
        self, prompt: str, stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        pieces = self._answer(prompt, stop, **kwargs)
        while True:
            try:
                delta = next(pieces)
            except StopIteration as done:
                yield GenerationChunk(text="", generation_info=answer_metadata(done.value))
                return
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
