"""Layer-wise delivery of chunk caches to the fusion loop (CacheBlend §5's loading pipeline).

Contract: a `ChunkFeed` hands fusion one layer at a time for the whole chunk region — every chunk's pre-RoPE
keys and values side by side, ``[kv_heads, n, head_dim]``, zeros for chunks without a cache — on the model's
device, preparing the next layers while the current one is recomputed; ``wait_s`` is the time fusion waited
for a layer. `TensorFeed` serves caches already in memory, `StoreFeed` caches in a `KVStore`, `TieredFeed` those
the store's decoded tier holds from memory and the rest through a `StoreFeed`. This module re-exports the feeds
from where they live: `kvrag.loading.chunk_feed` (the interface), `kvrag.loading.tensor_feed`,
`kvrag.loading.tiered_feed`, `kvrag.loading.store_feed` (with `kvrag.loading.device_region` and
`kvrag.loading.staging`) and `kvrag.loading.prefetch` (the worker thread and CUDA side streams).
docs/loading.md describes the paths a layer takes on the CPU and on CUDA.
"""

from kvrag.loading.chunk_feed import DEFAULT_DEPTH, ChunkFeed
from kvrag.loading.store_feed import StoreFeed
from kvrag.loading.tensor_feed import TensorFeed
from kvrag.loading.tiered_feed import TieredFeed, open_tiered

__all__ = ["DEFAULT_DEPTH", "ChunkFeed", "StoreFeed", "TensorFeed", "TieredFeed", "open_tiered"]
