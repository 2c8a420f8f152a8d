"""`ChatSessions`: find a conversation's kept KV by its token prefix, keep it after each turn.

Contract:

- A conversation is recognised by its plain token ids (its messages as the chat template renders them,
  without passages; the OpenAI API is stateless): after a turn, the KV of the whole conversation so far
  (the model's rows for every message, passages included, and the answer) is kept in `SessionTiers`
  under a digest of those ids. The next turn finds the longest kept prefix of its history at a message
  boundary (`find`); `kvrag.chat.turn` replays the messages after it.
- Keeping runs in one background thread after the answer is generated, so it never delays the answer;
  a later lookup first waits for the keeps still running.
- `HistoryReport` says, per turn, how many history tokens were reused and how many replayed, from which
  tier, and how many messages were dropped to fit the context.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvrag.chat.history import HistoryKV
from kvrag.chat.messages import Conversation, ids_digest
from kvrag.chat.tiers import SessionTiers
from kvrag.config import SessionConfig
from kvrag.model import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class HistoryReport:
    """How a turn got its history's KV."""

    reused_tokens: int  # history tokens whose kept KV was reused
    prefilled_tokens: int  # history tokens computed this turn (replayed turns)
    tier: str | None  # where the kept KV was found ("device", "host", "disk"), None when not
    dropped_messages: int = 0  # earliest messages left out to fit the context (system kept)
    history_cache: bool = True

    def to_json(self) -> dict[str, Any]:
        """The report as `Answer.to_json` gives it."""
        return {"reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens, "tier": self.tier,
                "dropped_messages": self.dropped_messages, "history_cache": self.history_cache}


class ChatSessions:
    """Conversations' kept KV for one model (see the module contract)."""

    def __init__(self, lm: LoadedModel, conversation_of: Callable[[Sequence[Any]], Conversation],
                 config: SessionConfig | None = None) -> None:
        self.lm, self.conversation_of = lm, conversation_of
        self.config = config or SessionConfig()
        self.tiers = SessionTiers(self.config, lm.device, scope=lm.fingerprint[:16])
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvrag-keep")
        self._pending: dict[str, Future[None]] = {}  # keeps still running, by the key they keep under
        self._lock = threading.Lock()
        self.saves = 0
        self.save_s = 0.0
        self.save_errors = 0

    @property
    def budget(self) -> int:
        """Tokens one turn's prompt and answer may take."""
        window = self.lm.spec.max_position
        return min(window, self.config.max_context) if self.config.max_context else window

    # -- finding and keeping ---------------------------------------------------------------------

    def find(self, conv: Conversation) -> tuple[HistoryKV | None, str | None]:
        """The longest kept prefix of ``conv``'s history at a message boundary, and its tier."""
        ids = conv.history_ids
        keys = [ids_digest(ids[:end]) for end in reversed(conv.boundaries())]
        self.wait(keys)
        hit = self.tiers.find(keys)
        return (None, None) if hit is None else hit

    def keep(self, key_ids: list[int], history: HistoryKV) -> None:
        """Keep ``history`` under the conversation whose plain token ids are ``key_ids``, now."""
        self.tiers.put(ids_digest(key_ids), history)

    def keep_async(self, pieces: list[list[int]], build: Callable[[], HistoryKV]) -> None:
        """Keep ``build()``, the KV of the conversation whose messages' plain token ids are ``pieces``, in the
        background; its earlier turns stay findable inside it.
        """
        future = self._saver.submit(self._keep, pieces, build)
        with self._lock:
            self._pending = {k: f for k, f in self._pending.items() if not f.done()}
            self._pending[ids_digest([t for piece in pieces for t in piece])] = future

    def _keep(self, pieces: list[list[int]], build: Callable[[], HistoryKV]) -> None:
        t0 = time.perf_counter()
        try:
            history = build()
            ids = [t for piece in pieces for t in piece]
            prefixes: dict[str, int] = {}
            if not history.dropped and len(history.spans) == len(pieces):  # message i ends at both sums
                plain = internal = 0
                for piece, (_, count) in zip(pieces[:-1], history.spans):
                    plain, internal = plain + len(piece), internal + count
                    prefixes[ids_digest(ids[:plain])] = internal
            self.tiers.put(ids_digest(ids), history, prefixes)
            self.saves += 1
        except Exception as exc:  # the next turn replays its history instead
            self.save_errors += 1
            log.warning("keeping the conversation's KV failed (%s); the next turn replays its history", exc)
        finally:
            self.save_s += time.perf_counter() - t0

    def wait(self, keys: Sequence[str] | None = None) -> None:
        """Wait for the keeps still running (only those keeping under ``keys``, when given)."""
        with self._lock:
            pending = [f for k, f in self._pending.items() if keys is None or k in keys]
        for future in pending:
            future.result()

    # -- the scheduler's hints --------------------------------------------------------------------

    def expect(self, messages: Sequence[Any]) -> None:
        """A request with ``messages`` is queued: keep its history's KV and read it back from disk ahead."""
        self.tiers.expect(self._key(messages))

    def release(self, messages: Sequence[Any]) -> None:
        """The request with ``messages`` is done (see `expect`)."""
        self.tiers.release(self._key(messages))

    def _key(self, messages: Sequence[Any]) -> str:
        return ids_digest(self.conversation_of(messages).history_ids)

    def stats(self) -> dict[str, Any]:
        """Lookups, misses and per-tier hits, bytes and limits; keeps and their background seconds."""
        return {**self.tiers.stats(), "saves": self.saves, "save_s": self.save_s, "save_errors": self.save_errors}

    def close(self) -> None:
        """Finish the keeps still running and empty the tiers."""
        self._saver.shutdown(wait=True)
        self.tiers.close()
