"""What the serve worker and the routes exchange: a chat `Job`, the events it emits, and why a job is refused.

Contract: a `Job` reports through its ``emit`` callback, in order, zero or more `Piece` then exactly one `Done` or
`Failed` (see `kvrag.serve.scheduler`). `QueueFull` and its `WaitTooLong` refuse a job at submission and carry
``retry_after``, the seconds after which a retry may be admitted; `ServerStopping` fails the jobs of a server that
shuts down. Nothing here touches the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvrag.serve.admission import Pending


class QueueFull(Exception):
    """The bounded queue of waiting requests is full; ``retry_after``: seconds before a retry may be admitted."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WaitTooLong(QueueFull):
    """A request's expected wait for its first token exceeds the server's bound; ``place``: its place in the waiting
    line (1 for the first), or None when it holds none.
    """

    def __init__(self, message: str, retry_after: float = 1.0, place: int | None = None) -> None:
        super().__init__(message, retry_after)
        self.place = place


class ServerStopping(Exception):
    """The server is shutting down; the job was not (fully) served."""


@dataclass(frozen=True)
class Piece:
    """A piece of the answer's text, as generated."""

    text: str


@dataclass(frozen=True)
class Done:
    """The job finished: its `Answer` (None if kvrag gave none), how long it waited for a slot, and why it
    ended: ``"length"`` (``max_new_tokens`` reached) or ``"stop"`` (EOS or a stop string).
    """

    answer: Any
    queue_s: float
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Failed:
    """The job failed with ``error`` (an `InputError` is the request's fault; anything else the server's)."""

    error: BaseException


Event = Piece | Done | Failed


@dataclass(eq=False)
class Job:
    """One chat request: the messages, `KVRag.chat_stream`'s keyword arguments, and where events go."""

    messages: list[dict[str, str]]
    kwargs: dict[str, Any]
    emit: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    answer: Any = None
    steps: int = 0  # next() calls that returned (the first one gives the first token)
    replayed_wait: float | None = None  # the uncalibrated expected wait at admission, for `observe_wait`
    ticket: str | None = None  # the request's `kvrag.serve.line.request_ticket`: its place in the line when refused
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _stream: Iterator[str] | None = None

    def cancel(self) -> None:
        """Stop serving this job (any thread): its generator is closed at the worker's next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` was called."""
        return self._cancelled.is_set()

    def pending(self) -> Pending:
        """What this job still needs of the worker, for `expected_wait`."""
        limit = self.kwargs.get("max_new_tokens") or 256
        return Pending(max(int(limit) - self.steps, 1), self.steps > 0)
