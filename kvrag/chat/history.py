"""A conversation's kept KV (`HistoryKV`): extended by prefilling new messages, cut by dropping old turns.

Contract:

- `HistoryKV` holds the model's own K/V rows for a conversation's history, per layer stacked as
  ``[L, kv_heads, n, head_dim]`` (keys rotated at positions ``0..n-1``, exactly as a prefill left them),
  with the token ids and the messages they came from (``spans``: message index in the whole
  conversation, token count). Reusing it is exact: `extend` prefills only the new tokens over it, which
  is what a prefill of the whole sequence computes. Under a serve worker's slicer (`kvrag.fusion.slicing`) the new
  tokens are prefilled in pieces of its budget, handing the worker back before each (rows equal to float rounding).
- `truncated` drops whole messages after the system message without recomputing anything
  (position-decoupled truncation): the kept rows move to their new positions and their keys are rotated
  there (RoPE undone at the old position, applied at the new one), as with a chunk's stored cache. The
  kept rows still carry what they saw of the dropped messages; that is the approximation truncation
  makes (a prefill of the kept messages alone differs).
- `plan_drop` is the truncation policy: keep the system message, drop the oldest messages (a user
  message with the assistant's reply to it) until the turn fits the token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag.errors import InputError
from kvrag.fusion import slicing
from kvrag.model import LoadedModel, hf_compat
from kvrag.model.prefix import PrefixCache
from kvrag.model.rope import layer_ropes, rotate_layers


@dataclass
class HistoryKV:
    """K/V rows of a conversation's history (see the module contract)."""

    ids: list[int]
    spans: list[tuple[int, int]]  # (message index in the whole conversation, its token count), in order
    keys: torch.Tensor  # [L, H, n, D]
    values: torch.Tensor  # [L, H, n, D]

    @property
    def length(self) -> int:
        """Tokens held."""
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V rows."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def dropped(self) -> int:
        """Messages after the system message that truncation removed."""
        kept = [m for m, _ in self.spans]
        return (kept[1] - 1) if len(kept) > 1 else 0

    def to(self, device: torch.device | str) -> HistoryKV:
        """The same history with its rows on ``device``."""
        return HistoryKV(self.ids, list(self.spans), self.keys.to(device), self.values.to(device))

    def prefix(self, extra_ids: Sequence[int] = ()) -> PrefixCache:
        """The history as a fusion prefix (`PrefixCache`, views of these rows)."""
        kv = [(self.keys[i][None], self.values[i][None]) for i in range(self.keys.shape[0])]
        return PrefixCache(torch.tensor([*self.ids, *extra_ids], dtype=torch.long), kv)

    def head(self, n: int) -> HistoryKV:
        """The first ``n`` rows (whole messages) as a history of their own."""
        spans, total = [], 0
        for message, count in self.spans:
            if total + count > n:
                break
            spans.append((message, count))
            total += count
        if total != n:
            raise ValueError(f"{n} tokens is not a message boundary")
        return HistoryKV(self.ids[:n], spans, self.keys[:, :, :n], self.values[:, :, :n])


def extend(lm: LoadedModel, history: HistoryKV | None, pieces: Sequence[tuple[int, list[int]]]) -> HistoryKV:
    """``history`` with the messages ``pieces`` (``(message index, token ids)``) prefilled after it."""
    new_ids = [t for _, ids in pieces for t in ids]
    if history is not None and not new_ids:
        return history
    start = 0 if history is None else history.length
    device = lm.device
    ids = torch.tensor(new_ids, dtype=torch.long, device=device)[None]
    positions = torch.arange(start, start + len(new_ids), device=device)[None]
    past = hf_compat.full_cache(lm.model)
    if history is not None:
        past = hf_compat.dynamic_cache(lm.model, [(history.keys[i][None].to(device),
                                                   history.values[i][None].to(device))
                                                  for i in range(history.keys.shape[0])])
    base = hf_compat.base_model(lm.model)
    piece = slicing.budget_tokens() or len(new_ids)  # a serve worker's slices (`kvrag.fusion.slicing`), else whole
    with torch.no_grad():
        for at in range(0, len(new_ids), piece):
            slicing.boundary()
            out = base(input_ids=ids[:, at: at + piece], position_ids=positions[:, at: at + piece],
                       **hf_compat.with_cache(base, past), use_cache=True)
            past = hf_compat.returned_cache(out)
    layers = hf_compat.cache_layers(past)
    keys = torch.stack([k[0] for k, _ in layers])
    values = torch.stack([v[0] for _, v in layers])
    spans = [] if history is None else list(history.spans)
    old_ids = [] if history is None else list(history.ids)
    return HistoryKV(old_ids + new_ids, spans + [(m, len(p)) for m, p in pieces], keys, values)


def plan_drop(lengths: Sequence[int], need: int, budget: int) -> int:
    """How many messages after the system message to drop so that the history (message token counts
    ``lengths``, system first) plus ``need`` tokens fit ``budget``; whole user/assistant pairs go first.

    Raises:
        InputError: the turn does not fit even after the system message alone.
    """
    total, drop = sum(lengths) + need, 0
    rest = list(lengths[1:])
    while total > budget and drop < len(rest):
        step = min(2, len(rest) - drop)
        total -= sum(rest[drop: drop + step])
        drop += step
    if total > budget:
        raise InputError(f"this turn needs {lengths[0] + need} tokens with the system message alone, over the "
                         f"{budget}-token context; use fewer or smaller passages (k) or fewer new tokens")
    return drop


def truncated(lm: LoadedModel, history: HistoryKV, keep_from: int) -> HistoryKV:
    """``history`` without its messages of index ``1 .. keep_from - 1`` (see the module contract)."""
    keep = [i for i, (m, _) in enumerate(history.spans) if m == 0 or m >= keep_from]
    if len(keep) == len(history.spans):
        return history
    starts, pos = [], 0
    for _, count in history.spans:
        starts.append(pos)
        pos += count
    rows = torch.cat([torch.arange(starts[i], starts[i] + history.spans[i][1]) for i in keep])
    device = history.keys.device
    rows = rows.to(device)
    new_pos = torch.arange(rows.numel(), device=device)
    keys = history.keys[:, :, rows]
    if not torch.equal(rows, new_pos):
        like = keys[:1, :1]
        old = layer_ropes(lm.model, lm.family, rows, like)  # each layer's own rotary embedding
        keys = rotate_layers(rotate_layers(keys, old, inverse=True), layer_ropes(lm.model, lm.family, new_pos, like))
    ids = [history.ids[r] for r in rows.tolist()]
    return HistoryKV(ids, [history.spans[i] for i in keep], keys.contiguous(), history.values[:, :, rows].contiguous())
