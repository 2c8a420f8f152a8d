"""Passage caches without an index (`kvrag.passages`): passages found in a framework's prompt, their caches stored
after the answer and read on later calls, keys that change with the text, a cache shared by two processes, and the
LangChain and LlamaIndex LLMs over it inside real pipelines (FAISS from langchain-community, a LlamaIndex
`VectorStoreIndex`). The tiny random Llama stands in for a user's model.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from conftest import reference_generate

from kvrag import GateConfig
from kvrag.codec import make_codec
from kvrag.passages import PassageCache, find_passages
from kvrag.passages.finder import split_passages
from kvrag.passages.lookup import look_up
from kvrag.query.locate import chat_prompt

PASSAGES = [
    "The alpha reactor was designed by the engineer Marie Dupont in 1961 at the Saclay laboratory near Paris, "
    "and it ran for twenty years before it was closed.",
    "The beta telescope was built on the summit of a volcano in Chile, where the dry air and the altitude give "
    "the astronomers clear skies on most nights of the year.",
    "The gamma bridge crosses the river in three arches of grey stone; it was finished in 1890 after the flood "
    "had carried away the wooden bridge that stood there before.",
]
# the gate, fusing every prompt
FUSE = GateConfig(fuse=True, full_below_tokens=0, fuse_max_text_share=1.0, max_text_before=10**6)
TUTORIAL = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
            "answer the question.\nQuestion: {question} \nContext: {context} \nAnswer:")


def _prompt(question: str, passages: list[str] = PASSAGES) -> str:
    return TUTORIAL.format(question=question, context="\n\n".join(passages))


@pytest.fixture()
def cache(tiny_lm, tmp_path: Path):
    with PassageCache(tiny_lm, _store(tmp_path)) as opened:
        yield opened


def _store(folder: Path, bound: str = "50MB"):
    from kvrag.passages import open_cache_store

    return open_cache_store(f"file://{folder}/cache?max_bytes={bound}")


def test_passages_are_found_in_the_frameworks_templates():
    llama_index = ("Context information is below.\n---------------------\n" + "\n\n".join(PASSAGES) +
                   "\n---------------------\nGiven the context information and not prior knowledge, answer the "
                   "query.\nQuery: Who?\nAnswer: ")
    context_first = "Context:\n" + "\n\n".join(PASSAGES) + "\n\nQuestion: Who designed it?\n\nAnswer:"
    for prompt in (_prompt("Who designed the alpha reactor?"), llama_index, context_first):
        assert find_passages(prompt) == PASSAGES
    assert find_passages("Question: Who?\n\nAnswer:") == []
    two = PASSAGES[0] + "\n\nA note.\n  \n" + PASSAGES[1]  # a document of paragraphs: each its own passage
    assert split_passages(two) == PASSAGES[:2] == find_passages(_prompt("Who?", [two, PASSAGES[2]]))[:2]


def test_a_passage_is_stored_after_its_first_answer_and_read_after(cache: PassageCache):
    prompt = chat_prompt(cache.lm.tokenizer, _prompt("Who designed the alpha reactor?"))
    passages = find_passages(_prompt("Who designed the alpha reactor?"))
    first = cache.answer_prompt(prompt, passages=passages, max_new_tokens=4)
    assert first.chunks == [] and first.mode == "full"  # nothing stored yet: a full prefill
    assert cache.flush(60) and cache.stats.stored == 3 and cache.info()["held_bytes"] > 0
    again = cache.answer_prompt(prompt, "probe", passages=passages, max_new_tokens=4)  # fused: the caches read
    assert [c.text for c in again.chunks] == PASSAGES
    assert cache.stats.found == 3 and cache.stats.hit_rate == 0.5
    kept = cache.answer_prompt(prompt, passages=passages, max_new_tokens=4)  # the gate: the first answer's rows
    assert kept.gate.decision == "kept" and kept.token_ids == first.token_ids
    full = cache.answer_prompt(prompt, "full", passages=passages, max_new_tokens=4)
    assert full.token_ids == first.token_ids  # recomputing everything is the plain prefill, caches or none
    other = chat_prompt(cache.lm.tokenizer, _prompt("Who built the beta telescope?"))
    short = cache.answer_prompt(other, passages=passages, max_new_tokens=4)  # the gate: a short prompt in full
    assert short.gate.decision == "short" and short.mode == "full"
    assert short.token_ids == cache.answer_prompt(other, "full", passages=passages, max_new_tokens=4).token_ids


def test_an_edited_passage_is_a_new_key_never_served_stale(cache: PassageCache):
    raw = _prompt("Who?")
    cache.answer_prompt(chat_prompt(cache.lm.tokenizer, raw), passages=find_passages(raw), max_new_tokens=1)
    cache.flush(60)
    edited = [PASSAGES[0].replace("1961", "1962"), *PASSAGES[1:]]
    raw = _prompt("Who?", edited)
    prompt, texts = chat_prompt(cache.lm.tokenizer, raw), find_passages(raw)
    # the edited passage is new; the next one's stored rows followed the old text: an answer that does not fuse
    # reads no such rows, one that fuses does (its context is what fusion recomputes), never the old passage's
    unfused, _, _, _ = look_up(cache.keys, cache.lm.tokenizer, cache.passage_ids, prompt, texts)
    assert [c.text for c in unfused] == PASSAGES[2:]
    answer = cache.answer_prompt(prompt, "probe", passages=texts, max_new_tokens=1)
    assert [c.text for c in answer.chunks] == PASSAGES[1:] and not any(c.in_place for c in answer.chunks)
    keys = {cache.keys.key(cache.context.chunk_ids(text)) for text in [PASSAGES[0], edited[0]]}
    assert len(keys) == 2


def test_the_byte_bound_holds_over_a_thousand_passages(tiny_lm, tmp_path: Path):
    store = _store(tmp_path, "3MB")
    with PassageCache(tiny_lm, store) as cache:
        texts = [f"Passage number {i} of the survey says that the {i % 17}th lamp of tower {i // 17} is lit "
                 f"every evening." for i in range(1000)]
        hot = texts[:5]
        hot_prompt = chat_prompt(tiny_lm.tokenizer, "Context:\n" + "\n\n".join(hot) + "\n\nQuestion: Which lamp?")
        for start in range(0, len(texts), 100):
            cache.warm(texts[start:start + 100], show_progress=False)
            held = sum(p.stat().st_size for p in store.root.glob("*/*.kvc"))
            assert held <= store.max_bytes
            cache.answer_prompt(hot_prompt, "probe", passages=hot, max_new_tokens=1)  # read: recently used
        assert store.evicted > 0 and cache.stats.stored > 900
        assert cache.answer_prompt(hot_prompt, "probe", passages=hot, max_new_tokens=1).chunks  # read often: kept
        newest = chat_prompt(tiny_lm.tokenizer, "Context:\n" + "\n\n".join(texts[-4:]) + "\n\nQuestion: Which?")
        assert len(cache.answer_prompt(newest, "probe", passages=texts[-4:], max_new_tokens=1).chunks) == 4
        oldest = chat_prompt(tiny_lm.tokenizer, "Context:\n" + "\n\n".join(texts[5:9]) + "\n\nQuestion: Which?")
        assert cache.answer_prompt(oldest, "probe", passages=texts[5:9], max_new_tokens=1).chunks == []  # evicted
        assert 0 < cache.info()["hit_rate"] < 1


def _second_process(folder: str, model_dir: str, codec: str, out: multiprocessing.Queue) -> None:
    from kvrag.passages import PassageCache

    cache = PassageCache.open(model_dir, f"file://{folder}/cache?max_bytes=50MB", device="cpu", codec=codec)
    raw = _prompt("Who designed the alpha reactor?")
    answer = cache.answer_prompt(chat_prompt(cache.lm.tokenizer, raw), "probe", passages=find_passages(raw),
                                 max_new_tokens=3)
    out.put(([c.text for c in answer.chunks], answer.token_ids))


@pytest.mark.parametrize("codec", ["int8", "cachegen"])  # the default, and one whose fitted state is shared
def test_a_second_process_reads_what_the_first_stored(tiny_lm, tiny_model_dir: Path, tmp_path: Path, codec: str):
    with PassageCache(tiny_lm, _store(tmp_path), codec=make_codec(codec)) as cache:
        assert cache.warm(PASSAGES, show_progress=False) == 3
        raw = _prompt("Who designed the alpha reactor?")
        # the first call stores the first passage as the prompt has it (after "Context: "); the second, fused over
        # the same run again, pays for its exact pass (`kvrag.passages.exact_pass`); the third reads those rows
        for _ in range(3):
            here = cache.answer_prompt(chat_prompt(tiny_lm.tokenizer, raw), "probe", passages=find_passages(raw),
                                       max_new_tokens=3)
            cache.flush(60)
        assert len(here.chunks) == 3
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_second_process, args=(str(tmp_path), str(tiny_model_dir), codec, out))
    proc.start()
    texts, token_ids = out.get(timeout=180)
    proc.join(30)
    assert texts == PASSAGES and token_ids == here.token_ids  # the same keys (and codec state), the same answer


def test_langchain_tutorial_chain_over_faiss_swaps_only_the_llm(tiny_model_dir: Path, tmp_path: Path):
    pytest.importorskip("langchain_core")
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from kvrag.integrations.langchain import KVCachedLLM

    store = FAISS.from_documents([Document(page_content=p) for p in PASSAGES], DeterministicFakeEmbedding(size=16))
    retriever = store.as_retriever(search_kwargs={"k": 3})
    llm = KVCachedLLM(model=str(tiny_model_dir), cache=f"file://{tmp_path}/lc?max_bytes=20MB", max_new_tokens=3,
                      gate=FUSE)  # the tiny prompts are short: the default gate would recompute them
    assert llm.cache is None and llm._identifying_params["cache"].startswith("BoundedDiskStore")

    def format_docs(docs):
        return "\n\n".join(doc.page_content for doc in docs)

    chain = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
             | PromptTemplate.from_template(TUTORIAL) | llm | StrOutputParser())
    first = chain.invoke("Who designed the alpha reactor?")
    assert llm.last_answer.chunks == []
    llm.rag.flush(60)
    second = chain.invoke("Who built the beta telescope?")  # a new question before the same passages: fused
    # a fusing answer reads each passage's stored rows wherever it stands, where its tokens are those it had in the
    # first prompt: the first passage's first word follows "Context: " (a space), the others' a line break
    order = [[d.page_content for d in retriever.invoke(q)]
             for q in ("Who designed the alpha reactor?", "Who built the beta telescope?")]
    expected = [p for p in order[1] if (order[1].index(p) == 0) == (order[0].index(p) == 0)]
    assert expected and [c.text for c in llm.last_answer.chunks] == expected
    assert llm.last_answer.gate.decision == "fused"
    assert isinstance(first, str) and isinstance(second, str)
    assert llm.rag.flush(60)
    # the prompt stored rows after what came before each passage; warm adds the cache computed alone, once
    assert llm.warm([Document(page_content=PASSAGES[0])], show_progress=False) == 1
    assert llm.warm([Document(page_content=PASSAGES[0])], show_progress=False) == 0
    from langchain_core.vectorstores import InMemoryVectorStore

    added = ["The delta canal joins the two lakes; barges carried salt along it until the railway came in 1902.",
             "The epsilon tower stands on the old market square and its bells ring every quarter of an hour."]
    memory = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    for vectors, text in ((store, added[0]), (memory, added[1])):  # add_texts (FAISS), add_documents (in memory)
        assert llm.warm_on_add(llm.warm_on_add(vectors)) is vectors
        stored = llm.rag.info()["stored"]
        vectors.add_documents([Document(page_content=text)])
        assert llm.rag.info()["stored"] == stored + 1  # warmed once on adding
        assert llm.warm([text], show_progress=False) == 0
    with pytest.raises(ValueError, match="not both"):
        KVCachedLLM(rag=llm.rag, model=str(tiny_model_dir))


def test_llama_index_default_query_engine_reads_the_warmed_nodes(tiny_model_dir: Path, tmp_path: Path):
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    from kvrag.integrations.llama_index import KVCachedLLM, KVCacheWarmer

    llm = KVCachedLLM(model=str(tiny_model_dir), cache=f"file://{tmp_path}/li?max_bytes=20MB", max_new_tokens=3,
                      gate=FUSE)
    documents = [Document(text=p) for p in PASSAGES]
    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
    nodes = list(index.docstore.docs.values())
    assert KVCacheWarmer(llm=llm)(nodes) == nodes and llm.rag.stats.stored == 3
    engine = index.as_query_engine(llm=llm, similarity_top_k=3)
    engine.query("Who designed the alpha reactor?")
    assert len(llm.last_answer.chunks) == 3  # read from the first query


def test_recompute_everything_matches_a_plain_forward(cache: PassageCache):
    raw = _prompt("Who built the telescope?")
    cache.warm(PASSAGES, show_progress=False)
    prompt = chat_prompt(cache.lm.tokenizer, raw)
    fused = cache.answer_prompt(prompt, "full", passages=find_passages(raw), max_new_tokens=5)
    ids = torch.tensor([cache.lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = reference_generate(cache.lm, ids, max_new_tokens=5)
    assert fused.token_ids == out[0, ids.shape[1]:].tolist()[: len(fused.token_ids)]


def test_the_chat_model_without_an_index_reads_passages_from_its_messages(tiny_model_dir: Path, tmp_path: Path):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import HumanMessage, SystemMessage

    from kvrag.integrations.langchain import ChatKVRag

    chat = ChatKVRag(model=str(tiny_model_dir), cache=f"file://{tmp_path}/chat?max_bytes=20MB", max_tokens=3,
                     mode="probe")
    messages = [SystemMessage("Answer from this context:\n\n" + "\n\n".join(PASSAGES)),
                HumanMessage("Who designed the alpha reactor?")]
    first = chat.invoke(messages)
    assert first.response_metadata["chunks"] == []
    chat.rag.flush(60)
    second = chat.invoke(messages)
    assert len(second.response_metadata["chunks"]) == 3 and second.usage_metadata["output_tokens"] > 0
    assert chat._identifying_params["cache"].startswith("BoundedDiskStore")


def test_a_redis_cache_is_shared_and_bounded(tiny_lm, redis_server):
    import redis

    url = redis_server.url(db=5)
    redis.Redis.from_url(url).flushdb()
    raw = _prompt("Who built the telescope?")
    with PassageCache.open(tiny_lm, url + "?max_bytes=5MB") as writer:
        assert writer.warm(PASSAGES, show_progress=False) == 3
        held = writer.store.held()
        assert 0 < held <= 5 * 10**6
    with PassageCache.open(tiny_lm, url, max_bytes="5MB") as reader:  # another client: the same state and caches
        answer = reader.answer_prompt(chat_prompt(tiny_lm.tokenizer, raw), "probe", passages=find_passages(raw),
                                      max_new_tokens=2)
        assert [c.text for c in answer.chunks] == PASSAGES and reader.info()["held_bytes"] == held
    redis.Redis.from_url(url).flushdb()
