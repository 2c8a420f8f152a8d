"""Prefill slices: a long fusion or prefill hands its thread back between slices of bounded work.

Contract: a thread that interleaves answers (`kvrag serve`'s worker) installs a `Slicer` (`installed`) with a
budget in tokens and a callback. The fusion loop (`kvrag.fusion.loop`, which also runs every plain prefill)
reports each block of tokens it ran through one decoder layer (`ran`); once the work since the last hand-back
reaches ``budget_tokens`` tokens through every layer of the model (``budget_tokens × n_layers`` token-layers), the
slicer calls the callback, which runs other answers' decoding steps, before the next block runs, provided
``interval_s`` has passed since the last hand-back: each hand-back costs a round of token steps that reads all the
weights, so slices end only as often as the answers streaming need a token. A fusion also
hands back as it begins (`boundary`), so the work before it (retrieval, laying the prompt out) is a slice of its
own rather than a prefix of the first one. A plain forward pass (a conversation's history, `kvrag.chat.history`)
runs in pieces of `budget_tokens` tokens, handing back before each; those pieces give the whole pass's rows to float
rounding, not bit for bit. Nothing in the
computation changes, block for block: only what runs between two blocks does, so a sliced fusion's logits and
selection are bitwise those of an unsliced one. A slice is never shorter than one block of one layer. The callback
does not nest: while it runs, no further hand-back is made. Without an installed slicer `ran` does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

_local = threading.local()


class Slicer:
    """Calls ``between`` each time ``budget_tokens`` tokens' worth of layer work has run, once ``interval_s`` seconds
    have passed since the last hand-back (or `reset`): a slice ends at the first budget's end after the interval (see
    the module docstring).

    Attributes:
        hand_backs: how many times ``between`` was called, over this slicer's life.
    """

    def __init__(self, budget_tokens: int, between: Callable[[], None], interval_s: float = 0.0) -> None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise ValueError(f"budget_tokens must be a positive int, got {budget_tokens!r}")
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self.budget_tokens, self.between, self.interval_s = budget_tokens, between, interval_s
        self.hand_backs = 0
        self._done = 0  # token-layers since the last hand-back
        self._since = time.perf_counter()  # the last hand-back or reset
        self._inside = False

    def ran(self, tokens: int, n_layers: int) -> None:
        """``tokens`` tokens ran through one layer of an ``n_layers``-layer model: hand back once the budget is
        spent.
        """
        if self._inside:
            return
        self._done += tokens
        if self._done >= self.budget_tokens * max(n_layers, 1):
            self._done = 0
            self.boundary()

    def boundary(self) -> None:
        """A stage ends: hand back if ``interval_s`` has passed since the last hand-back."""
        if self._inside or time.perf_counter() - self._since < self.interval_s:
            return
        self._done = 0
        self._inside = True
        try:
            self.between()
        finally:
            self._inside = False
            self._since = time.perf_counter()
        self.hand_backs += 1

    def reset(self) -> None:
        """Start counting afresh, as if a hand-back just ended (the others were just given their tokens)."""
        self._done = 0
        self._since = time.perf_counter()


@contextlib.contextmanager
def installed(slicer: Slicer | None) -> Iterator[Slicer | None]:
    """Install ``slicer`` on this thread for the block (None installs nothing)."""
    previous = getattr(_local, "slicer", None)
    _local.slicer = slicer
    try:
        yield slicer
    finally:
        _local.slicer = previous


def current() -> Slicer | None:
    """The slicer installed on this thread, if any."""
    return getattr(_local, "slicer", None)


def boundary() -> None:
    """Hand back to the installed slicer between two stages (nothing when none is installed)."""
    if (slicer := current()) is not None:
        slicer.boundary()


def budget_tokens() -> int | None:
    """The installed slicer's budget in tokens, for a plain forward pass that runs in pieces of that many tokens
    (None when no slicer is installed).
    """
    slicer = current()
    return None if slicer is None else slicer.budget_tokens


def ran(tokens: int, n_layers: int) -> None:
    """Report ``tokens`` tokens run through one layer to the installed slicer (nothing when none is)."""
    if (slicer := current()) is not None:
        slicer.ran(tokens, n_layers)
