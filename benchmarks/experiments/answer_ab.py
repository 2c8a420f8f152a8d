"""Median time of `KVRag.answer`, `KVRag.answer_prompt` and LangChain's tutorial chain over one index, for comparing
two versions of kvrag.

Run it once per version, alternating, each from a folder that is not a kvrag checkout, with that version first on
the path (a second worktree of another commit: ``git worktree add /tmp/old REV``):

    cd /tmp && for v in /tmp/old /path/to/kvrag /tmp/old /path/to/kvrag; do
        PYTHONPATH=$v python /path/to/kvrag/benchmarks/experiments/answer_ab.py INDEX --rounds 5; done

Each run answers three questions (kvrag's default, greedy, 8 tokens), the same questions as a flat prompt of the
retrieved passages, and through LangChain's tutorial RAG chain (``{"context": retriever | format_docs, "question":
RunnablePassthrough()} | prompt | llm | StrOutputParser()`` over ``KVRetriever`` and ``KVCachedLLM``, the prompt
of ``benchmarks/frameworks/run.py``), once each to warm up, then ``--rounds`` times each, and prints one JSON line:
the kvrag it ran, and the medians in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough

import kvrag
from kvrag import KVRag
from kvrag.integrations.langchain import KVCachedLLM, KVRetriever

# the hub's rlm/rag-prompt, as benchmarks/frameworks/run.py writes it
RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
              "answer the question. If you don't know the answer, just say that you don't know. Use three sentences "
              "maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:")
QUESTIONS = ("In which country is Mount Kilimanjaro?", "Who designed the alpha reactor?",
             "What is the capital of France?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", help="an index folder (e.g. one built from examples/docs)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rag = KVRag.open(args.index, model=args.model)

    def prompt(question: str) -> str:
        passages = "\n\n".join(c.text for c in rag.retrieve(question, k=4))
        return f"Use the context to answer.\n\nContext:\n{passages}\n\nQuestion: {question}\nAnswer:"

    chain = ({"context": KVRetriever(rag=rag, k=4) | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | PromptTemplate.from_template(RAG_PROMPT) | KVCachedLLM(rag=rag, max_new_tokens=8) | StrOutputParser())
    for q in QUESTIONS:
        rag.answer(q, max_new_tokens=8)
        rag.answer_prompt(prompt(q), max_new_tokens=8)
        chain.invoke(q)
    answer, flat, tutorial = [], [], []
    for _ in range(args.rounds):
        for q in QUESTIONS:
            t = time.perf_counter()
            rag.answer(q, max_new_tokens=8)
            answer.append(time.perf_counter() - t)
            text = prompt(q)
            t = time.perf_counter()
            rag.answer_prompt(text, max_new_tokens=8)
            flat.append(time.perf_counter() - t)
            t = time.perf_counter()
            chain.invoke(q)
            tutorial.append(time.perf_counter() - t)
    print(json.dumps({"kvrag": kvrag.__file__, "answer_ms": round(1000 * statistics.median(answer), 1),
                      "answer_prompt_ms": round(1000 * statistics.median(flat), 1),
                      "tutorial_chain_ms": round(1000 * statistics.median(tutorial), 1)}))


if __name__ == "__main__":
    main()
