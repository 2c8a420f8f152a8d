"""LlamaIndex adapter: `KVRetriever` (chunks as nodes), `KVCachedLLM` and `KVRagQueryEngine`.

`KVCachedLLM` gets a flat prompt from LlamaIndex's synthesizers; it finds the stored chunk texts
in it (`kvrag.query.spans`), reuses their caches and recomputes the rest (`kvrag.query.flat`) — any query
engine works, e.g. ``RetrieverQueryEngine.from_args(retriever, llm=llm)``. `KVRagQueryEngine` is
the direct path: it hands the retrieved chunk ids straight to `KVRag.answer`, with no text search::

    from kvrag import KVRag
    from kvrag.integrations.llama_index import KVCachedLLM, KVRagQueryEngine, KVRetriever

    rag = KVRag.open("./idx")
    retriever, llm = KVRetriever(rag=rag, k=4), KVCachedLLM(rag=rag, ratio=0.15)
    KVRagQueryEngine(retriever=retriever, llm=llm).query("Who designed the alpha reactor?")

Installed with ``pip install 'kvrag[llamaindex]'``.
"""

from __future__ import annotations

from typing import Any

try:
    from llama_index.core.base.response.schema import Response
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.llms import (
        CompletionResponse,
        CompletionResponseGen,
        CustomLLM,
        LLMMetadata,
    )
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError(
        "kvrag.integrations.llama_index needs llama-index-core: pip install 'kvrag[llamaindex]'"
    ) from exc

from kvrag.config import DEFAULT_MODE
from kvrag.query.flat import chat_prompt, stream_flat_prompt

__all__ = ["KVCachedLLM", "KVRagQueryEngine", "KVRetriever"]

_META_KEYS = ["chunk_id", "score", "source", "doc_id", "seq"]


def _node(chunk: Any) -> NodeWithScore:
    # Metadata stays out of the LLM's text, so the prompt holds the chunk's exact text.
    node = TextNode(
        id_=chunk.key, text=chunk.text,
        metadata={"chunk_id": chunk.key, "score": chunk.score, "source": chunk.source,
                  "doc_id": chunk.doc_id, "seq": chunk.seq},
        excluded_llm_metadata_keys=list(_META_KEYS), excluded_embed_metadata_keys=list(_META_KEYS),
    )
    return NodeWithScore(node=node, score=chunk.score)


class KVRetriever(BaseRetriever):
    """Retrieve kvrag chunks as `NodeWithScore`s (node id and ``metadata["chunk_id"]`` = chunk key).

    Example:
        >>> KVRetriever(rag=KVRag.open("./idx"), k=4).retrieve("Who?")  # doctest: +SKIP
    """

    def __init__(self, rag: Any, k: int = 4, callback_manager: CallbackManager | None = None,
                 verbose: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.rag, self.k = rag, k
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [_node(c) for c in self.rag.retrieve(query_bundle.query_str, k=self.k)]


class KVCachedLLM(CustomLLM):
    """A LlamaIndex LLM over a kvrag index's model that reuses the caches of the chunks in its prompt.

    After each call, ``last_answer`` holds the `kvrag.Answer`; ``CompletionResponse.additional_kwargs``
    reports ``ttft_s``, ``chunk_ids``, ``mode`` and ``recompute_fraction``.

    Example:
        >>> llm = KVCachedLLM(rag=KVRag.open("./idx"), mode="cacheblend", ratio=0.15)  # doctest: +SKIP
        >>> RetrieverQueryEngine.from_args(KVRetriever(rag=llm.rag), llm=llm).query("Who?")  # doctest: +SKIP
    """

    rag: Any = Field(description="An opened `kvrag.KVRag`.")
    mode: str = Field(default=DEFAULT_MODE, description="full, prefix, reuse, cacheblend, probe or attnlink.")
    ratio: float = Field(default=0.15, gt=0.0, le=1.0, description="cacheblend's or probe's recompute ratio.")
    max_new_tokens: int = Field(default=64, gt=0, description="Most tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    chat_template: bool = Field(
        default=True, description="Wrap the prompt as the user turn of the model's chat template.")
    last_answer: Any = Field(default=None, exclude=True, description="The last call's `kvrag.Answer`.")

    @classmethod
    def class_name(cls) -> str:
        return "kvrag_cached_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.rag.lm.spec.max_position, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=self.rag.lm.source)

    def _deltas(self, prompt: str, **kwargs: Any) -> Any:
        text = chat_prompt(self.rag.lm.tokenizer, prompt) if self.chat_template else prompt
        options: dict[str, Any] = {"mode": self.mode, "ratio": self.ratio,
                                   "max_new_tokens": self.max_new_tokens, "temperature": self.temperature}
        options.update((k, v) for k, v in kwargs.items() if k in ("mode", "ratio", "max_new_tokens", "stop"))
        yield from stream_flat_prompt(self.rag, text, **options)
        self.last_answer = self.rag.last_answer

    def _info(self) -> dict[str, Any]:
        a = self.last_answer
        return {"ttft_s": a.ttft_s, "chunk_ids": [c.key for c in a.chunks], "mode": a.mode,
                "recompute_fraction": a.recompute_fraction, "prompt_tokens": a.n_prompt_tokens}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text = "".join(self._deltas(prompt, **kwargs)).strip()
        return CompletionResponse(text=text, additional_kwargs=self._info())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            text = ""
            for delta in self._deltas(prompt, **kwargs):
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=text, delta="", additional_kwargs=self._info())

        return gen()


class KVRagQueryEngine(CustomQueryEngine):
    """Retrieve with a `KVRetriever`, then answer with the chunk ids passed straight to fusion.

    The response's ``metadata`` holds ``ttft_s``, ``chunk_ids``, ``mode`` and ``recompute_fraction``.

    Example:
        >>> retriever, llm = KVRetriever(rag=rag), KVCachedLLM(rag=rag)  # doctest: +SKIP
        >>> engine = KVRagQueryEngine(retriever=retriever, llm=llm)  # doctest: +SKIP
        >>> engine.query("Who?").metadata["chunk_ids"]  # doctest: +SKIP
    """

    retriever: Any = Field(description="A `KVRetriever`.")
    llm: Any = Field(description="A `KVCachedLLM` (its mode, ratio and max_new_tokens are used).")

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        keys = [n.node.metadata["chunk_id"] for n in nodes]
        llm = self.llm
        answer = llm.rag.answer(query_str, chunks=keys, mode=llm.mode, ratio=llm.ratio,
                                max_new_tokens=llm.max_new_tokens, temperature=llm.temperature)
        llm.last_answer = answer
        info = {"ttft_s": answer.ttft_s, "chunk_ids": [c.key for c in answer.chunks], "mode": answer.mode,
                "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.n_prompt_tokens}
        return Response(response=answer.text, source_nodes=nodes, metadata=info)

