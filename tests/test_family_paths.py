"""The whole path on a tiny model of every family: build an index (the default codec fitted on its layers), answer
under the default gate, score a continuation as transformers does, hold a conversation's turn, serve a chat
completion, answer a LangChain chain's flat prompt and a LlamaIndex query engine's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from conftest import FAMILIES, save_tiny_model
from test_serve import serving

from kvrag import GateConfig, KVRag, SplitConfig
from kvrag.query.pipeline import prompt_ids

DOCS = [
    ("alpha", "The alpha reactor was designed by Mira Okafor in 1987. It runs on molten salt. " * 2),
    ("beta", "Beta station orbits the moon. Its commander is Jonas Reyes. The crew rotates yearly. " * 2),
    ("gamma", "Gamma rays are photons of very high energy. They come from nuclear decay. " * 2),
]
Q = "Who commands beta station?"
TARGET = [5, 6, 7, 8]
LONG_DOCS = [(name, text * 6) for name, text in DOCS]  # over the gate's short-prompt threshold: fused by default
TEMPLATE = "Context:\n{context}Answer the question with a short answer of a few words.\nQuestion: {question}"


def _transformers_nll(rag: KVRag, chunks, question: str, target: list[int]) -> float:
    """Mean NLL of ``target`` after the same prompt ids, by the model's own forward."""
    ctx = rag.context
    chunk_ids, suffix = prompt_ids(ctx, question, chunks)
    ids = torch.cat([ctx.prefix.ids.cpu(), *chunk_ids, suffix, torch.tensor(target)])
    with torch.no_grad():
        logits = rag.lm.model(ids[None]).logits[0, -len(target) - 1: -1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(target)))


@pytest.mark.parametrize("arch", FAMILIES)
def test_build_answer_score_and_chat_on_every_family(arch: str, tmp_path: Path):
    model_dir = save_tiny_model(arch, tmp_path / "model")
    rag = KVRag.build(DOCS, tmp_path / "idx", model=str(model_dir), split=SplitConfig(mode="document"),
                      show_progress=False)
    try:
        assert rag.lm.family.tested and rag.lm.family.name.startswith(arch)
        default = rag.answer(Q, k=3, max_new_tokens=3)
        full = rag.answer(Q, k=3, mode="full", max_new_tokens=3)
        assert default.gate is not None and default.token_ids[0] == full.token_ids[0]
        # the fused path over ~370 tokens (23 windows of the windowed families, whose stored caches keep 16 rows
        # of such a layer): a fused pass, trusted where its probe pass agrees, else escalated
        checked = GateConfig(fuse=True, full_below_tokens=0, probe_must_agree=True)
        fused = rag.answer(Q, k=3, gate=checked, max_new_tokens=3)
        assert fused.gate.decision != "short" and fused.gate.attempts[0]["mode"] == "probe"
        assert fused.n_prompt_tokens > 8 * 16 and fused.token_ids[0] == full.token_ids[0]
        prepared = rag.prepare(Q, k=3, mode="full")
        reference = _transformers_nll(rag, prepared.chunks, Q, TARGET)
        assert abs(prepared.nll(TARGET) - reference) <= 1e-4
        turn = rag.chat([{"role": "user", "content": Q}], k=2, max_new_tokens=3)
        assert turn.token_ids and turn.history is not None
        with serving(rag, model_name="kvrag-tiny", k=2) as url:
            body = {"model": "kvrag-tiny", "messages": [{"role": "user", "content": Q}], "max_tokens": 3}
            served = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] > 0
        _langchain_chain_reads_the_stored_caches(rag)
        _llama_index_engine_reads_the_stored_caches(rag)
    finally:
        rag.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_long_prompt_on_every_family_exact_by_default_and_fused_when_asked(arch: str, tmp_path: Path):
    """At a length where a fusing gate fuses: the default answers it exactly (a full prefill after the kept head);
    the fusing gate reads the stored caches; recomputing every stale token over them gives
    the full prefill's logits, and the default mode's selection moves the logits toward full's."""
    model_dir = save_tiny_model(arch, tmp_path / "model")
    rag = KVRag.build(LONG_DOCS, tmp_path / "idx", model=str(model_dir),
                      split=SplitConfig(mode="document", max_tokens=1024), codec="raw", show_progress=False)
    try:
        default = rag.answer(Q, k=3, max_new_tokens=3)
        assert default.gate is not None and default.gate.stale_tokens >= GateConfig().full_below_tokens
        assert default.gate.decision == "exact" and default.mode == "full"
        assert default.token_ids == rag.answer(Q, k=3, mode="full", max_new_tokens=3).token_ids
        fusing = rag.answer(Q, k=3, gate=GateConfig(fuse=True), max_new_tokens=3)
        assert fusing.gate.decision in ("fused", "escalated") and fusing.gate.attempts[0]["mode"] == "probe"
        full = rag.prepare(Q, k=3, mode="full").fused
        every_stale = rag.prepare(Q, k=3, mode="probe", ratio=1.0).fused
        assert every_stale.recompute_fraction < 1  # the first chunk's stored (lossless) cache is read, not recomputed
        torch.testing.assert_close(every_stale.logits, full.logits, atol=1e-4, rtol=1e-4)
        fused = rag.prepare(Q, k=3, mode="probe", ratio=0.15).fused
        as_stored = rag.prepare(Q, k=3, mode="reuse").fused
        assert fused.recompute_fraction < 0.5
        assert (fused.logits - full.logits).norm() < (as_stored.logits - full.logits).norm()
        _langchain_chain_fuses_at_length(rag)
    finally:
        rag.close()


