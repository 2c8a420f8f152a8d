"""Locate stored chunk texts inside a flat prompt string (the framework adapters' one helper).

LangChain and LlamaIndex hand the LLM a single string; the chunks a retriever returned are in it
somewhere, wrapped by the framework's template. `find_chunk_spans` finds exact occurrences of each
candidate chunk's stripped text, keeps a non-overlapping set in prompt order, and says for each
whether it is followed by kvrag's `SEPARATOR` — only then do its prompt tokens equal the tokens its
cache was computed for (`chunk_token_ids`), so only then is the span ``cacheable``. Anything not
found exactly (edited, truncated, missing) is simply not matched: it stays plain text and is
recomputed. This module is pure string work; it knows nothing about models or frameworks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvrag.prompt import SEPARATOR


class ChunkLike(Protocol):
    """Anything with a chunk's ``key`` and ``text`` (e.g. `kvrag.RetrievedChunk`)."""

    @property
    def key(self) -> str: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class Span:
    """One occurrence of a chunk in the prompt.

    Attributes:
        start: offset of the chunk's stripped text in the prompt.
        end: offset just past it (the separator, when present, starts here).
        chunk: the candidate found.
        cacheable: the text is followed by `SEPARATOR`, so the stored cache matches its tokens.
    """

    start: int
    end: int
    chunk: ChunkLike
    cacheable: bool

    @property
    def stop(self) -> int:
        """End of the span including its separator when it is cacheable."""
        return self.end + len(SEPARATOR) if self.cacheable else self.end


def _occurrences(prompt: str, needle: str) -> Iterable[int]:
    start = prompt.find(needle)
    while start >= 0:
        yield start
        start = prompt.find(needle, start + 1)


def find_chunk_spans(prompt: str, candidates: Iterable[ChunkLike]) -> list[Span]:
    r"""Exact, non-overlapping occurrences of the candidates' stripped texts, in prompt order.

    Every occurrence of a chunk is matched (a repeated chunk reuses its cache at each place). Where
    two occurrences overlap, the earlier one wins, then the longer one; the loser is unmatched.
    Candidates with the same text are tried once.

    Args:
        prompt: the flat prompt string the LLM received.
        candidates: chunks that may appear in it (with ``key`` and ``text``).

    Returns:
        Spans sorted by ``start``; ``[]`` when no candidate occurs.

    Example:
        >>> from kvrag.query.answer import RetrievedChunk
        >>> c = RetrievedChunk("k1", "Paris is in France. ", 1.0, "d", "", 0)
        >>> [(s.start, s.cacheable) for s in find_chunk_spans("Context: Paris is in France.\n\nQ?", [c])]
        [(9, True)]
    """
    found: list[tuple[int, int, ChunkLike]] = []
    seen: set[str] = set()
    for chunk in candidates:
        needle = chunk.text.strip()
        if not needle or needle in seen:
            continue
        seen.add(needle)
        found.extend((start, start + len(needle), chunk) for start in _occurrences(prompt, needle))
    found.sort(key=lambda f: (f[0], -(f[1] - f[0])))
    spans: list[Span] = []
    covered = 0
    for start, end, chunk in found:
        if start < covered:
            continue
        cacheable = prompt.startswith(SEPARATOR, end)
        spans.append(Span(start, end, chunk, cacheable))
        covered = end
    return spans
