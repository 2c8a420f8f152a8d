"""How often the default's short path gives the full prefill's text, by the codec of the cache it reads.

    kvrag index examples/docs --index /tmp/ex-raw --codec raw      # and int8, cachegen (the default)
    python benchmarks/experiments/short_path_codecs.py /tmp/ex-raw /tmp/ex-int8 /tmp/ex-cachegen

A short prompt (fewer than `GateConfig.full_below_tokens` stale tokens) is answered by reading its first passage's
stored cache, computed right after kvrag's prompt head, and recomputing every token after it (the ``prefix`` mode):
the full prefill's computation, but for the codec's rounding of that one passage. Over each index, every question
below is answered by the default and by ``mode="full"`` in the same process (greedy, ``--max-new-tokens``), and the
script prints, per index: its codec, how many answers have the full prefill's text, the modes the default took, the
median time to first token of each, and the questions whose answers parted (from the third question on: the first
two include the process's warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvrag.rag import KVRag

QUESTIONS = (
    "What is the capital of Australia?", "When did Parliament move to Canberra?", "What is the capital of Canada?",
    "Where does Ottawa stand?", "When did Brasilia become the capital of Brazil?", "Who planned Brasilia?",
    "Who designed many buildings in Brasilia?", "Where is Mount Kilimanjaro?", "How high is Kilimanjaro?",
    "What are the cones of Kilimanjaro?", "Who first climbed Mount Everest?", "When was Everest first climbed?",
    "Which is the highest mountain in the Americas?", "In which province is Aconcagua?",
    "Where does the Nile empty?", "Where do the White Nile and the Blue Nile meet?",
    "Which river carries the most water?", "Where does the Amazon rise?",
    "How many countries does the Danube flow through?", "Where does the Danube start?", "How are chunks split?",
    "What does kvrag store next to the FAISS index?",
)


def compare(index: str, max_new_tokens: int) -> dict[str, object]:
    """The default's answers against ``full``'s over one index."""
    rag = KVRag.open(index)
    try:
        rows = []
        for question in QUESTIONS:
            default = rag.answer(question, max_new_tokens=max_new_tokens)
            full = rag.answer(question, mode="full", max_new_tokens=max_new_tokens)
            rows.append({"question": question, "mode": default.mode, "same": default.text == full.text,
                         "default_ttft_s": default.ttft_s, "full_ttft_s": full.ttft_s})
        codec = rag.manifest["codec"]
    finally:
        rag.close()
    timed = rows[2:]
    return {"index": index, "codec": f"{codec['name']} level {codec.get('level')}",
            "same_text": sum(r["same"] for r in rows), "questions": len(rows),
            "default_modes": sorted({str(r["mode"]) for r in rows}),
            "median_ttft_default_s": round(statistics.median(r["default_ttft_s"] for r in timed), 3),
            "median_ttft_full_s": round(statistics.median(r["full_ttft_s"] for r in timed), 3),
            "parted": [r["question"] for r in rows if not r["same"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("indexes", nargs="+", help="index folders over the same documents, one per codec")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    for index in args.indexes:
        print(json.dumps(compare(index, args.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
