"""Index-build benchmark: the cache phase's throughput against a plain prefill of the same chunks.

DESIGN's target: an index build precomputes and stores chunk caches at least at 80 % of the model's
plain prefill throughput, encoding and writing overlapped with compute.

Over the passages of the first ``--n`` questions of a QA JSONL (one passage = one chunk), per codec:

1. *Warm-up* (not timed): an index over the passages of the first ``--fit`` questions, with caches.
   A codec that needs fitting is fitted there, once per index, as in a real build.
2. *Build*: that index (a fresh copy per repeat) extended with the other questions' passages
   (`KVRag.add`). Its cache phase (`BuildStats.kv_s`: the batched prefill after the prompt prefix,
   the caches taken out and keys un-rotated, encoding and writing on the writer thread, and the
   wait for the last write) gives tokens per second.
3. *Plain prefill*: the same chunks' token ids through the model after the prefix, batched the same
   way, nothing kept (`kvrag.indexing.kvgen.plain_prefill`).

Builds and plain prefills alternate, ``--repeats`` times; the best of each counts. Mounted as
``kvrag bench build --data QA.jsonl [--n 12] [--fit 4] [--codecs raw,cachegen] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common
from kvrag.bench.common import markdown_table
from kvrag.bench.qa_data import load_questions, passage_documents
from kvrag.config import SplitConfig
from kvrag.indexing.kvgen import plain_prefill
from kvrag.model import load_model
from kvrag.prompt import chunk_token_ids
from kvrag.rag import KVRag

log = logging.getLogger(__name__)


def _documents(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    seen: set[str] = set()
    docs = []
    for doc_id, text in passage_documents(items):
        if text not in seen:  # a passage shared by two questions is one chunk
            seen.add(text)
            docs.append((doc_id, text))
    return docs


def run_build_bench(lm: Any, items: list[dict[str, Any]], fit: int, codecs: list[str], repeats: int,
                    batch_tokens: int, work: Path) -> list[dict[str, Any]]:
    """One row per codec: tokens, best build and plain-prefill tokens/s, their ratio, stored bytes."""
    first, rest = _documents(items[:fit]), _documents(items[fit:])
    indexed = {text for _, text in first}
    rest = [d for d in rest if d[1] not in indexed]
    if not first or not rest:
        raise ValueError(f"bench build needs passages in both the first {fit} questions and the rest")
    split = SplitConfig(mode="document", max_tokens=2048, min_tokens=0)  # one chunk per passage
    ids = [chunk_token_ids(lm.tokenizer, text) for _, text in rest]
    rows = []
    for codec in codecs:
        warm = work / f"warm-{codec}"
        KVRag.build(first, warm, model=lm, split=split, codec=codec, batch_tokens=batch_tokens,
                    show_progress=False).close()
        best_build = best_plain = 0.0
        stats, tokens = None, 0
        for r in range(max(1, repeats)):
            target = work / f"{codec}-{r}"
            shutil.copytree(warm, target)
            with KVRag.open(target, model=lm) as rag:
                t0 = time.perf_counter()
                tokens = plain_prefill(lm, rag.prefix, ids, batch_tokens)
                plain = tokens / (time.perf_counter() - t0)
                stats = rag.add(rest, show_progress=False)
            best_plain, best_build = max(best_plain, plain), max(best_build, stats.prefill_tokens_per_s)
            shutil.rmtree(target)
            log.info("%s, repeat %d: plain prefill %.0f tok/s, build %.0f tok/s", codec, r, plain,
                     stats.prefill_tokens_per_s)
        assert stats is not None
        rows.append({"codec": codec, "chunks": stats.prefilled_chunks, "tokens": stats.prefilled_tokens,
                     "plain_tokens": tokens,
                     "plain_tok_s": best_plain, "build_tok_s": best_build, "ratio": best_build / best_plain,
                     "stored_MB": stats.stored_bytes / 1e6})
        shutil.rmtree(warm)
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["codec", "chunks", "tokens", "plain prefill tok/s", "build tok/s", "build / plain", "stored MB"]
    table = [[r["codec"], r["chunks"], r["tokens"], r["plain_tok_s"], r["build_tok_s"], r["ratio"], r["stored_MB"]]
             for r in rows]
    return markdown_table(headers, table) + (
        "\n\nbuild: the cache phase of `KVRag.add` (prefill after the prompt prefix, caches taken out, encoded and "
        "written on the writer thread, the last write waited for); plain prefill: the same token batches through "
        "the model, nothing kept. Best of the repeats; target: build / plain >= 0.8.")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.fit < args.n:
        raise ValueError(f"--fit must be in 1..--n - 1, got --fit {args.fit} with --n {args.n}")
    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_questions(Path(args.data), args.n)
    lm = load_model(args.model, device=args.device)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-build-") as work:
        rows = run_build_bench(lm, items, args.fit, codecs, args.repeats, args.batch_tokens, Path(work))
    out = Path(args.out)
    table = to_markdown(rows)
    common.write_json(out / "build.json", {**common.stamp(args), "model": args.model, "questions": len(items),
                                           "torch_threads": torch.get_num_threads(), "rows": rows})
    (out / "build.md").write_text(f"# kvrag bench build\n\n{len(items)} questions of `{Path(args.data).name}`, "
                                  f"model `{args.model}`, {torch.get_num_threads()} torch threads\n\n{table}\n")
    print(table)
    return 0