def _langchain_chain_fuses_at_length(rag: KVRag) -> None:
    """A stuff chain's long flat prompt: the default answers it as a full prefill does, a fusing gate fuses its
    passages' caches, and recomputing every stale token over them gives the full prefill's answer."""
    pytest.importorskip("langchain_core")
    from kvrag.integrations.langchain import KVCachedLLM

    def chain(llm: KVCachedLLM):
        return _stuff_chain(rag, llm, k=3)

    full = chain(KVCachedLLM(rag=rag, mode="full", max_new_tokens=3)).invoke(Q)
    assert chain(KVCachedLLM(rag=rag, max_new_tokens=3)).invoke(Q) == full
    fusing = KVCachedLLM(rag=rag, gate=GateConfig(fuse=True), max_new_tokens=3)
    rag.context.heads.clear_prompts()  # else the default's exact answer is read back from its kept rows
    chain(fusing).invoke(Q)
    gate = fusing.last_answer.gate
    assert gate is not None and gate.decision in ("fused", "escalated") and len(fusing.last_answer.chunks) == 3
    every_stale = KVCachedLLM(rag=rag, mode="probe", ratio=1.0, max_new_tokens=3)
    assert chain(every_stale).invoke(Q) == full


def _langchain_chain_reads_the_stored_caches(rag: KVRag) -> None:
    """A stuff chain's flat prompt: its passages are found and read, and its answer is the full prefill's."""
    pytest.importorskip("langchain_core")
    from kvrag.integrations.langchain import KVCachedLLM

    def chain(llm: KVCachedLLM):
        return _stuff_chain(rag, llm, k=2)

    default, full = KVCachedLLM(rag=rag, max_new_tokens=3), KVCachedLLM(rag=rag, mode="full", max_new_tokens=3)
    assert chain(default).invoke(Q) == chain(full).invoke(Q)
    assert len(default.last_answer.chunks) == 2 and default.last_answer.gate is not None


def _llama_index_engine_reads_the_stored_caches(rag: KVRag) -> None:
    """LlamaIndex's default query engine over kvrag's retriever: the passages' caches are read under the gate, and
    its answer is the full prefill's."""
    pytest.importorskip("llama_index.core")
    from llama_index.core.query_engine import RetrieverQueryEngine

    from kvrag.integrations.llama_index import KVCachedLLM, KVRetriever

    default, full = KVCachedLLM(rag=rag, max_new_tokens=3), KVCachedLLM(rag=rag, mode="full", max_new_tokens=3)
    engines = [RetrieverQueryEngine.from_args(KVRetriever(rag=rag, k=2), llm=llm) for llm in (default, full)]
    texts = [str(engine.query(Q)) for engine in engines]
    assert texts[0] == texts[1]
    assert len(default.last_answer.chunks) == 2 and default.last_answer.gate is not None


def _stuff_chain(rag: KVRag, llm, k: int):
    """A LangChain stuff chain over kvrag's retriever: ``k`` passages in `TEMPLATE`, answered by ``llm``."""
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from kvrag.integrations.langchain import KVRetriever, format_docs

    return ({"context": KVRetriever(rag=rag, k=k) | format_docs, "question": RunnablePassthrough()}
            | PromptTemplate.from_template(TEMPLATE) | llm)
