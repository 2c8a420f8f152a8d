"""A streamed answer trimmed as `Answer.text` is: what the frameworks' streams yield.

Contract: `trimmed(pieces)` yields non-empty text pieces that join to ``"".join(pieces).strip()``: leading
whitespace is dropped and trailing whitespace held back until more text follows it. It imports nothing heavy, so
the framework adapters can use it at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def trimmed(pieces: Iterable[str]) -> Iterator[str]:
    """``pieces`` as non-empty pieces of their joined text, stripped (see the module docstring)."""
    pending, started = "", False
    for piece in pieces:
        if not started:
            piece = piece.lstrip()
            started = bool(piece)
        body = piece.rstrip()
        if body:
            yield pending + body
            pending = piece[len(body):]
        else:
            pending += piece
