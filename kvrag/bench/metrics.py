"""Answer-quality metrics: SQuAD token F1 / exact match, Rouge-L, agreement, summary stats and
bootstrap intervals.

Pure Python, no model: the scores take strings (or numbers) and return a float in [0, 1] (or a dict
of floats); `departure` and `reference_margin` locate where an answer leaves the reference's.
Normalisation follows the official SQuAD v1.1 script: lower-case, drop
punctuation, drop the articles ``a``/``an``/``the``, collapse whitespace.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1; two empty answers agree (1.0), one empty answer scores 0.0."""
    pred, ref = answer_tokens(prediction), answer_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    return prev[-1]


def rouge_l(prediction: str, gold: str) -> float:
    """Rouge-L F-measure (beta = 1) of the longest common subsequence of normalised tokens."""
    pred, ref = answer_tokens(prediction), answer_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    lcs = _lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_over_golds(metric: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """Return the best score of ``prediction`` against any gold answer (0.0 when there is none)."""
    return max((metric(prediction, g) for g in golds), default=0.0)


def gold_scores(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """F1, exact match and Rouge-L, each the best over the gold answers."""
    return {
        "f1": best_over_golds(token_f1, prediction, golds),
        "em": best_over_golds(exact_match, prediction, golds),
        "rouge_l": best_over_golds(rouge_l, prediction, golds),
    }


def is_right(answer: str, golds: Sequence[str]) -> bool:
    """Right: gold token F1 >= 0.5, or a normalised gold answer contained in the normalised answer."""
    norm = normalize_answer(answer)
    return (best_over_golds(token_f1, answer, golds) >= 0.5
            or any(normalize_answer(g) and normalize_answer(g) in norm for g in golds))


def agreement(answer: str, reference: str) -> float:
    """Token F1 between a mode's answer and the ``full`` answer on the same input."""
    return token_f1(answer, reference)


def first_token_agreement(token_ids: Sequence[int], reference_ids: Sequence[int]) -> float:
    """1.0 when both answers start with the same token id (or are both empty)."""
    if not token_ids or not reference_ids:
        return float(not token_ids and not reference_ids)
    return float(token_ids[0] == reference_ids[0])


def departure(token_ids: Sequence[int], reference_ids: Sequence[int]) -> int | None:
    """Index of the first token where an answer departs from the reference answer; None when they
    are the same. An answer that stops early (or runs on) departs where the shorter one ends.
    """
    for i, (a, b) in enumerate(zip(token_ids, reference_ids)):
        if a != b:
            return i
    return None if len(token_ids) == len(reference_ids) else min(len(token_ids), len(reference_ids))


def reference_margin(reference_logprobs: Any, token_ids: Sequence[int],
                     reference_ids: Sequence[int], step: int) -> float:
    """How much more the reference model preferred its own token than the other answer's at ``step``
    (log-probabilities, nats): ``reference_logprobs[step]`` (a tensor or nested lists ``[T, vocab]``)
    is its distribution there. Near zero, the reference itself nearly chose the other token. NaN where
    one answer has already ended.
    """
    if step >= len(reference_ids) or step >= len(token_ids):
        return math.nan
    row = reference_logprobs[step]
    return float(row[reference_ids[step]]) - float(row[token_ids[step]])


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and 90th percentile (NaN for no values)."""
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals) if vals else math.nan
    return {"mean": mean, "p50": percentile(vals, 50), "p90": percentile(vals, 90), "n": len(vals)}


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (questions resampled with replacement);
    seeded, so a report is reproducible. NaN for no values.

    Pass per-question differences (a mode minus another on the same questions) for a paired interval:
    one that excludes 0 separates the two modes on this data.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    vals = [float(v) for v in values]
    if not vals:
        return math.nan, math.nan
    rng = random.Random(seed)
    n = len(vals)
    means = [sum(rng.choices(vals, k=n)) / n for _ in range(resamples)]
    tail = (1 - level) / 2 * 100
    return percentile(means, tail), percentile(means, 100 - tail)
