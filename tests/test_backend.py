"""One answering interface: `KVRag` and `PassageCache` are both `AnswerBackend`s, and neither the adapters nor the
server tell them apart by probing for attributes or by taking ``Any``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvrag import KVRag, SplitConfig
from kvrag.backend import AnswerBackend
from kvrag.passages import PassageCache, open_cache_store

ROOT = Path(__file__).resolve().parents[1]
PROBES = ("hasattr", "getattr")
FRONT_ENDS = sorted([*(ROOT / "kvrag" / "integrations").glob("*.py"), *(ROOT / "kvrag" / "serve").glob("*.py")])
DOCS = [(f"d{i}", f"The {name} bridge was built by the guild of {name} makers in the year 18{i}0.")
        for i, name in enumerate(("stone", "iron", "oak"))]
PASSAGE = ("The alpha reactor was designed by the engineer Marie Dupont in 1961 at the Saclay laboratory near Paris, "
           "and it ran for twenty years before it was closed.")


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)}


def test_no_front_end_probes_what_answers_or_takes_it_as_any():
    probes, untyped = [], []
    for path in FRONT_ENDS:
        for node in ast.walk(ast.parse(path.read_text())):
            probe = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
            if probe and node.args and _names(node.args[0]) & {"rag", "backend"}:
                probes.append(f"{path.name}:{node.lineno}")
            annotated = [(a.arg, a.annotation) for a in (node.args.args + node.args.kwonlyargs)] \
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else []
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                annotated.append((node.target.id, node.annotation))
            untyped += [f"{path.name}:{node.lineno} {name}" for name, hint in annotated
                        if name in ("rag", "backend") and (hint is None or "Any" in _names(hint))]
    assert FRONT_ENDS and not probes and not untyped, (probes, untyped)


def test_an_index_and_a_passage_cache_are_both_answer_backends(tiny_lm, tmp_path: Path):
    with KVRag.build(DOCS, tmp_path / "idx", model=tiny_lm, split=SplitConfig(mode="document"),
                     show_progress=False) as rag:
        assert isinstance(rag, AnswerBackend)
        assert rag.describe() == {"index": str(rag.path), "model": str(tiny_lm.source)}
        with pytest.raises(TypeError, match="passage cache"):
            rag.warm(["a passage"])
    with PassageCache(tiny_lm, open_cache_store(f"file://{tmp_path}/cache?max_bytes=10MB")) as cache:
        assert isinstance(cache, AnswerBackend)
        assert set(cache.describe()) == {"cache", "model"} and str(tmp_path) in cache.describe()["cache"]
        assert cache.warm([PASSAGE], show_progress=False) == 1
    assert not isinstance(object(), AnswerBackend)


def test_every_adapter_answers_over_a_passage_cache_with_the_shared_fields(tiny_lm, tmp_path: Path):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.messages import HumanMessage
    from llama_index.core.llms import ChatMessage

    from kvrag.integrations import langchain as lc
    from kvrag.integrations import llama_index as li
    from kvrag.integrations.fields import ANSWER_OPTIONS

    prompt = f"Context:\n{PASSAGE}\n\nQuestion: Who designed the alpha reactor?"
    settings = {"max_new_tokens": 3, "top_p": 0.5, "seed": 7, "gate": True}
    made = [cls(model=tiny_lm, cache=f"file://{tmp_path}/{cls.__module__}.{cls.__name__}", **settings)
            for cls in (lc.KVCachedLLM, lc.ChatKVRag, li.KVCachedLLM, li.KVRagChatLLM)]
    for model in made:
        assert isinstance(model.backend, PassageCache) and model.model is None and model.cache is None
        assert {name: getattr(model, name) for name in settings} == settings
        assert set(ANSWER_OPTIONS) <= set(type(model).model_fields)
    lc_llm, lc_chat, li_llm, li_chat = made
    assert lc_llm.invoke(prompt) == lc_llm.last_answer.text and len(lc_llm.last_answer.token_ids) <= 3
    assert lc_chat.invoke([HumanMessage(prompt)]).content == lc_chat.last_answer.text
    assert li_llm.complete(prompt).text == li_llm.last_answer.text
    assert li_chat.chat([ChatMessage(role="user", content=prompt)]).message.content == li_chat.last_answer.text
    with pytest.raises(ValueError, match="not both"):
        lc.KVCachedLLM(rag=made[0].backend, model=tiny_lm)
