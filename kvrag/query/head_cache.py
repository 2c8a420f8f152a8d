"""`HeadCache`: the exact KV of prompt heads seen before, found by token prefix and bounded in bytes.

A framework's prompt starts with text kvrag did not write: the chat template, the framework's instructions,
sometimes the question. That head comes back almost unchanged from call to call, so its KV is kept the
way a prefix cache keeps it: by token ids. `HeadCache.split` finds the kept head that shares the longest run
of leading tokens with the new one and reuses those rows (they are exact: causal attention makes a prefix's
KV independent of what follows it); the head's other tokens are recomputed with the rest of the prompt. A
head that puts the question before the passages (LangChain's tutorial prompt) thus recomputes only its own
question. `HeadCache.prefix_for` prefills a head's missing tokens on their own and keeps the whole head;
`HeadCache.leading` gives a prompt with no passage the kept rows it starts with and leaves the rest to the caller's
pass (one pass over the prompt, as fast as a full prefill).

Whole prompts are kept apart from heads, under a bound of their own: `HeadCache.keep_prompt` keeps the rows of a
prompt the gate answered from exact rows (a full prefill, or kept rows and one pass after them), and
`HeadCache.covered` says how many leading tokens of a new prompt a kept prompt holds. The gate then reads the
passages inside that run from those exact rows instead of fusing their stored caches (`kvrag.query.locate`): a
prompt asked again, or the same passages before a new question (a context-first template), gets the full prefill's
answer from one pass over the tokens after them. Only lookups that ask for them (``prompts=True``) see kept prompts,
so an explicit mode, ``full`` included, computes what it names.
Entries are evicted least recently used first once their bytes pass their bound. Both kinds are found through a
token trie (`kvrag.query.prefix_trie.PrefixLRU`): a lookup's cost follows the new prompt's length, not the number
of heads and prompts kept; on a tie, a head wins over a prompt, then the least recently used.

Thread-safe: lookups and insertions hold a lock; the prefill itself runs outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvrag.model import LoadedModel, hf_compat
from kvrag.model.prefix import PrefixCache, prefix_cache
from kvrag.query.prefix_trie import PrefixLRU

DEFAULT_HEAD_BYTES = 256 << 20
DEFAULT_PROMPT_BYTES = 512 << 20


def _nbytes(prefix: PrefixCache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in prefix.kv)


class HeadCache:
    """Exact KV of recent prompt heads, keyed by their token ids (see the module docstring).

    Args:
        max_bytes: the bound on the kept heads' KV; 0 keeps none (every head is prefilled).
        prompt_bytes: the bound on the kept whole prompts' KV; 0 keeps none.
    """

    def __init__(self, max_bytes: int = DEFAULT_HEAD_BYTES, prompt_bytes: int = DEFAULT_PROMPT_BYTES) -> None:
        for name, value in (("max_bytes", max_bytes), ("prompt_bytes", prompt_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.max_bytes, self.prompt_bytes = max_bytes, prompt_bytes
        self._entries: PrefixLRU[PrefixCache] = PrefixLRU(max_bytes)
        self._prompts: PrefixLRU[PrefixCache] = PrefixLRU(prompt_bytes)
        self._lock = threading.Lock()
        self.reused_tokens = 0  # head tokens read from kept entries, over this cache's life
        self.prefilled_tokens = 0  # head tokens computed

    @property
    def nbytes(self) -> int:
        """The bytes of KV held (heads and whole prompts)."""
        return self._entries.nbytes + self._prompts.nbytes

    def __len__(self) -> int:
        return len(self._entries) + len(self._prompts)

    def prompt_stats(self) -> dict[str, int]:
        """The whole prompts kept: how many, their bytes and the bound."""
        return {"kept_prompts": len(self._prompts), "kept_prompt_bytes": self._prompts.nbytes,
                "kept_prompt_max_bytes": self.prompt_bytes}

    def _longest(self, ids: tuple[int, ...], prompts: bool = False) -> tuple[PrefixCache | None, int]:
        """The kept head (or, with ``prompts``, head or whole prompt) sharing the most leading tokens with ``ids``,
        and how many it shares; on a tie the head, then the least recently used. The one found is marked used.
        """
        with self._lock:
            best, shared = self._entries.longest(ids)
            kept = self._entries
            if prompts:
                key, n = self._prompts.longest(ids)
                if n > shared:
                    best, shared, kept = key, n, self._prompts
            if best is None:
                return None, 0
            return kept.get(best), shared

    def covered(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the kept head or prompt sharing the most of them holds (0: none)."""
        return self._longest(tuple(int(t) for t in ids), prompts=True)[1] if len(ids) else 0

    def keep_prompt(self, ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a copy of the first ``len(ids)`` rows of ``layers`` (per layer ``[1, H, >= len(ids), D]``) as the
        exact KV of the prompt ``ids``. The caller vouches for exactness: rows a full prefill computed, or kept rows
        and one pass over the tokens after them. A prompt a kept one already holds, or larger than
        ``prompt_bytes``, is not kept.
        """
        key = tuple(int(t) for t in ids)
        if not key:
            return
        rows = _cropped(PrefixCache(torch.tensor(key, dtype=torch.long, device=layers[0][0].device), list(layers)),
                        len(key))
        size = _nbytes(rows)
        if size > self.prompt_bytes or len(key) <= self.covered(key):
            return
        kept = PrefixCache(rows.ids, [(k.clone(), v.clone()) for k, v in rows.kv])
        with self._lock:
            self._prompts.put(key, kept, size)

    def clear_prompts(self) -> None:
        """Forget every kept whole prompt (heads stay)."""
        with self._lock:
            self._prompts.clear()

    def _keep(self, ids: tuple[int, ...], prefix: PrefixCache) -> None:
        size = _nbytes(prefix)
        if size > self.max_bytes:
            return
        with self._lock:
            if self._entries.get(ids) is None:
                self._entries.put(ids, prefix, size)

    def split(self, lm: LoadedModel, head_ids: Sequence[int], prompts: bool = False) -> tuple[PrefixCache, list[int]]:
        """``head_ids`` as a kept prefix and the tokens after it, which the caller recomputes with the rest of its
        prompt (no model call of their own). A head that shares less than half its tokens with every kept one (a
        new template) is prefilled and kept (`prefix_for`): each template pays for its head once. ``prompts``: kept
        whole prompts count too.
        """
        ids = tuple(int(t) for t in head_ids)
        if not ids:
            raise ValueError("a prompt head needs at least one token")
        found, shared = self._longest(ids, prompts)
        if found is None or 2 * shared < len(ids):
            return self.prefix_for(lm, ids), []
        self.reused_tokens += shared
        return (found if found.length == shared else _cropped(found, shared)), list(ids[shared:])

    def leading(self, lm: LoadedModel, ids: Sequence[int], prompts: bool = False) -> tuple[PrefixCache, list[int]]:
        """The kept rows sharing the most leading tokens with ``ids`` (its first token alone, prefilled, when no
        kept head shares one) and the tokens after them, which the caller recomputes with the rest of its prompt
        in its own pass. Nothing is kept: for a prompt in which no head was told apart. ``prompts``: kept whole
        prompts count too.
        """
        ids = tuple(int(t) for t in ids)
        if not ids:
            raise ValueError("a prompt head needs at least one token")
        found, shared = self._longest(ids, prompts)
        if found is None:
            return self.prefix_for(lm, ids[:1], keep=False), list(ids[1:])
        self.reused_tokens += shared
        return (found if found.length == shared else _cropped(found, shared)), list(ids[shared:])

    def prefix_for(self, lm: LoadedModel, head_ids: Sequence[int], keep: bool = True) -> PrefixCache:
        """The KV of ``head_ids`` (at positions 0, 1, …): kept rows where a kept head shares its leading
        tokens, the rest prefilled after them. ``keep``: keep the result for later heads.
        """
        ids = tuple(int(t) for t in head_ids)
        if not ids:
            raise ValueError("a prompt head needs at least one token")
        found, shared = self._longest(ids)
        if found is not None and shared == len(ids):
            self.reused_tokens += shared
            return found if found.length == shared else _cropped(found, shared)
        if found is not None:
            shared = min(shared, len(ids) - 1)  # at least one token is prefilled
        start = _cropped(found, shared) if found is not None and shared else None
        prefix = prefix_cache(lm, ids) if start is None else _extend(lm, start, ids)
        self.reused_tokens += shared if found is not None else 0
        self.prefilled_tokens += len(ids) - (shared if found is not None else 0)
        if keep and self.max_bytes:
            self._keep(ids, prefix)
        return prefix


def _cropped(prefix: PrefixCache, n: int) -> PrefixCache:
    """The first ``n`` rows of ``prefix`` (views, not copies)."""
    return PrefixCache(prefix.ids[:n], [(k[:, :, :n], v[:, :, :n]) for k, v in prefix.kv])


def _extend(lm: LoadedModel, start: PrefixCache, ids: tuple[int, ...]) -> PrefixCache:
    """The KV of ``ids``: ``start``'s rows (the first ``start.length`` of them), the rest prefilled after them."""
    n = start.length
    device = lm.device
    new = torch.tensor(ids[n:], dtype=torch.long, device=device)[None]
    positions = torch.arange(n, len(ids), device=device)[None]
    past = hf_compat.dynamic_cache(lm.model, list(start.kv))
    with torch.no_grad():
        base = hf_compat.base_model(lm.model)
        out = base(input_ids=new, position_ids=positions, **hf_compat.with_cache(base, past), use_cache=True)
    kv = [(k.clone(), v.clone()) for k, v in hf_compat.cache_layers(hf_compat.returned_cache(out))]
    return PrefixCache(torch.tensor(ids, dtype=torch.long, device=device), kv)
