"""Build time of one set of passages three ways: plain caches, neighbour context placed from the
neighbours' stored caches, and neighbour context prefilled with each chunk.

    python benchmarks/experiments/build_cost.py --data musique_cacheblend_dev75.jsonl --n 4 \
        --out bench-out/build_cost.json

``--data`` is a QA JSONL file, one question a line: ``{id, question, answers, ctxs: [{title, text}]}``.

Each build goes into a fresh temporary index over the passages of the first ``--n`` questions (one
passage = one chunk, as `kvrag bench quality` builds it), one after another, 3 nearest passages.
``--neighbours 1,3,6`` builds both neighbour-context variants at each of those counts instead (named
``stored-1``, ``prefill-1``, …); ``--no-prefill`` leaves out the prefilled ones.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from kvrag.bench import common
from kvrag.bench.qa_data import build_index, load_questions, passage_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench-out/build_cost.json")
    parser.add_argument("--neighbours", default="3",
                        help="comma-separated neighbour counts of the neighbour-context builds")
    parser.add_argument("--no-prefill", action="store_true", help="skip the build with the neighbours prefilled")
    args = parser.parse_args()
    counts = [int(k) for k in args.neighbours.split(",")]
    plans: list[tuple[str, int, str | None]] = [("plain", 0, None)]
    for kind in ["stored"] + ([] if args.no_prefill else ["prefill"]):
        plans += [(kind if len(counts) == 1 else f"{kind}-{k}", k, kind) for k in counts]
    common.set_threads(args.threads)
    build_args = argparse.Namespace(model=args.model, device=None, max_chunk_tokens=2048)
    items = load_questions(Path(args.data), args.n)
    passages = len(passage_documents(items))
    results = {}
    for name, context, how in plans:
        tmp = Path(tempfile.mkdtemp(prefix="kvrag-build-"))
        try:
            rag, seconds = build_index(build_args, items, tmp / "index", context, how)
            results[name] = {"passages": passages, "build_s": seconds}
            rag.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(name, results[name], flush=True)
    common.write_json(Path(args.out), {**common.stamp(args), "data": args.data, "n_questions": args.n,
                                       "results": results})


if __name__ == "__main__":
    main()
