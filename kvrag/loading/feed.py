"""Layer-wise delivery of chunk caches to the fusion loop (CacheBlend §5's loading pipeline).

Fusion needs the stored K/V of layer ``i`` only when it reaches layer ``i``. A `ChunkFeed` hands it
over one layer at a time for the whole chunk region — every chunk's pre-RoPE keys and values side by
side, ``[kv_heads, n, head_dim]`` with zeros for chunks that have no cache — on the model's device,
and prepares the next layers while the current one is recomputed:

- `TensorFeed`: caches already in memory (``[L, H, n, D]`` per chunk), on the host (pinned or not)
  or on the device. On CUDA, host caches are copied on a side stream of the highest priority
  ``depth`` layers ahead; on the CPU a worker thread puts the chunks side by side ``depth`` layers ahead.
- `StoreFeed`: caches in a `KVStore`. A worker thread reads and checks ``depth`` layers ahead into
  a staging buffer (pinned on CUDA); file reads, checksums and the codecs' decoders release the GIL
  for their bulk work. Codecs that describe their blobs as planes (``raw``, ``int8``:
  `Codec.planes`) are read still encoded and decoded for the whole region at once
  (`kvrag.loading.staging`). On the CPU every chunk's rows are scattered side by side by one positioned
  read per chunk. On CUDA each chunk's blob is read whole into its own slot — for files, all chunks
  of a layer in a few batched calls that hold no GIL (`kvrag.loading.extents`), so loading does not slow the
  thread that launches fusion's kernels — then a side stream copies the (smaller) encoded bytes to
  the GPU, which puts the planes side by side and decodes them. ``cachegen`` layers are read whole
  and, on CUDA with Triton, decoded on the GPU for the whole region at once
  (`CacheGenCodec.decode_region`: one launch of the Triton rANS decoder, two batched matmuls);
  otherwise they decode on the host, chunk by chunk, into a buffer that the GPU then puts side by side.

``wait_s`` accumulates the time the fusion loop spent blocked on a layer that was not ready yet:
the part of loading that recompute did not hide.

Contract of this module: the public entry point, re-exporting the feeds from where they live —
`kvrag.loading.chunk_feed` (the interface), `kvrag.loading.tensor_feed`, `kvrag.loading.store_feed`
(with `kvrag.loading.device_region` and `kvrag.loading.staging`) and `kvrag.loading.prefetch` (the
worker thread and CUDA side-stream helpers). Settings such as ``PACKED_STAGING_DEVICES`` belong to
the module that reads them (`kvrag.loading.store_feed`).
"""

from kvrag.loading.chunk_feed import DEFAULT_DEPTH, ChunkFeed
from kvrag.loading.store_feed import StoreFeed
from kvrag.loading.tensor_feed import TensorFeed

__all__ = ["DEFAULT_DEPTH", "ChunkFeed", "StoreFeed", "TensorFeed"]
