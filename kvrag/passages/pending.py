"""What a passage cache counts and what it has yet to do after an answer: `CacheStats`, `MissingPassage` and
`FoundPassage`.

A lookup (`kvrag.passages.cache.PassageCache`) gives, beside the passages it found, the ones whose rows in the
prompt are to be stored after the answer, off its critical path, and how each found one was reached, whose blob
and links are then marked used (`kvrag.passages.keys.PassageKeys.keep`); the stats count lookups, hits and stores
since the cache was opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrag.passages.prompt_rows import PromptPass


@dataclass
class CacheStats:
    """Passages looked up and found stored, caches stored (a passage found elsewhere adds its in-place entry), and
    the bytes written, since the cache was opened.
    """

    looked_up: int = 0
    found: int = 0
    stored: int = 0
    stored_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Passages found over passages looked up (NaN before any lookup)."""
        return self.found / self.looked_up if self.looked_up else math.nan


@dataclass(frozen=True)
class MissingPassage:
    """A passage whose rows in a prompt are to be stored after the answer: not stored at all, or (``elsewhere``)
    stored only for other tokens before it, when just its in-place entry from an exact pass is wanted.
    """

    text: str
    ids: tuple[int, ...]  # its tokens in that prompt
    after: tuple[int, ...] = ()  # the passage before it in that prompt (`PassageKeys.key`)
    source: PromptPass | None = field(default=None, compare=False)  # the pass of the prompt that missed it
    exact: bool = field(default=False, compare=False)  # that pass read no stored cache: its rows are a full prefill's
    elsewhere: bool = field(default=False, compare=False)  # found, but not in place: only an in-place entry is stored


@dataclass(frozen=True)
class FoundPassage:
    """A passage a lookup found stored under ``key``, reached from its tokens ``ids`` after the passage ``after``.
    ``prompt_rows``: the blob holds rows a prompt's pass computed (found in place, after the same passage, or seen),
    which the passage's seen key may name.
    """

    ids: tuple[int, ...]
    after: tuple[int, ...]
    key: str
    prompt_rows: bool
