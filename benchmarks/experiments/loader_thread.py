"""Fusion time with the stored layers read on a loader thread ahead of use, against read when fusion asks.

    python benchmarks/experiments/loader_thread.py --data hotpotqa_ircot.jsonl --n 4 --threads 2 \
        --out benchmarks/experiments/loader-thread

One index over the passages of the first ``--n`` questions (one passage = one chunk, the default codec). For
each ``--k`` the first question's ``k`` nearest chunks are fused in each mode, ``--repeats`` times for each
loader setting (`kvrag.loading.store_feed.StoreFeed`'s ``prefetch``: True, a worker thread; False, in the
fusion's thread), the settings interleaved; the figure is the median of ``load_s + fuse_s`` (loading not hidden
plus the fusion loop), one token generated. Writes ``loader_thread.json`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partialmethod
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common
from kvrag.bench.qa_data import build_index, load_questions
from kvrag.config import CodecConfig
from kvrag.loading.store_feed import StoreFeed


def fused_seconds(rag: Any, question: str, keys: list[str], mode: str, prefetch: bool) -> tuple[float, int]:
    """One answer's loading-not-hidden plus fusion seconds, with the feed's prefetch set, and its prompt tokens."""
    original = StoreFeed.__init__
    StoreFeed.__init__ = partialmethod(original, prefetch=prefetch)  # type: ignore[method-assign]
    try:
        answer = rag.answer(question, chunks=keys, mode=mode, max_new_tokens=1)
    finally:
        StoreFeed.__init__ = original  # type: ignore[method-assign]
    return answer.timings["load_s"] + answer.timings["fuse_s"], answer.n_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--k", default="3,16", help="comma list of chunk counts")
    parser.add_argument("--modes", default="prefix,probe,full")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-chunk-tokens", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    common.set_threads(args.threads)
    items = load_questions(Path(args.data), args.n)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvrag-loader-") as tmp:
        rag, _ = build_index(args, items, Path(tmp) / "index", codec=CodecConfig().name)
        with rag:
            question = items[0]["question"]
            for k in (int(t) for t in args.k.split(",")):
                keys = [c.key for c in rag.retrieve(question, k=k)]
                for mode in args.modes.split(","):
                    fused_seconds(rag, question, keys, mode, True)  # warm-up
                    times: dict[bool, list[float]] = {True: [], False: []}
                    tokens = 0
                    for _ in range(args.repeats):
                        for prefetch in (True, False):
                            seconds, tokens = fused_seconds(rag, question, keys, mode, prefetch)
                            times[prefetch].append(seconds)
                    rows.append({"k": k, "prompt_tokens": tokens, "mode": mode,
                                 "thread_s": statistics.median(times[True]),
                                 "inline_s": statistics.median(times[False])})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "loader_thread.json", {**common.stamp(args), "torch_threads": torch.get_num_threads(),
                                                   "rows": rows})
    print(common.markdown_table(["k", "prompt tokens", "mode", "loader thread (s)", "in fusion's thread (s)",
                                 "thread ÷ inline"],
                                [[r["k"], r["prompt_tokens"], r["mode"], r["thread_s"], r["inline_s"],
                                  f"{r['thread_s'] / r['inline_s']:.2f}×"] for r in rows]))


if __name__ == "__main__":
    main()
