"""The arms of the traffic benchmark: one framework pipeline each, over the user's own vector store, timed alike.

Contract:

- `Retrievers` opens the user's vector stores from disk (written by `build_stores`): LangChain's ``FAISS`` and
  LlamaIndex's ``VectorStoreIndex`` (its default ``SimpleVectorStore``), both over ``HuggingFaceEmbeddings`` of
  all-MiniLM-L6-v2 (kvrag's offline copy), one document (node) per corpus passage, so both hold the same texts as
  the kvrag index.
- Every arm of one framework runs that framework's own recipe over the same retriever, so all arms see the same
  prompt for a question; only the LLM differs:
  - ``langchain``: the tutorial chain ``{"context": retriever | format_docs, "question": RunnablePassthrough()} |
    prompt | llm | StrOutputParser()`` with the documented RAG prompt (``rlm/rag-prompt``: question before context);
  - ``llamaindex``: ``index.as_query_engine(llm=llm, similarity_top_k=k, streaming=True)`` (the default text-QA
    template: context before question).
- `ARMS` are the LLMs: ``full`` (``KVCachedLLM(mode="full")``: a plain prefill of the prompt, nothing kept or read);
  ``llama.cpp`` (the same templated prompt text streamed from llama.cpp's server, `LlamaServer`, one server per
  framework, as one application runs one framework, so neither evicts the other's prompts); ``prefix-index``
  and ``prefix-passages`` (a plain prefix cache: kvrag with fusion off, `PREFIX_GATE`, over the index or over a
  passage cache); ``kvrag-index`` and ``kvrag-passages`` (kvrag's default gate: long prompts prefilled in full
  unless read in place or kept); ``fuse-index`` and ``fuse-passages`` (fusion opted into, `FUSE_GATE`). A passage
  arm named ``NAME@SIZE`` (``fuse-passages@400MB``) bounds its store to SIZE, beside the same arm unbounded.
  Every kvrag arm has its own backend object (its own kept heads and prompts, decoded tier and, for a passage
  cache, its own store), sharing only the loaded model, so no arm reads what another kept.
- `timed` streams one answer: TTFT to the first piece with more than whitespace, from the framework call (query
  embedding, retrieval, prompt formatting included); the answer; the passages retrieved; prompt tokens and the share
  of them read from a cache (kvrag: 1 - `Answer.recompute_fraction`, token-layers recomputed over all; llama.cpp:
  tokens its server reported cached over the prompt's); and what the gate decided.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrag.config import GateConfig

FRAMEWORKS = ("langchain", "llamaindex")
ARMS = ("full", "llama.cpp", "prefix-index", "prefix-passages", "kvrag-index", "kvrag-passages", "fuse-index",
        "fuse-passages")
# a plain prefix cache: no prompt counts as long enough to fuse, and a short one is prefilled in full after the kept
# prompt or head rows it starts with; a passage cache's rows read in place (`LaidOut.in_place`) are still read, as
# `kvrag.query.answer_plan.plan_answer` checks them first
PREFIX_GATE = GateConfig(full_below_tokens=1 << 30, short_mode="full")
FUSE_GATE = GateConfig(fuse=True)  # fusion opted into: prompts of 512 stale tokens or more are fused
# LangChain's documented RAG prompt (the hub's rlm/rag-prompt), as benchmarks/frameworks uses it
RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question. If you don't know the answer, just say that you don't know. Use three "
              "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
WARM_UP_CONTEXT = ("This paragraph only warms the process up before the stream starts; it is not in the corpus and "
                   "no question asks about it.")
WARM_UP_QUESTION = "What is this paragraph for?"


def embeddings() -> Any:
    """The user's embedder: ``HuggingFaceEmbeddings`` of all-MiniLM-L6-v2 (kvrag's offline copy)."""
    from langchain_community.embeddings import HuggingFaceEmbeddings

    from kvrag.embedder import resolve_embedder

    return HuggingFaceEmbeddings(model_name=resolve_embedder(None))


def llamaindex_embedding(model: Any) -> Any:
    """The same embedder as a LlamaIndex ``BaseEmbedding``."""
    from llama_index.core.embeddings import BaseEmbedding

    class MiniLM(BaseEmbedding):  # type: ignore[misc]
        def _get_query_embedding(self, query: str) -> list[float]:
            return list(model.embed_query(query))

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return list(model.embed_documents([text])[0])

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return [list(v) for v in model.embed_documents(texts)]

    return MiniLM()


def build_stores(passages: list[tuple[str, str]], folder: Path) -> dict[str, float]:
    """Embed the passages once and write both vector stores under ``folder`` (``faiss/``, ``llamaindex/``)."""
    from langchain_community.vectorstores import FAISS
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode

    model = embeddings()
    t0 = time.perf_counter()
    texts = [text for _, text in passages]
    vectors = model.embed_documents(texts)
    t1 = time.perf_counter()
    store = FAISS.from_embeddings(list(zip(texts, vectors)), model, metadatas=[{"id": i} for i, _ in passages])
    store.save_local(str(folder / "faiss"))
    nodes = [TextNode(text=text, id_=pid, embedding=list(v)) for (pid, text), v in zip(passages, vectors)]
    index = VectorStoreIndex(nodes, embed_model=llamaindex_embedding(model),
                             storage_context=StorageContext.from_defaults())
    index.storage_context.persist(persist_dir=str(folder / "llamaindex"))
    return {"embed_s": t1 - t0, "stores_s": time.perf_counter() - t1}


class Retrievers:
    """The user's two vector stores, opened from disk, and the embedder they share."""

    def __init__(self, folder: Path) -> None:
        from langchain_community.vectorstores import FAISS
        from llama_index.core import StorageContext, load_index_from_storage

        self.model = embeddings()
        self.faiss = FAISS.load_local(str(folder / "faiss"), self.model, allow_dangerous_deserialization=True)
        context = StorageContext.from_defaults(persist_dir=str(folder / "llamaindex"))
        self.llamaindex = load_index_from_storage(context, embed_model=llamaindex_embedding(self.model))


