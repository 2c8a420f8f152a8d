"""KVGen: prefill chunks after the fixed prompt prefix and return their pre-RoPE caches.

A chunk's KV is computed as the model sees it right after the prefix (positions ``P … P+n-1``), or
after the prefix and some context (an index built with neighbour context puts a chunk's nearest
chunks before it: `chunk_caches_after` prefills them with the chunk, `placed_prefix` places their
stored caches instead), then keys are un-rotated at those positions so the chunk can
later be placed anywhere. Chunks are batched with right padding: under a causal mask, real tokens
never attend to the padding after them, so padding changes nothing. Layout: ``[layers, kv_heads,
seq, head_dim]`` per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvrag.model import LoadedModel, hf_compat
from kvrag.model.prefix import KV, PrefixCache, prefix_cache  # noqa: F401  (re-exported)
from kvrag.model.rope import layer_ropes, rotate_layers
from kvrag.storage.keys import chunk_key, plain_cache_key  # noqa: F401  (re-exported)


def _batches(lengths: Sequence[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices grouped by similar length so that ``len(batch) * max_len <= batch_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * lengths[i] > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _forward(lm: LoadedModel, prefix: PrefixCache, chunks: list[list[int]]) -> tuple[Any, torch.Tensor]:
    """The model's forward over a batch of chunks (right-padded) after the prefix: its output and the
    chunks' positions.
    """
    n_max, p = max(map(len, chunks)), prefix.length
    ids = torch.zeros(len(chunks), n_max, dtype=torch.long, device=lm.device)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    positions = torch.arange(p, p + n_max, device=lm.device)
    cache = hf_compat.dynamic_cache(
        lm.model,
        [(k.expand(len(chunks), -1, -1, -1).clone(), v.expand(len(chunks), -1, -1, -1).clone())
         for k, v in prefix.kv]
    )
    with torch.no_grad():
        base = hf_compat.base_model(lm.model)
        out = base(input_ids=ids, position_ids=positions[None].expand(len(chunks), -1),
                   **hf_compat.with_cache(base, cache), use_cache=True)
    return out, positions


def plain_prefill(lm: LoadedModel, prefix: PrefixCache, chunks: Sequence[Sequence[int]],
                  batch_tokens: int = 4096) -> int:
    """The model's own prefill of ``chunks`` after the prefix, batched as `chunk_caches` batches them,
    with nothing kept: the baseline that an index build's cache precompute is measured against.
    Returns the tokens prefilled.
    """
    for batch in _batches([len(c) for c in chunks], batch_tokens):
        _forward(lm, prefix, [list(chunks[i]) for i in batch])
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return sum(len(c) for c in chunks)


def _prefill_batch(lm: LoadedModel, prefix: PrefixCache, chunks: list[list[int]]) -> list[KV]:
    out, positions = _forward(lm, prefix, chunks)
    p = prefix.length
    layers = hf_compat.cache_layers(hf_compat.returned_cache(out))
    keys = torch.stack([k[:, :, p:] for k, _ in layers], dim=1)  # [B, L, H, n_max, D]
    values = torch.stack([v[:, :, p:] for _, v in layers], dim=1)
    results = []
    for row, chunk in enumerate(chunks):
        n = len(chunk)
        ropes = layer_ropes(lm.model, lm.family, positions[:n], keys)  # each layer's own rotary embedding
        k_pre = rotate_layers(keys[row, :, :, :n], ropes, inverse=True)  # [L, H, n, D]
        results.append((k_pre.contiguous(), values[row, :, :, :n].contiguous()))
    return results


def chunk_caches(
    lm: LoadedModel, prefix: PrefixCache, chunks: Sequence[Sequence[int]], batch_tokens: int = 4096
) -> Iterator[tuple[int, KV]]:
    """Prefill ``chunks`` (token ids) after the prefix; yields ``(index, (keys, values))`` as batches finish.

    Keys are pre-RoPE. Order follows batching, not input order — use the yielded index.
    """
    lengths = [len(c) for c in chunks]
    if any(n == 0 for n in lengths):
        raise ValueError("chunk_caches got an empty chunk")
    for batch in _batches(lengths, batch_tokens):
        for i, kv in zip(batch, _prefill_batch(lm, prefix, [list(chunks[i]) for i in batch])):
            yield i, kv


def chunk_caches_after(
    lm: LoadedModel, prefix: PrefixCache, work: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> Iterator[tuple[int, KV]]:
    """Prefill each chunk after the prefix and its own context tokens; yields ``(index, (keys, values))``
    in input order, for ``work`` = ``[(context ids, chunk ids), ...]``.

    The cache holds the chunk's rows only (pre-RoPE keys, like `chunk_caches`): the chunk as the model
    sees it when ``context`` comes before it. Each chunk is prefilled with its context, one at a time.
    """
    for i, (context, ids) in enumerate(work):
        if not ids:
            raise ValueError("chunk_caches_after got an empty chunk")
        after = prefix_cache(lm, [*prefix.ids.tolist(), *context]) if context else prefix
        yield i, chunk_cache_after(lm, after, ids)


def placed_prefix(lm: LoadedModel, prefix: PrefixCache, context: Sequence[tuple[Sequence[int], KV]]) -> PrefixCache:
    """The prefix followed by chunks placed from their pre-RoPE caches, ``[(ids, (keys, values))]`` with
    keys and values ``[L, H, n, D]``: keys rotated to the positions the chunks take there, without
    running the model over them. A chunk prefilled after it (`chunk_cache_after`) sees its context as
    fusion's ``reuse`` would present it, for the cost of its own tokens alone.
    """
    like = prefix.kv[0][0]
    keys: list[list[torch.Tensor]] = [[k] for k, _ in prefix.kv]
    values: list[list[torch.Tensor]] = [[v] for _, v in prefix.kv]
    ids, pos = [prefix.ids], prefix.length
    for tokens, (k, v) in context:
        n = len(tokens)
        if k.shape[2] != n or v.shape[2] != n:
            raise ValueError(f"a context cache holds {k.shape[2]} tokens, its ids {n}")
        ropes = layer_ropes(lm.model, lm.family, torch.arange(pos, pos + n, device=like.device), like)
        rotated = rotate_layers(k.to(like.device, like.dtype), ropes)  # [L, H, n, D]
        for layer in range(len(keys)):
            keys[layer].append(rotated[layer][None])
            values[layer].append(v[layer][None].to(like.device, like.dtype))
        ids.append(torch.as_tensor(list(tokens), dtype=torch.long, device=prefix.ids.device))
        pos += n
    kv = [(torch.cat(k, dim=2), torch.cat(v, dim=2)) for k, v in zip(keys, values)]
    return PrefixCache(torch.cat(ids), kv)


def chunk_cache_after(lm: LoadedModel, after: PrefixCache, ids: Sequence[int]) -> KV:
    """One chunk prefilled after ``after`` (e.g. a `placed_prefix`): its rows, keys pre-RoPE."""
    if not ids:
        raise ValueError("chunk_cache_after got an empty chunk")
    return _prefill_batch(lm, after, [list(ids)])[0]
