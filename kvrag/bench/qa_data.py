"""The QA data a quality benchmark runs on: questions from a JSONL file, their passages as index
documents (one passage = one chunk), and the index built over them.

A QA file holds one JSON object per line: ``{id, question, answers: [str], ctxs: [{title, text}]}``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.config import SplitConfig
from kvrag.indexing.kvgen import chunk_key
from kvrag.prompt import chunk_token_ids
from kvrag.rag import KVRag


def load_questions(path: Path, n: int) -> list[dict[str, Any]]:
    """Read the first ``n`` items of a QA JSONL file, checked for the fields the benchmark uses."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            missing = {"id", "question", "answers", "ctxs"} - item.keys()
            if missing:
                raise ValueError(f"{path}:{lineno}: item lacks {sorted(missing)}")
            items.append(item)
            if len(items) == n:
                break
    if not items:
        raise ValueError(f"no questions in {path}")
    return items


def passage_text(ctx: dict[str, str]) -> str:
    title = (ctx.get("title") or "").strip()
    return f"{title}\n{ctx['text']}" if title else ctx["text"]


def passage_documents(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(f"{item['id']}/{j}", passage_text(ctx)) for item in items for j, ctx in enumerate(item["ctxs"])]


def pool_documents(paths: Sequence[Path], exclude: set[str]) -> list[tuple[str, str]]:
    """``(id, text)`` of the passages in ``paths`` (QA JSONL files, or JSON files holding a list of
    ``{title, text}``), each text once, leaving out the texts in ``exclude``.
    """
    seen = set(exclude)
    docs = []
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                passages = [ctx for line in fh if line.strip() for ctx in json.loads(line).get("ctxs", [])]
        else:
            passages = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(passages, list):
                raise ValueError(f"{path}: expected a JSON list of {{title, text}} passages")
        for j, ctx in enumerate(passages):
            if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
                raise ValueError(f"{path}: passage {j} has no text")
            text = passage_text(ctx)
            if text not in seen:
                seen.add(text)
                docs.append((f"pool/{path.stem}/{j}", text))
    return docs


def passage_keys(rag: Any, item: dict[str, Any]) -> list[str]:
    """Chunk keys of an item's passages in dataset order (content hash, so duplicates share keys)."""
    keys = []
    for ctx in item["ctxs"]:
        ids = chunk_token_ids(rag.lm.tokenizer, passage_text(ctx))
        key = chunk_key(rag.lm.fingerprint, rag.layout.prefix_ids, ids)
        if key not in rag.index:
            raise ValueError(f"passage of {item['id']!r} is not one chunk in the index; raise --max-chunk-tokens")
        keys.append(key)
    return keys


def build_index(args: argparse.Namespace, items: list[dict[str, Any]], index_dir: Path,
                neighbour_context: int | None = None, neighbour_kv: str | None = None,
                pool: Sequence[Path] = (), question_tail: str = "", codec: str = "raw") -> tuple[Any, float]:
    """The index over the questions' passages (with caches), after the ``pool`` passages (without).

    The caches are lossless by default: the quality benches measure fusion, and `kvrag bench codec` a codec's
    effect; ``codec`` builds them as a user's index would store them instead.
    """
    t0 = time.perf_counter()
    split = SplitConfig(mode="document", max_tokens=args.max_chunk_tokens, min_tokens=0)
    docs = passage_documents(items)
    first = pool_documents(pool, {text for _, text in docs}) if pool else docs
    rag = KVRag.build(first, index_dir, model=args.model, split=split, device=args.device, codec=codec,
                      neighbour_context=neighbour_context, neighbour_kv=neighbour_kv, show_progress=False,
                      caches=not pool, question_tail=question_tail)
    if pool:
        rag.add(docs, show_progress=False)
    return rag, time.perf_counter() - t0
