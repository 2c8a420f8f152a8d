"""A passage's cache taken from the rows of the prompt it was first seen in, instead of prefilled alone.

Contract: `rows_in_prompt(lm, prompt_ids, layers, passages)` finds each passage's token ids as a run of
``prompt_ids`` (the tokens a prompt's pass computed, in order; the passages in prompt order, each searched for after
the last one found) and returns, for each found, its rows of ``layers``
(``[1, H, >= len(prompt_ids), D]`` per layer, that pass's cache): keys un-rotated at the positions they stood at,
so that they are stored pre-RoPE as every chunk cache is (`kvrag.model.rope`), and values, both ``[L, H, n, D]``
on the CPU. A passage is missing from the result when its run is not in the prompt or a layer holds fewer rows than
the prompt (a sliding window): the caller prefills it alone. Each found passage also gets where its run starts and
the digest of the tokens before it (`PassageRows`). `rows_of_passes` does it for passages of several
passes (a `PromptPass` each, or None), one search per pass; a passage cache runs it on its background thread, after
the answer.

Why: a passage's rows in a prompt were computed after the passages a retriever put before it, its neighbours. A
cache with neighbour context deviates less from what a new prompt needs than one computed alone (kvrag's indexes
compute theirs after their nearest chunks for that reason), and these cost nothing: the prompt's pass computed
them while answering. `kvrag.passages.cache.PassageCache` keys them by the tokens before them (`context_digest`):
where a prompt has those same tokens before the passage, the rows are exactly what its pass would compute there. It
also reads them after the same passage they followed (benchmarks/any-retriever README, "Passage caches from the
prompt's rows").
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvrag.model import LoadedModel
from kvrag.model.prefix import KV
from kvrag.model.rope import layer_ropes, rotate_layers

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer ``(keys, values)`` ``[1, H, S, D]``
PromptPass = tuple[Sequence[int], Layers]  # a prompt's tokens and the cache its pass computed


def find_run(sequence: Sequence[int], run: Sequence[int], start: int = 0) -> int | None:
    """Where ``run`` first occurs in ``sequence`` at or after ``start``, else None."""
    n = len(run)
    if n == 0:
        return None
    first = run[0]
    for i in range(start, len(sequence) - n + 1):
        if sequence[i] == first and list(sequence[i:i + n]) == list(run):
            return i
    return None


def rows_at(lm: LoadedModel, layers: Layers, start: int, n: int) -> KV:
    """Rows ``start`` to ``start + n`` of every layer: pre-RoPE keys and values ``[L, H, n, D]`` on the CPU."""
    keys = torch.stack([k[0, :, start:start + n] for k, _ in layers])
    values = torch.stack([v[0, :, start:start + n] for _, v in layers])
    positions = torch.arange(start, start + n, device=keys.device)
    keys = rotate_layers(keys, layer_ropes(lm.model, lm.family, positions, keys), inverse=True)
    return keys.cpu(), values.cpu().clone()


class PassageRows(NamedTuple):
    """A passage's rows in a prompt's pass: where its run starts, the digest of the tokens before it there
    (`context_digest`) and the rows (`rows_at`).
    """

    start: int
    context: str
    kv: KV


def context_digest(ids: Sequence[int]) -> str:
    """A digest of the token ids before a passage in its prompt: rows computed after equal digests are equal."""
    return hashlib.sha256(array("q", (int(t) for t in ids)).tobytes()).hexdigest()[:40]


def rows_in_prompt(lm: LoadedModel, prompt_ids: Sequence[int], layers: Layers,
                   passages: Sequence[Sequence[int]]) -> dict[int, PassageRows]:
    """``{index in passages: its PassageRows}`` for the passages whose runs ``prompt_ids`` holds (the contract)."""
    ids = [int(t) for t in prompt_ids]
    if not layers or any(k.shape[2] < len(ids) or v.shape[2] < len(ids) for k, v in layers):
        return {}
    found: dict[int, PassageRows] = {}
    start = 0
    for i, run in enumerate(passages):
        at = find_run(ids, run, start)
        if at is not None:
            found[i] = PassageRows(at, context_digest(ids[:at]), rows_at(lm, layers, at, len(run)))
            start = at + len(run)
    return found


def rows_of_passes(lm: LoadedModel, wanted: Sequence[tuple[PromptPass | None, Sequence[int]]]
                   ) -> list[PassageRows | None]:
    """For each ``(pass, passage ids)``: the passage's rows in that pass (`rows_in_prompt`, one search per pass), or
    None without a pass or a run.
    """
    groups: dict[int, list[int]] = {}
    for i, (source, _) in enumerate(wanted):
        if source is not None:
            groups.setdefault(id(source), []).append(i)
    out: list[PassageRows | None] = [None] * len(wanted)
    for members in groups.values():
        source = wanted[members[0]][0]
        assert source is not None
        found = rows_in_prompt(lm, source[0], source[1], [wanted[i][1] for i in members])
        for j, i in enumerate(members):
            out[i] = found.get(j)
    return out
