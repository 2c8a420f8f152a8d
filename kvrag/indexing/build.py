"""Index build: split documents, embed each new chunk, precompute its cache after the prompt prefix
(and, with neighbour context, after its nearest chunks), store it through the codec and commit the
chunk to the index — in groups, so a build killed at any point resumes on re-run recomputing only
what is missing.

Chunks already in the index are skipped; chunks whose cache file is already stored (a build killed
after writing caches but before committing the group) skip the prefill. Encoding and writing run on
a worker thread, overlapped with the next batch's prefill.

A codec that needs fitting is fitted on the first chunks prefilled and its state is saved before the
first cache coded with it is written, so a build killed before then has neither and simply fits again
on re-run (`codec_ready` asks the codec itself, not a marker file).

An index whose manifest lists ``stream_levels`` (`kvrag.indexing.manifest.check_stream_levels`) also stores
each chunk's cache at those levels of its codec (`KVStore.put_levels`, derived keys) for the streaming
loader (`kvrag.query.plan`); a chunk counts as cached only once every level is stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from kvrag.codec.base import Codec
from kvrag.config import SplitConfig
from kvrag.embedder import Embedder
from kvrag.errors import CorruptChunkError, InputError
from kvrag.indexing.documents import Loaded
from kvrag.indexing.kvgen import (
    KV,
    PrefixCache,
    chunk_cache_after,
    chunk_caches,
    chunk_caches_after,
    chunk_key,
    placed_prefix,
    plain_cache_key,
)
from kvrag.indexing.manifest import stored_stream_levels
from kvrag.indexing.split import KVSplitter
from kvrag.model import LoadedModel
from kvrag.prompt import PromptLayout, chunk_token_ids
from kvrag.storage.chunk_index import ChunkIndex, ChunkRecord
from kvrag.storage.codec_state import codec_ready, mark_fitted, save_fitted, state_kept
from kvrag.storage.kvstore import KVStore, log_recovery

log = logging.getLogger(__name__)
GROUP_CHUNKS = 256
FIT_CHUNKS = 64


@dataclass
class BuildStats:
    """What a build (or an append) did."""

    documents: int = 0
    chunks: int = 0
    new_chunks: int = 0
    prefilled_chunks: int = 0
    prefilled_tokens: int = 0
    stored_bytes: int = 0
    context_tokens: int = 0  # neighbour-context tokens put before the chunks (prefilled with them under "prefill")
    kv_s: float = 0.0
    embed_s: float = 0.0
    total_s: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.kv_s if self.kv_s else 0.0


@dataclass
class Candidate:
    """A chunk to index: its record and its token ids."""

    record: ChunkRecord
    ids: list[int]


def split_documents(
    loaded: Loaded, lm: LoadedModel, layout: PromptLayout, config: SplitConfig,
    embed: Callable[[list[str]], Any] | None,
) -> list[Candidate]:
    """Chunk every document and key each chunk by content; duplicates keep their first occurrence."""
    splitter = KVSplitter(lm.tokenizer, config, embed if config.mode != "fixed" else None)
    pieces = splitter.split_many([text for _, text, _ in loaded.docs])
    seen: set[str] = set()
    out: list[Candidate] = []
    for (doc_id, _, source), chunks in zip(loaded.docs, pieces):
        for seq, chunk in enumerate(chunks):
            ids = chunk_token_ids(lm.tokenizer, chunk.text)
            key = chunk_key(lm.fingerprint, layout.prefix_ids, ids)
            if key not in seen and ids:
                seen.add(key)
                out.append(Candidate(ChunkRecord(key, doc_id, seq, chunk.text, len(ids), source), ids))
    return out


def _fit_codec(codec: Codec, caches: list[tuple[torch.Tensor, torch.Tensor]], state_dir: Path, fingerprint: str,
               kept: str) -> None:
    log.info("fitting codec %s on %d chunk caches", codec.name, len(caches))
    codec.fit(caches, caches[0][0].shape[0])
    save_fitted(codec, state_dir, fingerprint, kept)


NEIGHBOUR_KV = ("stored", "prefill")  # how a chunk's neighbours are put before it (see `cache_after_neighbours`)


@dataclass
class Neighbour:
    """A chunk put before another when that one's cache is computed with neighbour context."""

    key: str
    ids: list[int]  # the chunk's token ids
    start: int = 0  # its first token put there (the front of the context is cut to fit the window)


