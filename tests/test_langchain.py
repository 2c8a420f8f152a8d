"""LangChain adapter: the standard retriever suite, LLM behaviour, and an LCEL stuff chain with SmolLM2.

langchain-tests has no standard suite for (non-chat) LLMs, so `KVCachedLLM` gets the equivalent
checks here: invoke/batch/stream/async, token callbacks, identifying params, generation_info.
"""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from typing import Any

import pytest

from kvrag import KVRag

pytest.importorskip("langchain_core")
from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from kvrag.integrations.langchain import KVCachedLLM, KVRetriever, format_docs  # noqa: E402

QUESTION = "In what year was the album Milk and Honey released?"
GOLD = "1984"
TEMPLATE = "Context:\n{context}Answer the question with a short answer of a few words.\nQuestion: {question}"


@pytest.fixture(scope="module")
def rag(lennon_rag: KVRag) -> KVRag:
    return lennon_rag


# -- imports ----------------------------------------------------------------------------------------


def test_import_kvrag_loads_no_framework():
    code = ("import sys, kvrag; from kvrag import KVRag; import kvrag.query.locate, kvrag.query.spans; "
            "print([m for m in sys.modules if m.startswith(('langchain', 'llama_index'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module", ["kvrag.integrations.langchain", "kvrag.integrations.langchain_chat"])
