"""Recomputing one chunk's cache from its text: for a chunk whose stored cache is missing or corrupt,
or that was indexed lazily, found while answering.

The cache is computed exactly as the build computed it (after the prompt prefix, or after the chunk's
nearest neighbours in the index as it is now) and stored again, so the next answer reads it.
"""

from __future__ import annotations

from kvrag.embedder import Embedder
from kvrag.indexing.build import cache_after_neighbours, nearest_chunks
from kvrag.indexing.kvgen import KV, PrefixCache, chunk_caches, plain_cache_key
from kvrag.model import LoadedModel
from kvrag.prompt import chunk_token_ids
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.kvstore import KVStore


def recompute_chunk(lm: LoadedModel, index: ChunkIndex, kvstore: KVStore, embedder: Embedder, prefix: PrefixCache,
                    key: str, text: str, neighbour_context: int, neighbour_kv: str, batch_tokens: int,
                    lead: bool = False) -> KV:
    """Recompute and re-store chunk ``key``'s cache (``lead``: its plain cache, under `plain_cache_key` when the
    index keeps neighbour-context caches). Returns the cache, on the model's device.
    """
    ids = chunk_token_ids(lm.tokenizer, text)
    stored_as = plain_cache_key(key) if lead and neighbour_context else key
    if neighbour_context and not lead:  # after its nearest chunks in the index as it is now
        neighbours = nearest_chunks(lm, index, prefix.length, neighbour_context, key, len(ids),
                                    embedder.encode([text])[0])
        kv = cache_after_neighbours(lm, prefix, kvstore, neighbours, ids, neighbour_kv)
    else:
        _, kv = next(chunk_caches(lm, prefix, [ids], batch_tokens))
    kvstore.put(stored_as, kv[0].cpu(), kv[1].cpu())
    return kv
