r"""LangChain adapter: `KVRetriever` (chunks as `Document`s), `KVCachedLLM` (fuses the chunks it finds) and
`ChatKVRag` (a chat model over `KVRag.chat`, defined in `kvrag.integrations.langchain_chat`).

A LangChain LLM only ever sees a flat prompt string. `KVCachedLLM` finds the stored chunk texts in
it (`kvrag.query.spans.find_chunk_spans`), reuses their caches and recomputes everything else
(`kvrag.query.flat`); with no chunk found it is an ordinary LLM over the same model. For the caches to
be usable, each chunk must appear as ``text.strip() + "\n\n"`` — use `format_docs`::

    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from kvrag import KVRag
    from kvrag.integrations.langchain import KVCachedLLM, KVRetriever, format_docs

    rag = KVRag.open("./idx")
    retriever, llm = KVRetriever(rag=rag, k=4), KVCachedLLM(rag=rag, ratio=0.15)
    prompt = PromptTemplate.from_template("Context:\n{context}Question: {question}")
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    chain.invoke("Who designed the alpha reactor?")
    llm.last_answer.chunks  # the chunks whose caches were fused

`ChatKVRag` takes LangChain messages instead: kvrag applies the model's chat template, fuses the
chunks retrieved for the last user message and reuses the conversation's KV across turns::

    from kvrag.integrations.langchain import ChatKVRag

    chat = ChatKVRag(rag=rag, k=4)
    chat.invoke("Who designed the alpha reactor?").response_metadata["chunks"]

Installed with ``pip install 'kvrag[langchain]'``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
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

from kvrag.integrations.langchain_chat import ChatKVRag

from kvrag.config import DEFAULT_MODE
from kvrag.query.flat import chat_prompt, stream_flat_prompt

__all__ = ["ChatKVRag", "KVCachedLLM", "KVRetriever", "format_docs"]


def format_docs(docs: Sequence[Document]) -> str:
    r"""Join retrieved documents the way kvrag stores chunks (``text.strip() + "\n\n"`` each).

    Any other layout still answers correctly, but the chunks' caches cannot be reused.
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

    rag: Any = Field(description="An opened `kvrag.KVRag`.")
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


class KVCachedLLM(LLM):
    r"""A LangChain LLM over a kvrag index's model that reuses the caches of the chunks in its prompt.

    After each call, ``last_answer`` holds the `kvrag.Answer` (chunks used, TTFT, recompute
    fraction) and ``generation_info`` reports ``ttft_s``, ``chunk_ids``, ``mode`` and
    ``recompute_fraction``.

    Example:
        >>> llm = KVCachedLLM(rag=KVRag.open("./idx"), mode="cacheblend", ratio=0.15)  # doctest: +SKIP
        >>> llm.invoke("Context:\n" + format_docs(docs) + "Question: Who?")  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: Any = Field(description="An opened `kvrag.KVRag`.")
    mode: str = Field(default=DEFAULT_MODE, description="full, prefix, reuse, cacheblend, probe or attnlink.")
    ratio: float = Field(default=0.15, gt=0.0, le=1.0, description="cacheblend's or probe's recompute ratio.")
    max_new_tokens: int = Field(default=64, gt=0, description="Most tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(default=None, description="Sampling seed (when temperature > 0).")
    chat_template: bool = Field(
        default=True, description="Wrap the prompt as the user turn of the model's chat template.")
    last_answer: Any = Field(default=None, exclude=True, description="The last call's `kvrag.Answer`.")

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"index": str(self.rag.path), "model": self.rag.lm.source, "mode": self.mode,
                "ratio": self.ratio, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "chat_template": self.chat_template}

    def _deltas(self, prompt: str, stop: list[str] | None, **kwargs: Any) -> Iterator[str]:
        text = chat_prompt(self.rag.lm.tokenizer, prompt) if self.chat_template else prompt
        options = {"mode": self.mode, "ratio": self.ratio, "max_new_tokens": self.max_new_tokens,
                   "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        options.update((k, v) for k, v in kwargs.items() if k in options)  # per-call overrides
        yield from stream_flat_prompt(self.rag, text, stop=tuple(stop or ()), **options)
        self.last_answer = self.rag.last_answer

    def _info(self) -> dict[str, Any]:
        a = self.last_answer
        return {"ttft_s": a.ttft_s, "chunk_ids": [c.key for c in a.chunks], "mode": a.mode,
                "recompute_fraction": a.recompute_fraction, "prompt_tokens": a.n_prompt_tokens,
                "timings": dict(a.timings)}

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return "".join(self._deltas(prompt, stop, **kwargs)).strip()

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        generations = []
        for p in prompts:
            text = self._call(p, stop, run_manager, **kwargs)
            generations.append([Generation(text=text, generation_info=self._info())])
        return LLMResult(generations=generations)

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
        for delta in self._deltas(prompt, stop, **kwargs):
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info())