def test_missing_extra_names_it(monkeypatch, module):
    import builtins

    real_import = builtins.__import__

    def fail_langchain(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("langchain_core"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(builtins, "__import__", fail_langchain)
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[langchain\]'"):
        importlib.import_module(module)


def test_format_docs_lays_chunks_out_as_kvrag_stores_them():
    docs = [Document(page_content=" a \n"), Document(page_content="b")]
    assert format_docs(docs) == "a\n\nb\n\n"


# -- the standard retriever suite -------------------------------------------------------------------

try:
    from langchain_tests.integration_tests import RetrieversIntegrationTests
except ImportError:  # pragma: no cover - langchain-tests is a dev extra
    RetrieversIntegrationTests = None


if RetrieversIntegrationTests is not None:

    @pytest.mark.slow
    @pytest.mark.asyncio  # the suite's async test; pytest-asyncio runs in strict mode here
    @pytest.mark.filterwarnings("ignore:The test .* is marked with '@pytest.mark.asyncio'")
    class TestKVRetrieverStandard(RetrieversIntegrationTests):
        _rag: KVRag | None = None

        @pytest.fixture(autouse=True)
        def _bind(self, rag: KVRag) -> None:
            type(self)._rag = rag

        @property
        def retriever_constructor(self) -> type[KVRetriever]:
            return KVRetriever

        @property
        def retriever_constructor_params(self) -> dict[str, Any]:
            return {"rag": self._rag, "k": 2}

        @property
        def retriever_query_example(self) -> str:
            return QUESTION


# -- retriever and LLM ------------------------------------------------------------------------------


@pytest.mark.slow
def test_retriever_metadata_carries_chunk_id_score_source(rag):
    docs = KVRetriever(rag=rag, k=2).invoke(QUESTION)
    chunks = rag.retrieve(QUESTION, k=2)
    assert [d.metadata["chunk_id"] for d in docs] == [c.key for c in chunks]
    assert all(isinstance(d.metadata["score"], float) and "source" in d.metadata for d in docs)
    assert docs[0].page_content == chunks[0].text


class _Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.mark.slow
def test_llm_invoke_stream_batch_async_and_callbacks(rag):
    llm = KVCachedLLM(rag=rag, max_new_tokens=3)
    assert llm._llm_type == "kvrag"
    assert {"mode", "ratio", "gate", "model", "index"} <= set(llm._identifying_params)
    text = llm.invoke("Say hello.")
    assert isinstance(text, str) and text
    # no chunk in the prompt: an ordinary LLM, full prefill
    assert llm.last_answer.mode == "full" and llm.last_answer.chunks == []
    handler = _Tokens()
    pieces = list(llm.stream("Say hello.", config={"callbacks": [handler]}))
    assert "".join(pieces).strip() == text and handler.tokens == [p for p in pieces if p]
    assert llm.batch(["Say hello.", "Say hello."]) == [text, text]
    assert asyncio.run(llm.ainvoke("Say hello.")) == text

    async def astream() -> str:
        return "".join([p async for p in llm.astream("Say hello.")])

    assert asyncio.run(astream()).strip() == text
    info = llm.generate(["Say hello."]).generations[0][0].generation_info
    assert info is not None and info["mode"] == "full" and info["chunk_ids"] == [] and info["ttft_s"] > 0


@pytest.mark.slow
def test_lcel_stuff_chain_answers_with_fused_caches(rag):
    retriever = KVRetriever(rag=rag, k=2)
    llm = KVCachedLLM(rag=rag, mode="cacheblend", ratio=0.15, max_new_tokens=14)
    prompt = PromptTemplate.from_template(TEMPLATE)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    out = chain.invoke(QUESTION)
    assert GOLD in out
    answer = llm.last_answer
    assert [c.key for c in answer.chunks] == [d.metadata["chunk_id"] for d in retriever.invoke(QUESTION)]
    assert answer.mode == "cacheblend" and 0 < answer.recompute_fraction < 1 and answer.ttft_s > 0
    # generate() reports the same through generation_info
    info = llm.generate([prompt.format(context=format_docs(retriever.invoke(QUESTION)), question=QUESTION)],
                        max_new_tokens=1).generations[0][0].generation_info
    assert info["chunk_ids"] == [c.key for c in answer.chunks] and info["recompute_fraction"] < 1


# LangChain's tutorial prompt puts the question before the context; its own format_docs joins by a blank line
TUTORIAL = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
            "answer the question. If you don't know the answer, just say that you don't know. Use three sentences "
            "maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
QUESTIONS = ["In what year was the album Milk and Honey released?", "Who recorded Milk and Honey?",
             "Where was John Lennon born?", "Which band was John Lennon in?"]


def _tutorial_chain(rag: KVRag, llm: KVCachedLLM) -> Any:
    from langchain_core.output_parsers import StrOutputParser

    def join(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    return ({"context": KVRetriever(rag=rag, k=3) | join, "question": RunnablePassthrough()}
            | PromptTemplate.from_template(TUTORIAL) | llm | StrOutputParser())


@pytest.mark.slow
def test_the_tutorial_chain_at_the_default_gives_the_full_prefills_answer(rag):
    default, full = KVCachedLLM(rag=rag, max_new_tokens=8), KVCachedLLM(rag=rag, mode="full", max_new_tokens=8)
    for question in QUESTIONS[:2]:
        assert _tutorial_chain(rag, default).invoke(question) == _tutorial_chain(rag, full).invoke(question)
        answer = default.last_answer
        assert answer.gate.decision == "short" and len(answer.chunks) == 3  # every passage found, none read
        assert answer.gate.attempts[-1]["mode"] == "full" and full.last_answer.gate is None


@pytest.mark.slow
def test_a_concurrent_batch_gives_each_prompt_its_own_answer_and_metadata(rag):
    llm = KVCachedLLM(rag=rag, max_new_tokens=6)
    docs = [KVRetriever(rag=rag, k=k).invoke(q) for q in QUESTIONS for k in (1, 2)]
    prompts = [PromptTemplate.from_template(TUTORIAL).format(question=q, context="\n\n".join(
        d.page_content for d in found)) for q, found in zip([q for q in QUESTIONS for _ in (1, 2)], docs)]
    alone = [llm.generate([p]).generations[0][0] for p in prompts]
    together = llm.batch(prompts, config={"max_concurrency": 4})
    assert together == [g.text for g in alone]
    result = asyncio.run(llm.agenerate(prompts))
    for generation, single, found in zip(result.generations, alone, docs):
        info = generation[0].generation_info
        assert generation[0].text == single.text and info["chunk_ids"] == single.generation_info["chunk_ids"]
        assert info["chunk_ids"] == [d.metadata["chunk_id"] for d in found][: len(info["chunk_ids"])]


def test_the_mode_and_ratio_fields_describe_the_registered_modes():
    from kvrag.fusion import available_modes, selector_class
    from kvrag.integrations.fields import MODE_HELP, RATIO_HELP
    from kvrag.integrations.langchain import ChatKVRag, KVCachedLLM

    for model in (KVCachedLLM, ChatKVRag):
        assert model.model_fields["mode"].description == MODE_HELP
        assert model.model_fields["ratio"].description == RATIO_HELP
    assert all(mode in MODE_HELP for mode in available_modes())
    scaled = [m for m in available_modes() if selector_class(m).scales_with_ratio]
    assert scaled and all(m in RATIO_HELP for m in scaled)
    assert not any(m in RATIO_HELP for m in available_modes() if m not in scaled)