def nearest_chunks(
    lm: LoadedModel, index: ChunkIndex, prefix_len: int, count: int, key: str, n_tokens: int,
    vector: np.ndarray, others: Sequence[tuple[float, str, list[int]]] = (),
) -> list[Neighbour]:
    """The chunks put before a chunk when its cache is computed with neighbour context.

    The ``count`` chunks most similar to it (cosine of the embeddings), from the index and from
    ``others`` (``(similarity, key, token ids)`` of chunks not committed yet), least similar first so
    the nearest sits right before the chunk; cut from the front to fit the model's window.
    """
    if count < 1:
        return []
    found = list(others)
    taken = {key, *(k for _, k, _ in others)}  # (a chunk among the others may be indexed already)
    found += [(score, rec.key, chunk_token_ids(lm.tokenizer, rec.text))
              for rec, score in index.search(vector, count + 1) if rec.key not in taken]
    found.sort(key=lambda f: -f[0])
    chosen = [Neighbour(k, ids) for _, k, ids in reversed(found[:count])]
    excess = sum(len(n.ids) for n in chosen) - max(0, lm.spec.max_position - prefix_len - n_tokens - 1)
    while excess > 0 and chosen:
        first = chosen[0]
        if len(first.ids) - first.start <= excess:
            excess -= len(first.ids) - first.start
            chosen.pop(0)
        else:
            first.start += excess
            excess = 0
    return chosen


def check_neighbour_kv(how: str) -> str:
    """``how`` if it names a way to put the neighbours before a chunk (`NEIGHBOUR_KV`), else ValueError."""
    if how not in NEIGHBOUR_KV:
        raise ValueError(f"neighbour_kv must be one of {NEIGHBOUR_KV}, got {how!r}")
    return how


def cache_after_neighbours(lm: LoadedModel, prefix: PrefixCache, kvstore: KVStore, neighbours: Sequence[Neighbour],
                           ids: Sequence[int], how: str = "stored") -> KV:
    """A chunk's cache computed after the prefix and its ``neighbours`` (`nearest_chunks`).

    ``how="stored"`` places the neighbours' plain caches (stored under `plain_cache_key`; recomputed when
    missing or corrupt) before the chunk and prefills the chunk alone, which costs about what its plain
    cache costs. ``"prefill"`` prefills the neighbours' tokens together with the chunk: exact for that
    context, but each chunk then costs its neighbours' tokens too (about ``count + 1`` times as much).
    """
    if check_neighbour_kv(how) == "prefill":
        context = [t for n in neighbours for t in n.ids[n.start:]]
        return next(chunk_caches_after(lm, prefix, [(context, ids)]))[1]
    placed = []
    for n in neighbours:
        try:
            keys, values = kvstore.load(plain_cache_key(n.key))
        except CorruptChunkError as exc:
            log_recovery(log, exc, "computing the plain cache of a neighbour again")
            keys, values = next(chunk_caches(lm, prefix, [n.ids]))[1]
            kvstore.put(plain_cache_key(n.key), keys.cpu(), values.cpu())
        placed.append((n.ids[n.start:], (keys[:, :, n.start:], values[:, :, n.start:])))
    return chunk_cache_after(lm, placed_prefix(lm, prefix, placed), ids)


