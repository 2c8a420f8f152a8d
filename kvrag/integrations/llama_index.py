"""LlamaIndex adapter: `KVRetriever` (chunks as nodes), `KVCachedLLM` and `KVRagQueryEngine`.

`KVCachedLLM` gets a flat prompt from LlamaIndex's synthesizers and hands it to `KVRag.stream_prompt`: the
stored chunk texts in it read their caches, the template's head is kept between calls, and the answer is made
as `KVRag.answer` makes it, by default under the correctness gate. Any query engine works, e.g.
``RetrieverQueryEngine.from_args(retriever, llm=llm)`` with LlamaIndex's default template. `KVRagQueryEngine` is
the direct path: it hands the retrieved chunk ids straight to `KVRag.answer` (`KVRag.stream` with
``streaming=True``), with no text search::

    from kvrag import KVRag
    from kvrag.integrations.llama_index import KVCachedLLM, KVRagQueryEngine, KVRetriever

    rag = KVRag.open("./idx")
    retriever, llm = KVRetriever(rag=rag, k=4), KVCachedLLM(rag=rag, ratio=0.15)
    KVRagQueryEngine(retriever=retriever, llm=llm).query("Who designed the alpha reactor?")

For conversations, `KVRagChatLLM` (a chat LLM over `KVRag.chat`) and `KVRagChatEngine` (a chat engine
that fuses each turn's retrieved chunks after the conversation's reused KV) are defined in
`kvrag.integrations.llama_index_chat` and importable from here too.

Installed with ``pip install 'kvrag[llamaindex]'``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

try:
    from llama_index.core.base.response.schema import Response, StreamingResponse
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
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode, TransformComponent
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError(
        "kvrag.integrations.llama_index needs llama-index-core: pip install 'kvrag[llamaindex]'"
    ) from exc

from kvrag.config import GenerateConfig
from kvrag.generation.trimmed import trimmed
from kvrag.integrations.fields import PromptFields
from kvrag.integrations.prompt_llm import answer_metadata, stream_prompt_answer
from kvrag.lazy import lazy_exports
from kvrag.query.answer import finish
from kvrag.rag import KVRag

# The chat classes are defined in `kvrag.integrations.llama_index_chat` and loaded on first use (`__getattr__`).
__all__ = ["KVCacheWarmer", "KVCachedLLM", "KVRagChatEngine", "KVRagChatLLM", "KVRagQueryEngine", "KVRetriever"]  # noqa: F822

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

    def __init__(self, rag: KVRag, k: int = 4, callback_manager: CallbackManager | None = None,
                 verbose: bool = False) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.rag, self.k = rag, k
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [_node(c) for c in self.rag.retrieve(query_bundle.query_str, k=self.k)]


class KVCachedLLM(PromptFields, CustomLLM):
    """A LlamaIndex LLM over a kvrag index's model that reuses the caches of the chunks in its prompt.

    By default each answer is made as `KVRag.answer` makes it: under the correctness gate, the full prefill's answer
    (``gate=GateConfig(fuse=True)`` fuses long prompts).
    ``mode``/``ratio`` fix a fusion mode (no gate unless ``gate=True``); ``mode="full"`` recomputes everything.
    ``CompletionResponse.additional_kwargs`` reports the call's own ``ttft_s``, ``chunk_ids``, ``mode``,
    ``recompute_fraction``, ``prompt_tokens``, ``timings`` and ``gate``; ``last_answer`` holds the last call's
    `kvrag.Answer` (with concurrent calls, any one of them).

    Example:
        >>> llm = KVCachedLLM(rag=KVRag.open("./idx"))  # doctest: +SKIP
        >>> RetrieverQueryEngine.from_args(KVRetriever(rag=llm.rag), llm=llm).query("Who?")  # doctest: +SKIP
    """

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name for this class (used when serialising)."""
        return "kvrag_cached_llm"

    @property
    def metadata(self) -> LLMMetadata:
        """The model's context window and this LLM's output budget, as LlamaIndex's synthesizers read them."""
        lm = self.backend.lm
        return LLMMetadata(context_window=lm.spec.max_position, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=lm.source)

    def _answer(self, prompt: str, **kwargs: Any) -> Generator[str, None, Any]:
        """Yield this call's text pieces; return its `kvrag.Answer`."""
        answer = yield from stream_prompt_answer(self.backend, prompt, self.chat_template, self.answer_options(),
                                                 kwargs)
        self.last_answer = answer
        return answer

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt``, reusing the caches of the stored chunks found in it."""
        answer = finish(self._answer(prompt, **kwargs))
        return CompletionResponse(text=answer.text, additional_kwargs=answer_metadata(answer))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """As `complete`, yielding a response per text piece; the last one carries the report."""

        def gen() -> CompletionResponseGen:
            text = ""
            pieces = self._answer(prompt, **kwargs)
            while True:
                try:
                    delta = next(pieces)
                except StopIteration as done:
                    yield CompletionResponse(text=text, delta="", additional_kwargs=answer_metadata(done.value))
                    return
                text += delta
                yield CompletionResponse(text=text, delta=delta)

        return gen()


class KVCacheWarmer(TransformComponent):
    """An ingestion step that computes and stores the passage caches of the nodes it passes on unchanged.

    For a `KVCachedLLM` over a passage cache (``model=``): a node's text as LlamaIndex puts it in a prompt
    (``get_content(MetadataMode.LLM)``) is read from its cache from the first query. Use it last in an
    ``IngestionPipeline(transformations=[splitter, embed_model, KVCacheWarmer(llm=llm)])``, or call it on an existing
    index's nodes: ``KVCacheWarmer(llm=llm)(list(index.docstore.docs.values()))``.
    """

    llm: Any = Field(description="A `KVCachedLLM` made with model= (a passage cache).")
    show_progress: bool = Field(default=False, description="Show a progress bar while computing.")

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Store the nodes' caches; return the nodes unchanged."""
        self.llm.backend.warm([node.get_content(metadata_mode=MetadataMode.LLM) for node in nodes],
                 show_progress=self.show_progress or bool(kwargs.get("show_progress")))
        return nodes


