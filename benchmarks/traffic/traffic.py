"""The traffic: one corpus pooled from QA files, and a stream of distinct questions whose popularity is Zipf-skewed.

Contract (pure Python, no model, no randomness but ``random.Random(seed)``):

- `load_pool` reads question items from ``FILE[:A-B]`` specs (1-based inclusive line ranges of a QA JSONL file,
  ``{id, question, answers, ctxs: [{title, text}]}``); `corpus_passages` pools every passage of the corpus files,
  each text once (``title\\ntext``, `kvrag.bench.qa_data.passage_text`), in file order.
- `zipf_stream` ranks the items by a seeded shuffle and draws ``n`` of them with probability proportional to
  ``1 / rank ** s``. An item drawn for the ``j``-th time is asked as its ``j``-th rewording (`reword`: a fixed
  prefix and suffix around the original question; ``j = 0`` is the question as written), so every question in the
  stream is a distinct string while a popular item, and so its passages, recurs. An item whose `MAX_VARIANTS`
  wordings are used up gets no more draws (counted in ``exhausted_draws``). The same arguments give the same stream.
- `phases` labels each position of the stream: ``cold`` (the first ``window`` questions after the fresh start, every
  store empty but the index built ahead), ``from_disk`` (the first ``window`` questions after a restart: new
  processes over the stores left on disk) and ``warm`` (the rest).
- `popularity` measures what the stream did to the passages: how often each was retrieved, the share of the most
  retrieved one, and the exponent of a least-squares line through log(count) against log(rank).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIXES = ("", "Question: ", "Please answer: ", "Quick question: ", "I would like to know: ", "Can you tell me: ",
            "From the documents: ", "Help me with this: ")
SUFFIXES = ("", " Answer briefly.", " Be concise.", " Keep it short.", " One short phrase, please.", " Thanks!")
MAX_VARIANTS = len(PREFIXES) * len(SUFFIXES)


def reword(question: str, j: int) -> str:
    """The ``j``-th wording of ``question`` (0: itself): ``PREFIXES[j % 8] + question + SUFFIXES[j // 8]``."""
    if not 0 <= j < MAX_VARIANTS:
        raise ValueError(f"wording {j} out of range [0, {MAX_VARIANTS})")
    return PREFIXES[j % len(PREFIXES)] + question.strip() + SUFFIXES[j // len(PREFIXES)]


def parse_spec(spec: str) -> tuple[Path, int, int | None]:
    """``FILE`` or ``FILE:A-B`` (1-based, inclusive) -> (path, first index, end index or None)."""
    path, colon, span = spec.rpartition(":")
    if not colon or "-" not in span or not span.replace("-", "").isdigit():
        return Path(spec), 0, None
    a, _, b = span.partition("-")
    if int(a) < 1 or int(b) < int(a):
        raise ValueError(f"bad range in {spec!r}: expected FILE:A-B with 1 <= A <= B")
    return Path(path), int(a) - 1, int(b)


def read_items(path: Path) -> list[dict[str, Any]]:
    """Every item of a QA JSONL file, checked for the fields used here."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                item = json.loads(line)
                missing = {"id", "question", "answers", "ctxs"} - item.keys()
                if missing:
                    raise ValueError(f"{path}:{lineno}: item lacks {sorted(missing)}")
                items.append(item)
    return items


def load_pool(specs: Sequence[str]) -> list[dict[str, Any]]:
    """The question items the stream draws from: each spec's range, in order, ids made unique by file."""
    pool, seen = [], set()
    for spec in specs:
        path, start, end = parse_spec(spec)
        for item in read_items(path)[start:end]:
            key = f"{path.stem}/{item['id']}"
            if key not in seen:
                seen.add(key)
                pool.append({"key": key, "question": item["question"], "answers": list(item["answers"])})
    if not pool:
        raise ValueError(f"no questions in {list(specs)}")
    return pool


def corpus_passages(paths: Sequence[Path]) -> list[tuple[str, str]]:
    """``(id, text)`` of every passage of ``paths``, each text once, in file order."""
    from kvrag.bench.qa_data import passage_text

    seen: set[str] = set()
    out = []
    for path in paths:
        for i, item in enumerate(read_items(path)):
            for j, ctx in enumerate(item["ctxs"]):
                text = passage_text(ctx).strip()
                if text and text not in seen:
                    seen.add(text)
                    out.append((f"{path.stem}/{i}/{j}", text))
    return out


def zipf_stream(pool: Sequence[dict[str, Any]], n: int, s: float, seed: int) -> tuple[list[dict[str, Any]], dict]:
    """``n`` questions drawn from ``pool`` with Zipf weights of exponent ``s`` over a seeded ranking (see the
    module docstring), and what the draw did (``ranking``, ``exhausted_draws``, draws per item).
    """
    if n < 1 or s < 0:
        raise ValueError(f"n must be >= 1 and s >= 0, got {n}, {s}")
    if n > len(pool) * MAX_VARIANTS:
        raise ValueError(f"{n} questions need more than {len(pool)} items x {MAX_VARIANTS} wordings")
    rng = random.Random(seed)
    ranking = list(range(len(pool)))
    rng.shuffle(ranking)
    weights = [1.0 / (r + 1) ** s for r in range(len(pool))]
    asked: Counter[int] = Counter()
    stream, exhausted = [], 0
    while len(stream) < n:
        rank = rng.choices(range(len(pool)), weights=weights)[0]
        if asked[rank] >= MAX_VARIANTS:
            exhausted += 1
            weights[rank] = 0.0
            continue
        item = pool[ranking[rank]]
        j = asked[rank]
        asked[rank] += 1
        stream.append({"position": len(stream), "item": item["key"], "rank": rank + 1, "variant": j,
                       "question": reword(item["question"], j), "answers": item["answers"]})
    questions = [q["question"] for q in stream]
    assert len(set(questions)) == len(questions), "every question in the stream is asked once"
    info = {"items": len(pool), "zipf_s": s, "seed": seed, "exhausted_draws": exhausted,
            "draws_by_rank": {str(r + 1): c for r, c in sorted(asked.items())},
            "distinct_items": len(asked), "max_draws_of_one_item": max(asked.values())}
    return stream, info


def phases(n: int, restarts: Sequence[int], window: int) -> list[str]:
    """Each position's phase: ``cold``, ``from_disk`` or ``warm`` (module docstring)."""
    starts = sorted({0, *restarts})
    out = []
    for i in range(n):
        start = max(s for s in starts if s <= i)
        if i - start < window:
            out.append("cold" if start == 0 else "from_disk")
        else:
            out.append("warm")
    return out


def popularity(retrieved: Sequence[Sequence[str]]) -> dict[str, Any]:
    """How the stream spread over the passages: retrievals per passage, the top passage's share of questions, and
    the fitted exponent ``s`` of count ~ rank ** -s (least squares in log-log over the passages retrieved).
    """
    counts = Counter(p for ids in retrieved for p in set(ids))
    if not counts:
        return {"passages_retrieved": 0}
    ordered = sorted(counts.values(), reverse=True)
    xs = [math.log(r) for r in range(1, len(ordered) + 1)]
    ys = [math.log(c) for c in ordered]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else math.nan
    return {"passages_retrieved": len(counts), "questions": len(retrieved),
            "top_passage_share": ordered[0] / len(retrieved), "top10_counts": ordered[:10],
            "fitted_exponent": -slope, "retrieved_once": sum(c == 1 for c in ordered)}