def llama_langchain(server: Any, template: Callable[[str], str], max_new_tokens: int) -> Any:
    """A LangChain LLM that streams the prompt, in the model's chat template, from llama.cpp's server."""
    from langchain_core.language_models.llms import LLM
    from langchain_core.outputs import GenerationChunk

    class LlamaServerLLM(LLM):  # type: ignore[misc]
        @property
        def _llm_type(self) -> str:
            return "llama.cpp-server"

        def _call(self, prompt: str, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> str:
            return "".join(server.stream(template(prompt), max_new_tokens))

        def _stream(self, prompt: str, stop: Any = None, run_manager: Any = None,
                    **kwargs: Any) -> Iterator[GenerationChunk]:
            for piece in server.stream(template(prompt), max_new_tokens):
                yield GenerationChunk(text=piece)

    return LlamaServerLLM()


def llama_llamaindex(server: Any, template: Callable[[str], str], max_new_tokens: int, context_window: int) -> Any:
    """A LlamaIndex LLM that streams from llama.cpp's server; its metadata are kvrag's LLM's, so LlamaIndex packs
    the same prompt for both.
    """
    from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata
    from llama_index.core.llms.callbacks import llm_completion_callback

    class LlamaServerLLM(CustomLLM):  # type: ignore[misc]
        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=context_window, num_output=max_new_tokens, is_chat_model=False,
                               model_name="llama.cpp")

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            return CompletionResponse(text="".join(server.stream(template(prompt), max_new_tokens)))

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
            def gen() -> Iterator[CompletionResponse]:
                text = ""
                for piece in server.stream(template(prompt), max_new_tokens):
                    text += piece
                    yield CompletionResponse(text=text, delta=piece)

            return gen()

    return LlamaServerLLM()