class Builder:
    """Runs the build loop for one opened index.

    ``context_chunks`` > 0 computes each chunk's cache after that many of its nearest chunks (by
    embedding, among the index and the chunks being added) instead of after the prefix alone, put
    there as ``neighbour_kv`` says (`cache_after_neighbours`). Each chunk's plain cache is stored
    first, under `plain_cache_key`: for when it comes first in a prompt, and as what ``"stored"`` places.
    """

    def __init__(
        self, lm: LoadedModel, index: ChunkIndex, kvstore: KVStore, embedder: Embedder,
        prefix: PrefixCache, codec_state_dir: Path, batch_tokens: int = 4096, context_chunks: int = 0,
        neighbour_kv: str = "stored",
    ) -> None:
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise InputError(f"batch_tokens must be a positive int, got {batch_tokens!r}")
        self.lm, self.index, self.kvstore, self.embedder = lm, index, kvstore, embedder
        self.prefix, self.codec_state_dir, self.batch_tokens = prefix, codec_state_dir, batch_tokens
        self.context_chunks, self.neighbour_kv = context_chunks, check_neighbour_kv(neighbour_kv)
        self.stream_levels = stored_stream_levels(index.manifest, kvstore.codec)  # for the streaming loader
        self.kept = state_kept(index.manifest)  # where the fitted codec state goes

    @property
    def codec_ready(self) -> bool:
        return codec_ready(self.kvstore.codec, self.codec_state_dir)

    def run(self, candidates: Sequence[Candidate], stats: BuildStats, show_progress: bool,
            caches: bool = True) -> None:
        """Index the candidates not yet in the index and store the caches they lack.

        ``caches=False`` only embeds and indexes the new chunks: their caches are computed the first
        time a prompt uses them (`KVRag.load_chunk`), or by a later run with ``caches=True``, which
        also computes the caches of chunks already indexed without them.
        """
        new = [c for c in candidates if c.record.key not in self.index]
        todo = [c for c in candidates if c.record.key not in self.index or not self._cached(c)] if caches else new
        stats.chunks, stats.new_chunks = len(candidates), len(new)
        # one bar over the chunk tokens to embed and prefill, so that its rate and ETA follow the work
        bar = tqdm(total=sum(len(c.ids) for c in todo), unit="tok", dynamic_ncols=True,
                   desc="computing caches" if caches else "embedding", disable=not show_progress)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-writer") as writer:
            for start in range(0, len(todo), GROUP_CHUNKS):
                group = list(todo[start : start + GROUP_CHUNKS])
                t0 = time.perf_counter()
                vectors = self.embedder.encode([c.record.text for c in group])
                stats.embed_s += time.perf_counter() - t0
                if caches:
                    if self.context_chunks:  # first: the neighbours' plain caches are placed from the store
                        self._store_leads([(c.record.key, c.ids) for c in group], stats, writer)
                    self._store_caches(group, vectors, stats, writer, bar)
                else:
                    if not self.codec_ready:  # a lazy index still needs a fitted codec for its first use
                        self._store_leads([(c.record.key, c.ids) for c in group[:FIT_CHUNKS]], stats, writer,
                                          plain=not self.context_chunks)
                    bar.update(sum(len(c.ids) for c in group))
                self.index.add([c.record for c in group], vectors)  # (keys already indexed are skipped)
        bar.close()

    def _cached(self, candidate: Candidate) -> bool:
        """Whether a chunk's caches are stored (with neighbour context: its plain cache too)."""
        key = candidate.record.key
        return (self.kvstore.contains_levels(key, self.stream_levels)
                and (not self.context_chunks or self.kvstore.contains(plain_cache_key(key))))

    def _neighbours(self, group: list[Candidate], vectors: np.ndarray, i: int) -> list[Neighbour]:
        """`nearest_chunks` of the group's chunk ``i``, among the index and the rest of the group."""
        sims = vectors @ vectors[i]
        sims[i] = -np.inf  # not its own neighbour
        nearest = np.argsort(-sims)[: min(self.context_chunks, len(group) - 1)]
        others = [(float(sims[j]), group[j].record.key, group[j].ids) for j in nearest]
        return nearest_chunks(self.lm, self.index, self.prefix.length, self.context_chunks,
                              group[i].record.key, len(group[i].ids), vectors[i], others)

    def _caches(self, group: list[Candidate], vectors: np.ndarray, todo: list[int], stats: BuildStats,
                writer: ThreadPoolExecutor) -> Iterator[tuple[int, KV]]:
        """``(position in todo, cache)`` of the chunks to prefill, after the prefix or their neighbours."""
        if not self.context_chunks:
            yield from chunk_caches(self.lm, self.prefix, [group[i].ids for i in todo], self.batch_tokens)
            return
        chosen = [self._neighbours(group, vectors, i) for i in todo]
        if self.neighbour_kv == "stored":  # neighbours indexed without caches get their plain ones, batched
            self._store_leads([(n.key, n.ids) for neighbours in chosen for n in neighbours], stats, writer)
        for pos, (i, neighbours) in enumerate(zip(todo, chosen)):
            stats.context_tokens += sum(len(n.ids) - n.start for n in neighbours)
            yield pos, cache_after_neighbours(self.lm, self.prefix, self.kvstore, neighbours, group[i].ids,
                                              self.neighbour_kv)

    def _store_caches(self, group: list[Candidate], vectors: np.ndarray, stats: BuildStats,
                      writer: ThreadPoolExecutor, bar: Any) -> None:
        stored = self.kvstore.contains_levels
        positions = [i for i, c in enumerate(group) if not stored(c.record.key, self.stream_levels)]
        todo = [group[i] for i in positions]
        bar.update(sum(len(c.ids) for c in group) - sum(len(c.ids) for c in todo))
        if not todo:
            return
        t0 = time.perf_counter()
        pending: list[Future[int]] = []
        held: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]] = []
        for i, kv in self._caches(group, vectors, positions, stats, writer):
            stats.prefilled_chunks += 1
            stats.prefilled_tokens += len(todo[i].ids)
            if not self.codec_ready:
                held.append((i, kv))
                if len(held) < min(FIT_CHUNKS, len(todo)):
                    continue
                _fit_codec(self.kvstore.codec, [h[1] for h in held], self.codec_state_dir, self.lm.fingerprint,
                           self.kept)
                mark_fitted(self.codec_state_dir)
                pending += [self._submit(writer, todo[j].record.key, h, self.stream_levels) for j, h in held]
                bar.update(sum(len(todo[j].ids) for j, _ in held))
                held = []
                continue
            pending.append(self._submit(writer, todo[i].record.key, kv, self.stream_levels))
            bar.update(len(todo[i].ids))
        stats.stored_bytes += sum(f.result() for f in pending)
        stats.kv_s += time.perf_counter() - t0

    def _store_leads(self, chunks: Sequence[tuple[str, list[int]]], stats: BuildStats,
                     writer: ThreadPoolExecutor, plain: bool = False) -> None:
        """The plain caches (after the prefix alone; ``(key, token ids)`` of each chunk) not stored yet:
        with neighbour context, under `plain_cache_key`, for when a chunk comes first in a prompt and for placing
        it before its neighbours; with ``plain``, under the chunk's own key (a lazy index's fitting sample).
        A codec not fitted yet is fitted on them first.
        """
        stored_as = (lambda key: key) if plain else plain_cache_key
        leads = {key: ids for key, ids in chunks if not self.kvstore.contains(stored_as(key))}
        if not leads:
            return
        t0 = time.perf_counter()
        keys = list(leads)
        computed = list(chunk_caches(self.lm, self.prefix, list(leads.values()), self.batch_tokens))
        if not self.codec_ready:
            _fit_codec(self.kvstore.codec, [kv for _, kv in computed[:FIT_CHUNKS]], self.codec_state_dir,
                       self.lm.fingerprint, self.kept)
            mark_fitted(self.codec_state_dir)
        stats.prefilled_tokens += sum(len(leads[keys[i]]) for i, _ in computed) if plain else 0
        stats.prefilled_chunks += len(computed) if plain else 0
        pending = [self._submit(writer, stored_as(keys[i]), kv) for i, kv in computed]
        stats.stored_bytes += sum(f.result() for f in pending)
        stats.kv_s += time.perf_counter() - t0

    def _submit(self, writer: ThreadPoolExecutor, key: str, kv: tuple[torch.Tensor, torch.Tensor],
                levels: tuple[int, ...] = ()) -> Future[int]:
        """Encode and store one cache on the writer thread (and at ``levels`` too); its stored bytes."""
        keys, values = kv[0].cpu(), kv[1].cpu()

        def put() -> int:
            size = self.kvstore.put(key, keys, values)
            return size + sum(self.kvstore.put_levels(key, keys, values, levels).values()) if levels else size

        return writer.submit(put)
