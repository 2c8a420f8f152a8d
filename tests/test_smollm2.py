"""The real SmolLM2-135M-Instruct: an index over real passages answers a single-fact question."""

from __future__ import annotations

import json

import pytest
from conftest import DATA

from kvrag import KVRag, SplitConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rag(smollm2, tmp_path_factory):
    items = [json.loads(line) for line in open(DATA / "qa" / "hotpotqa_ircot.jsonl")]
    passages = {c["title"]: c["text"] for item in items[:3] for c in item["ctxs"]}
    passages["Mount Kilimanjaro"] = (
        "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa, "
        "about 5,895 metres above sea level.")
    docs = [(title, f"{title}\n{text}") for title, text in passages.items()]
    return KVRag.build(docs, tmp_path_factory.mktemp("smol") / "idx", model=smollm2,
                       split=SplitConfig(mode="document"), show_progress=False)


@pytest.mark.parametrize("mode", ["full", "cacheblend", "attnlink"])
def test_single_fact_question(rag, mode):
    answer = rag.answer("In which country is Mount Kilimanjaro?", k=2, mode=mode, max_new_tokens=32)
    assert any(c.doc_id == "Mount Kilimanjaro" for c in answer.chunks)
    assert "tanzania" in answer.text.lower(), answer.text


def test_recompute_everything_reproduces_full(rag):
    q = "What is the highest mountain in Africa?"
    full = rag.answer(q, k=4, mode="full", max_new_tokens=12)
    blend = rag.answer(q, k=4, mode="cacheblend", ratio=1.0, max_new_tokens=12)
    assert blend.token_ids == full.token_ids