@dataclass
class Arm:
    """One (framework, arm): ``ask`` streams the answer to a question and fills ``seen`` with the passages
    retrieved; ``llm`` is the framework LLM; ``backend`` the kvrag object behind it (None for llama.cpp).
    """

    framework: str
    name: str
    llm: Any
    backend: Any
    ask: Callable[[str], Iterator[str]]
    warm: Callable[[], str]
    seen: dict[str, Any] = field(default_factory=dict)
    server: Any = None  # llama.cpp's server (`llama_server.LlamaServer`) for the llama.cpp arm


def langchain_arm(name: str, llm: Any, backend: Any, retrievers: Retrievers, k: int) -> Arm:
    """The LangChain tutorial chain over the user's FAISS retriever with ``llm``."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    seen: dict[str, Any] = {}

    def format_docs(docs: list[Any]) -> str:  # the tutorial's, noting what was retrieved
        seen["passages"] = [d.page_content for d in docs]
        return "\n\n".join(doc.page_content for doc in docs)

    prompt = PromptTemplate.from_template(RAG_PROMPT)
    retriever = retrievers.faiss.as_retriever(search_kwargs={"k": k})
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    def warm() -> str:
        return str(llm.invoke(prompt.format(question=WARM_UP_QUESTION, context=WARM_UP_CONTEXT)))

    return Arm("langchain", name, llm, backend, lambda q: iter(chain.stream(q)), warm, seen)


def llamaindex_arm(name: str, llm: Any, backend: Any, retrievers: Retrievers, k: int) -> Arm:
    """LlamaIndex's default query engine over the user's ``VectorStoreIndex`` with ``llm``, streaming."""
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT

    engine = retrievers.llamaindex.as_query_engine(llm=llm, similarity_top_k=k, streaming=True)
    seen: dict[str, Any] = {}

    def ask(question: str) -> Iterator[str]:
        response = engine.query(question)
        seen["passages"] = [n.node.get_content() for n in response.source_nodes]
        return iter(response.response_gen)

    def warm() -> str:
        text = DEFAULT_TEXT_QA_PROMPT.format(context_str=WARM_UP_CONTEXT, query_str=WARM_UP_QUESTION)
        return str(llm.complete(text).text)

    return Arm("llamaindex", name, llm, backend, ask, warm, seen)


def open_arms(frameworks: list[str], arms: list[str], lm: Any, index: Path, caches: Path, retrievers: Retrievers,
              k: int, max_new_tokens: int, servers: dict[str, Any]) -> list[Arm]:
    """Every (framework, arm) asked for, each kvrag arm over a backend of its own and each framework's llama.cpp arm
    over a server of its own, ``servers[framework]`` (module docstring).
    """
    from kvrag.integrations import langchain as lc
    from kvrag.integrations import llama_index as li
    from kvrag.passages import PassageCache
    from kvrag.query.locate import chat_prompt
    from kvrag.rag import KVRag

    out = []
    for fw in frameworks:
        llm_class = lc.KVCachedLLM if fw == "langchain" else li.KVCachedLLM
        make = langchain_arm if fw == "langchain" else llamaindex_arm
        for name in arms:
            settings: dict[str, Any] = {"max_new_tokens": max_new_tokens}
            if name == "llama.cpp":
                server = servers.get(fw)
                if server is None:
                    continue
                template = lambda prompt: chat_prompt(lm.tokenizer, prompt)  # noqa: E731 - kvrag's own wrapping
                llm = (llama_langchain(server, template, max_new_tokens) if fw == "langchain" else
                       llama_llamaindex(server, template, max_new_tokens, lm.spec.max_position))
                out.append(make(name, llm, None, retrievers, k))
                out[-1].server = server
                continue
            if name == "full":
                backend = PassageCache.open(lm, f"file://{caches}/{fw}-full?max_bytes=1GB")
                settings["mode"] = "full"
            elif name.endswith("-index"):
                backend = KVRag.open(index, model=lm)
            else:  # NAME@SIZE: the passage cache bounded to SIZE (50 GB, more than any stream fills, otherwise)
                bound = name.partition("@")[2] or "50GB"
                folder = f"{fw}-{name.replace('@', '-bound-')}"
                backend = PassageCache.open(lm, f"file://{caches}/{folder}?max_bytes={bound}")
            if name.startswith(("prefix-", "fuse-")):
                settings["gate"] = PREFIX_GATE if name.startswith("prefix-") else FUSE_GATE
            out.append(make(name, llm_class(rag=backend, **settings), backend, retrievers, k))
    return out


def folder_bytes(path: Path) -> int:
    """The bytes of every file under ``path`` (0 when it is absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def held(arm: Arm, index_bytes: int, server_base: int | None) -> dict[str, int | None]:
    """What ``arm`` holds now: ``disk`` (the index's files, or a passage cache's store) and ``memory`` (kept heads and
    prompts and the decoded tier; for llama.cpp the prompt states its RAM cache holds, or, for llama-server, which does
    not say, its resident memory beyond what it held after warm-up; ``rss_growth`` gives the latter for both).
    """
    server = arm.server
    if arm.name == "llama.cpp":
        rss = server.rss_bytes() if server is not None else None
        growth = None if rss is None or server_base is None else rss - server_base
        states = server.cache_bytes_held() if server is not None else None
        return {"disk": 0, "memory": growth if states is None else states, "rss_growth": growth}
    backend = arm.backend
    heads = backend.heads if hasattr(backend, "heads") else backend.context.heads
    memory = heads.nbytes + backend.kvstore.decoded.nbytes
    disk = index_bytes if arm.name.endswith("-index") else 0 if arm.name == "full" else int(backend.store.held())
    return {"disk": disk, "memory": memory}


def timed(arm: Arm, question: str, count_tokens: Callable[[str], int]) -> dict[str, Any]:
    """Stream one answer through ``arm`` (module docstring)."""
    server = arm.server
    arm.seen.clear()
    if arm.backend is not None:
        arm.llm.last_answer = None
    t0 = time.perf_counter()
    ttft, parts = math.nan, []
    for piece in arm.ask(question):
        if math.isnan(ttft) and piece.strip():
            ttft = time.perf_counter() - t0
        parts.append(piece)
    total = time.perf_counter() - t0
    row: dict[str, Any] = {"answer": "".join(parts).strip(), "ttft_s": ttft, "total_s": total,
                           "passages": list(arm.seen.get("passages", []))}
    if arm.backend is None:  # llama.cpp: kvrag's count of the same text (checked against the server's at start)
        reuse = dict(server.last) if server is not None else {}
        tokens = count_tokens(server.last_prompt) if server is not None and server.last_prompt else None
        cached = reuse.get("cached")
        if cached is None and reuse.get("evaluated") is not None and tokens is not None:
            cached = tokens - reuse["evaluated"]
        row.update(prompt_tokens=tokens, read_share=cached / tokens if tokens and cached is not None else None,
                   server=reuse)
        return row
    answer = arm.llm.last_answer
    if answer is None:
        raise RuntimeError(f"{arm.framework}/{arm.name}: the LLM reported no answer")
    gate = answer.gate.to_json() if answer.gate is not None else None
    row.update(prompt_tokens=answer.n_prompt_tokens, read_share=max(0.0, 1.0 - answer.recompute_fraction),
               answered_mode=answer.mode, ratio=answer.ratio, gate=gate["decision"] if gate else None,
               gate_attempts=gate["attempts"] if gate else None,
               chunks=len(answer.chunks), kvrag_ttft_s=answer.ttft_s,
               timings={k: v for k, v in answer.timings.items() if isinstance(v, float)})
    return row
