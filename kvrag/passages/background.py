"""A background worker that takes batches of items off a queue, so that storing never delays an answer.

Contract: `BackgroundWork(work)` runs ``work(items)`` on one daemon thread for each `submit`'s items, in order.
A failing batch is logged and counted (``failures``) and the next one runs. `flush` waits until every batch
submitted before it has run (or ``timeout`` passes; it returns whether they did). `close` flushes and stops the
thread; a `submit` after `close` raises RuntimeError.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class BackgroundWork(Generic[T]):
    """Run ``work`` on batches of items on a background thread (see the module contract)."""

    def __init__(self, work: Callable[[list[T]], object], name: str) -> None:
        self._work = work
        self._queue: queue.Queue[object] = queue.Queue()
        self._closed = False
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[T]) -> None:
        """Queue ``items`` as one batch."""
        if self._closed:
            raise RuntimeError("this background worker is closed")
        if items:
            self._queue.put(list(items))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch submitted so far has run; False when ``timeout`` passed first."""
        if self._closed or not self._thread.is_alive():  # closed: what was queued has run
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._work(item)  # type: ignore[arg-type]
            except Exception:  # storing is best effort: the passage stays text and is computed next time
                self.failures += 1
                log.exception("storing passage caches failed")
