"""`PassageKeys`: the store keys of a passage cache's entries, and the links between them.

Contract:

- A key hashes the model's fingerprint, the codec with its fitted state's digest, kvrag's prompt prefix, the
  passage's token ids and where its rows were computed (`kvrag.storage.keys.chunk_key`). There are four kinds:
  - **in place** (``context``, a `kvrag.passages.prompt_rows.context_digest`): rows a prompt's pass computed after
    exactly those tokens. Any prompt with the same tokens before the passage needs these very rows there.
  - **after** (``after``, the token ids of the passage before it in that prompt): where rows may be read with some
    of their context, after the same passage.
  - **plain** (neither): a cache computed alone after kvrag's prompt prefix, or rows taken from a prompt's first
    passage; read anywhere.
  - **seen** (``seen``): rows a prompt computed after whatever stood before the passage there, whichever prompt
    stored them first; read anywhere by a fusing answer, which recomputes what their context changed (an answer that
    does not fuse reads no rows computed after other text).
- Rows taken from a prompt are stored once, under their in-place key (a fused pass's: under their after key).
  Their other keys (after or plain, and seen) are **links**: a small entry in the same store naming the stored key
  (`link`). A link never names an entry its key does not describe, so an evicted or rewritten blob is a miss, never
  another context's rows. `stored` follows a link to a blob that is present; a dangling link is overwritten by the
  next `link`.
- Links live in the same bounded store as the blobs and age as they do. A passage reached through one of its keys
  leaves its others unread, and those would be evicted while its blob is still read: rows that come back after
  another passage could no longer be found. So after each answer `keep` marks every found passage's blob used,
  with each of its links (its after, plain and seen keys: opening a link is a use), and points its seen key at its
  blob where that key reaches none and the blob holds a prompt's rows.
- Keys are None while the codec has no fitted state (`digest` None): nothing is read or stored yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvrag.errors import StoreUnavailableError
from kvrag.passages.pending import FoundPassage
from kvrag.storage.keys import chunk_key
from kvrag.storage.kvstore import KVStore

_KEY_CHARS = frozenset("0123456789abcdef")


def _link_key(key: str) -> str:
    """The store key of the link stored under ``key`` (a name of its own: a blob's key is never a link's)."""
    return hashlib.sha256(b"link|" + key.encode()).hexdigest()[:40]


class PassageKeys:
    """Keys of one passage cache (see the module contract).

    Args:
        store: the byte store holding the blobs and the links.
        kvstore: the codec's view of ``store`` (what holds a blob).
        fingerprint: the model's fingerprint.
        prefix_ids: kvrag's prompt prefix, which every plain cache is computed after.
        digest: the codec state's digest (`kvrag.storage.codec_state`), None until it is fitted.
    """

    def __init__(self, store: Any, kvstore: KVStore, fingerprint: str, prefix_ids: Sequence[int],
                 digest: str | None) -> None:
        self.store, self.kvstore, self.fingerprint = store, kvstore, fingerprint
        self.prefix_ids, self.digest = list(prefix_ids), digest

    def key(self, ids: Sequence[int], after: Sequence[int] = (), context: str | None = None,
            seen: bool = False) -> str | None:
        """The key of a passage's entry: in place after the tokens ``context`` digests, else after the passage
        ``after``, else seen (``seen``), else plain; None while the codec has no state.
        """
        if self.digest is None:
            return None
        codec = self.kvstore.codec
        space = f"{self.fingerprint}|{codec.name}:{codec.level}:{self.digest}"
        if context is not None:
            space += "|in:" + context
        elif after:
            space += "|after:" + ",".join(map(str, after))
        elif seen:
            space += "|seen"
        return chunk_key(space, self.prefix_ids, ids)

    def stored(self, ids: Sequence[int], after: Sequence[int] = (), context: str | None = None,
               seen: bool = False) -> str | None:
        """The key of the blob stored for this entry: its own, or the in-place key its link names when that blob is
        present; None when neither.
        """
        key = self.key(ids, after, context, seen)
        return None if key is None else self._reached(key, linked=context is None)  # in-place blobs have no link

    def _reached(self, key: str, linked: bool = True) -> str | None:
        """``key`` when its blob is stored, else (``linked``) the in-place key its link names when that one is."""
        if self.kvstore.contains(key):
            return key
        target = self._linked(key) if linked else None
        return target if target is not None and self.kvstore.contains(target) else None

    def _linked(self, key: str) -> str | None:
        """The in-place key the link under ``key`` names (None: no link, or not a key)."""
        handle = self.store.open(_link_key(key))
        if handle is None:
            return None
        with handle:
            target = handle.read(64).decode("ascii", "replace")
        return target if len(target) == 40 and set(target) <= _KEY_CHARS else None

    def link(self, ids: Sequence[int], after: Sequence[int], target: str) -> None:
        """Make the after (or, with no ``after``, plain) key of ``ids`` name the blob ``target`` (stored under
        another key), and its seen key too where it has an ``after``, each unless it already reaches a stored blob.
        """
        for key in (self.key(ids, after), self.key(ids, seen=True) if after else None):
            if key is not None and key != target and self._reached(key) is None:
                self.store.put(_link_key(key), target.encode("ascii"))

    def keep(self, found: Iterable[FoundPassage]) -> None:
        """Mark each found passage's blob used with the links that reach it, and point its seen key at the blob where
        that key reaches none and the blob holds a prompt's rows (the module contract). Bookkeeping after an answer:
        a store that cannot be reached skips it.
        """
        try:
            for passage in found:
                self.kvstore.touch(passage.key)
                for key in dict.fromkeys((self.key(passage.ids, passage.after), self.key(passage.ids))):
                    if key is not None:
                        self._reached(key)  # a link is opened, so used, where the key has one
                seen = self.key(passage.ids, seen=True)
                if seen is not None and self._reached(seen) is None and passage.prompt_rows:
                    self.store.put(_link_key(seen), passage.key.encode("ascii"))
        except StoreUnavailableError:
            pass
