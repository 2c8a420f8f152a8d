"""A flat prompt tokenized once, as a full prefill tokenizes it, and the run of tokens each passage has in it.

Contract: `tokenize_prompt(tokenizer, prompt)` gives the prompt's token ids and each token's character span, or
None for a tokenizer that gives no character offsets (a slow one). `PromptTokens.cover(start, stop)` is the run
of tokens ``[i, j)`` that holds the characters ``[start, stop)`` and, around them, at most whitespace (the space a
BPE word token carries in front, the newline some tokenizers join to a full stop), or None where a token joins
the span's characters to other text. A passage's tokens in a prompt are those of this run, which need not be the
tokens of the passage alone: ``"Context: The"`` gives `` The`` where the passage alone gives ``The``, and the
blank line between two passages is two newline tokens where the same blank line at a text's end is one.
Cutting a prompt into pieces at these runs keeps exactly the ids a full prefill of the prompt runs, so that
recomputing every token reproduces it. Pure tokenizer work: no model.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RECENT_PROMPTS = 8  # prompts whose tokens `tokenize_prompt` keeps
ALIGN_SLACK = 3  # tokens a passage's first word may take otherwise in the prompt than alone ("Nob"+"ody", " Nobody")


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's token ids and each token's character span ``[starts[t], ends[t])`` in it."""

    prompt: str
    ids: list[int]
    starts: list[int]
    ends: list[int]

    def cover(self, start: int, stop: int) -> tuple[int, int] | None:
        """The tokens ``[i, j)`` holding characters ``[start, stop)`` and at most whitespace besides (None: a
        token there also holds other text, or the span holds no token).
        """
        i = bisect.bisect_right(self.ends, start)  # the first token ending after ``start`` (spans come in order)
        j = bisect.bisect_left(self.starts, stop, lo=i)  # past the last token starting before ``stop``
        if j == i:
            return None
        before, after = self.prompt[self.starts[i]:start], self.prompt[stop:self.ends[j - 1]]
        if (before and not before.isspace()) or (after and not after.isspace()):
            return None
        return i, j


@functools.lru_cache(maxsize=RECENT_PROMPTS)
def tokenize_prompt(tokenizer: Any, prompt: str) -> PromptTokens | None:
    """``prompt``'s token ids with their character spans (no special tokens added), or None when the tokenizer
    gives no offsets. The last `RECENT_PROMPTS` are kept: a passage cache looks a prompt's passages up, then lays
    the same prompt out. Callers do not change what it returns.
    """
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return None
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    if len(offsets) != len(ids):
        return None
    return PromptTokens(prompt, [int(t) for t in ids], [int(s) for s, _ in offsets], [int(e) for _, e in offsets])


def align(prompt_ids: Sequence[int], stored: Sequence[int]) -> tuple[int, int, int]:
    """Where a passage's tokens in a prompt meet the ids its cache was computed for: ``(n, a, b)``, the longest
    run of ``n`` ids with ``prompt_ids[a:a + n] == stored[b:b + n]``, from the start (``a = b = 0``) when they
    start alike, else with ``a`` and ``b`` at most `ALIGN_SLACK` (a first word joined to the space before it);
    ``(0, 0, 0)`` when there is none.
    """
    best = (common_prefix(prompt_ids, stored), 0, 0)
    if best[0]:
        return best
    for a in range(1, min(ALIGN_SLACK, len(prompt_ids)) + 1):
        for b in range(1, min(ALIGN_SLACK, len(stored)) + 1):
            n = common_prefix(prompt_ids[a:], stored[b:])
            if n > best[0]:
                best = (n, a, b)
    return best


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["PromptTokens", "align", "common_prefix", "tokenize_prompt"]