class KVRagQueryEngine(CustomQueryEngine):
    """Retrieve with a `KVRetriever`, then answer with the chunk ids passed straight to fusion.

    The response's ``metadata`` holds ``ttft_s``, ``chunk_ids``, ``mode``, ``recompute_fraction`` and ``gate``.
    With ``streaming=True`` the query returns a `StreamingResponse` whose ``response_gen`` yields the
    answer's text as it is decoded (its pieces join to the non-streaming answer); its ``metadata`` is
    filled in once the first piece has arrived.

    Example:
        >>> retriever, llm = KVRetriever(rag=rag), KVCachedLLM(rag=rag)  # doctest: +SKIP
        >>> engine = KVRagQueryEngine(retriever=retriever, llm=llm)  # doctest: +SKIP
        >>> engine.query("Who?").metadata["chunk_ids"]  # doctest: +SKIP
        >>> streaming = KVRagQueryEngine(retriever=retriever, llm=llm, streaming=True)  # doctest: +SKIP
        >>> streaming.query("Who?").print_response_stream()  # doctest: +SKIP
    """

    retriever: Any = Field(description="A `KVRetriever`.")
    llm: Any = Field(description="A `KVCachedLLM` (its mode, ratio, gate and decoding settings are used).")
    streaming: bool = Field(default=False, description="Return a `StreamingResponse` that yields text pieces.")

    def _options(self, keys: list[str]) -> dict[str, Any]:
        llm = self.llm
        return {"chunks": keys, "mode": llm.mode, "ratio": llm.ratio, "gate": llm.gate}

    def _generate(self) -> GenerateConfig:
        llm = self.llm
        return GenerateConfig(max_new_tokens=llm.max_new_tokens, temperature=llm.temperature, top_p=llm.top_p,
                              seed=llm.seed)

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        """Retrieve, then answer from the retrieved chunks' caches (streamed with ``streaming=True``)."""
        nodes = self.retriever.retrieve(query_str)
        keys = [n.node.metadata["chunk_id"] for n in nodes]
        if self.streaming:
            info: dict[str, Any] = {}
            return StreamingResponse(response_gen=self._stream(query_str, keys, info), source_nodes=nodes,
                                     metadata=info)
        answer = self.retriever.rag.prepare(query_str, **self._options(keys)).generate(self._generate())
        self.llm.last_answer = answer
        return Response(response=answer.text, source_nodes=nodes, metadata=answer_metadata(answer))

    def _stream(self, query_str: str, keys: list[str], info: dict[str, Any]) -> Generator[str, None, None]:
        """Yield kvrag's text pieces, trimmed as `Answer.text` is (no leading or trailing whitespace)."""
        fused = self.retriever.rag.prepare(query_str, **self._options(keys))

        def publish() -> None:
            self.llm.last_answer = fused.answer
            info.update(answer_metadata(fused.answer))

        def pieces() -> Iterator[str]:
            for piece in fused.stream(self._generate()):
                if not info:
                    publish()  # the answer exists (and its TTFT is known) once the first piece is out
                yield piece

        yield from trimmed(pieces())
        publish()


# The chat classes live in `kvrag.integrations.llama_index_chat`, which imports this module.
__getattr__ = lazy_exports(__name__, dict.fromkeys(("KVRagChatEngine", "KVRagChatLLM"),
                                                   "kvrag.integrations.llama_index_chat"))
