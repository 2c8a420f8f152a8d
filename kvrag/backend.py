"""`AnswerBackend`: what answers a framework's prompts and conversations, with an index or without one.

Contract: two classes implement it, and the framework adapters (`kvrag.integrations`) take either through it alone,
never telling them apart by probing for attributes (the server, and the adapters' retrievers, are over an index and
take `KVRag` itself):

- `kvrag.KVRag`, over an index: a prompt reads the caches of the index's chunks found in it; a chat turn retrieves
  its passages;
- `kvrag.passages.PassageCache`, without an index: a prompt's passages are found in the prompt as the framework
  wrote it (``written``), read from the cache where stored and stored after the answer; `warm` stores passages
  ahead of the first prompt that holds them.

Each method answers as `KVRag.answer` does, under the correctness gate by default, and returns the call's own
`Answer` (``last_answer`` is the last call's, whichever thread made it). A backend refuses what it cannot do with
a one-line `TypeError` (`KVRag.warm`: an index stores its chunks' caches when they are added).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvrag.config import GateConfig
    from kvrag.model import LoadedModel
    from kvrag.query.answer import Answer


@runtime_checkable
class AnswerBackend(Protocol):
    """An opened `kvrag.KVRag` or `kvrag.passages.PassageCache` (see the module's contract)."""

    lm: LoadedModel
    last_answer: Answer | None

    def describe(self) -> dict[str, str]:
        """Where the caches live, for an adapter's identifying parameters: ``{"index": folder}`` or
        ``{"cache": store}``, with ``"model"``.
        """
        ...

    def stream_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, *,
                      max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
                      seed: int | None = None, gate: GateConfig | bool | None = None,
                      written: str | None = None) -> Generator[str, None, Answer]:
        """Yield the answer to the flat ``prompt`` and return its `Answer`; ``written`` is the prompt as the framework
        wrote it, before a chat template was put around it (default: ``prompt``).
        """
        ...

    def chat(self, messages: Sequence[dict[str, str]], k: int = 4, mode: str | None = None,
             ratio: float | None = None, **options: Any) -> Answer:
        """Answer a conversation's last user message."""
        ...

    def chat_stream(self, messages: Sequence[dict[str, str]], k: int = 4, mode: str | None = None,
                    ratio: float | None = None, *, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
                    gate: GateConfig | bool | None = None, retrieve: bool = True,
                    history_cache: bool = True) -> Generator[str, None, Answer]:
        """`chat`, yielding the answer's text as it is generated."""
        ...

    def warm(self, texts: Iterable[str], show_progress: bool = True) -> int:
        """Store now the caches of the passages of ``texts``; how many were stored."""
        ...
