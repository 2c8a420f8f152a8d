"""Build time of one set of passages three ways: plain caches, neighbour context placed from the
neighbours' stored caches, and neighbour context prefilled with each chunk.

    python scripts/build_cost.py --data ../shared/data/qa/musique_cacheblend_dev75.jsonl --n 4 \
        --out benchmarks/build-neighbours/build_cost.json

Each build goes into a fresh temporary index over the passages of the first ``--n`` questions (one
passage = one chunk, as `kvrag bench quality` builds it), one after another, 3 nearest passages.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from kvrag.bench import common
from kvrag.bench.quality import build_index, load_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench-out/build_cost.json")
    args = parser.parse_args()
    common.set_threads(args.threads)
    build_args = argparse.Namespace(model=args.model, device=None, max_chunk_tokens=2048)
    items = load_questions(Path(args.data), args.n)
    results = {}
    for name, context, how in [("plain", 0, None), ("stored", 3, "stored"), ("prefill", 3, "prefill")]:
        tmp = Path(tempfile.mkdtemp(prefix="kvrag-build-"))
        try:
            rag, seconds = build_index(build_args, items, tmp / "index", context, how)
            results[name] = {"chunks": len(rag.index), "build_s": seconds}
            rag.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(name, results[name], flush=True)
    common.write_json(Path(args.out), {**common.stamp(args), "data": args.data, "n_questions": args.n,
                                       "results": results})


if __name__ == "__main__":
    main()
