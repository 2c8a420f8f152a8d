"""`StoreFeed`: chunk caches read from a `KVStore`, checked and decoded ahead of use, layer by layer.

Contract: a worker thread reads and checks ``depth`` layers ahead into a staging buffer (pinned on CUDA), where
a core is spare for it (else each layer is read when fusion asks for it: ``prefetch``); file reads, checksums
and the codecs' decoders release the GIL for their bulk work. What ``layer(i)`` returns is what decoding each
chunk's layer ``i`` alone gives, side by side, with zeros for chunks without a cache and the recovered cache
(``recover(j)``) for chunks whose file is missing or damaged. Three paths, chosen once per feed:

- Planes (``raw``, ``int8``: `Codec.planes`): layers read still encoded and decoded for the whole
  region at once (`kvrag.loading.staging`). Where ``PACKED_STAGING_DEVICES`` holds the device type
  (CUDA), each chunk's blob is read whole into its own slot — for files, all chunks of a layer in a few
  batched calls that hold no GIL (`kvrag.loading.extents`) — then a side stream copies the encoded
  bytes to the GPU, which puts the planes side by side and decodes them; elsewhere every chunk's rows
  are scattered side by side by one positioned read per chunk.
- Region (``cachegen`` on CUDA with Triton, or when asked): blobs read whole and decoded on the device
  for several layers of the whole region at once (`CacheGenCodec.decode_region`: one launch of the
  Triton rANS decoder, two batched matmuls).
- Host: chunk by chunk, on the CPU into each chunk's columns of the layer (via a chunk-sized buffer where they
  are not contiguous); for CUDA into a buffer of the chunks one after another, put side by side on the GPU.
  Always where a chunk's windowed layers keep only their last rows (`ChunkHeader.cut`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvrag.codec import cachegen_region
from kvrag.errors import CorruptChunkError
from kvrag.loading.chunk_feed import DEFAULT_DEPTH, ChunkFeed
from kvrag.loading.device_region import StagingBuffer, layers_per_launch, region_codec
from kvrag.loading.prefetch import DeviceCopier, Prefetcher, consume, copy_stream, is_cuda, on_stream, spare_core
from kvrag.loading.staging import ExtentReads, LayerKV, PlaneLayout
from kvrag.model.prefix import KV, kv_rows
from kvrag.storage.kvstore import log_recovery

log = logging.getLogger(__name__)

# where plane-coded layers are read whole per chunk and put side by side after the upload (`PlaneLayout`)
PACKED_STAGING_DEVICES = {"cuda"}
MAX_WORKERS = 16  # a CUDA feed's decoding threads, one a core at most (16 beat 8: benchmarks/gpu-h200-floor)


class StoreFeed(ChunkFeed):
    """Chunk caches read from a `KVStore` layer by layer, decoded ahead of use on a worker thread.

    ``recover(j)`` is called when chunk ``j``'s file is missing or a layer fails its checksum or does
    not decode; it returns that chunk's whole cache (recomputed from text), used from then on. Layers
    already delivered came from checked bytes, so they stay valid.

    ``device_decode`` chooses where ``cachegen`` caches decode: True, on ``device`` for the whole
    region at once (the Triton decoder; on the CPU only in Triton's interpreter, for tests); False, on
    the host chunk by chunk; None (default), on the device when it is CUDA and the decoder passes its
    check there (`kvrag.kernels.rans_decode.works`). ``region_layers`` layers are decoded per launch
    there (default: on CUDA, enough for ~4 blobs per multiprocessor, as each blob's 32 lanes are one
    program; 1 elsewhere).

    ``levels`` (one per chunk, None for the index's own) reads each chunk's cache at another stored level of
    its codec (`kvrag.storage.kvstore.level_key`), as a streaming plan chose (`kvrag.query.plan`).

    ``rows_prefix``: a chunk may cover fewer tokens than its stored cache holds and take its first rows (causal
    attention makes them that prefix's own cache), or, from ``row_starts`` (one per chunk), the rows from another
    (a first token the prompt joins to the text before it); each layer is decoded whole, then sliced. ``prefetch``: read
    ahead on the worker thread (True) or each layer when fusion asks for it (False); None: where a core is spare
    for the thread (`kvrag.loading.prefetch.spare_core`; benchmarks/experiments/loader_thread.py).
    """

    def __init__(self, kvstore: Any, keys: Sequence[str | None], lengths: Sequence[int], n_layers: int,
                 device: torch.device | str, dtype: torch.dtype, recover: Callable[[int], KV] | None = None,
                 depth: int = DEFAULT_DEPTH, workers: int | None = None, device_decode: bool | None = None,
                 region_layers: int | None = None, levels: Sequence[int | None] | None = None,
                 rows_prefix: bool = False, prefetch: bool | None = None,
                 row_starts: Sequence[int] | None = None) -> None:
        super().__init__(lengths, [k is not None for k in keys], n_layers, device, dtype)
        if workers is None:  # decoding threads; a layer's chunks decode in parallel
            workers = min(MAX_WORKERS, os.cpu_count() or 1) if is_cuda(self.device) else 1
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvrag-decode") if workers > 1 else None
        self.kvstore, self.keys, self._recover, self._rows_prefix = kvstore, list(keys), recover, rows_prefix
        self.levels = list(levels) if levels is not None else [None] * len(self.keys)
        self._row_starts = list(row_starts) if row_starts is not None else [0] * len(self.keys)
        self._readers: list[Any] = [None] * len(self.keys)
        self._recovered: dict[int, KV] = {}
        self._lock = threading.Lock()
        self.decode_s = 0.0
        for j, key in enumerate(self.keys):
            if key is not None:
                self._open(j, key)
        self._shape = self._probe_shape()
        self._copier: DeviceCopier | None = None
        self._cut = any(r is not None and (r.header.cut or r.rows is not None) for r in self._readers)  # (host)
        self._planar = self._planar_layout()
        self._extents = ExtentReads.of(self._readers, self._planar) if self._planar is not None else None
        self._workers = workers
        self._region_codec = (region_codec(self._readers, self.device, device_decode)
                              if self._planar is None and not self._cut else None)
        if region_layers is not None and region_layers < 1:
            raise ValueError(f"region_layers must be >= 1, got {region_layers}")
        self._group = region_layers
        self._staging = StagingBuffer(pinned=is_cuda(self.device))  # the region path's reused host buffer
        self._ahead: dict[int, tuple[LayerKV, Any]] = {}  # layers decoded with an earlier one of their group
        self._stream = copy_stream(self.device) if self._region_codec is not None and is_cuda(self.device) else None
        if is_cuda(self.device) and self._shape is not None and self._region_codec is None:
            h, d = self._shape
            size, kind = (self._planar.nbytes, torch.uint8) if self._planar else (2 * h * self.total * d, dtype)
            self._copier = DeviceCopier(self.device, (size,), kind, depth + 1)
            if self._planar is not None and self._extents is None:  # batched reads take addresses, not pieces
                self._planar.bind([buf.numpy() for buf in self._copier.host])
        threaded = spare_core(self.device) if prefetch is None else prefetch
        self._prefetch = Prefetcher(self._produce, n_layers, depth, threaded) if self._shape is not None else None

    def recovered(self, j: int) -> bool:
        """Whether chunk ``j`` was recomputed from its text (its stored cache missing or damaged)."""
        return j in self._recovered

    def _open(self, j: int, key: str) -> None:
        try:
            level = self.levels[j]
            reader = self.kvstore.reader(key) if level is None else self.kvstore.reader(key, level)
            stored, n, start = reader.header.shape[2], self.lengths[j], self._row_starts[j]
            part = self._rows_prefix and stored >= start + n and (stored > n or start > 0)
            if part and reader.header.cut and self._recover is not None:
                reader.close()  # a windowed layer keeps the cache's last rows, not the prefix's: compute it
                self._recovered[j] = kv_rows(self._recover(j), start, n)
                return
            if part and reader.header.n_layers >= self.n_layers:
                reader.rows = (start, n)  # some of its rows only: each layer decoded whole, then sliced (host path)
                self._readers[j] = reader
                return
            if stored != n or reader.header.n_layers < self.n_layers:
                reader.close()
                raise CorruptChunkError(key, f"holds {reader.header.shape[2]} tokens, expected {self.lengths[j]}")
            self._readers[j] = reader
        except CorruptChunkError as exc:
            self._recover_chunk(j, exc)

    def _recover_chunk(self, j: int, exc: CorruptChunkError) -> None:
        if self._recover is None:
            raise exc
        log_recovery(log, exc)
        reader, self._readers[j] = self._readers[j], None
        if reader is not None:
            reader.close()
        self._recovered[j] = kv_rows(self._recover(j), self._row_starts[j], self.lengths[j])

    def _probe_shape(self) -> tuple[int, int] | None:
        shapes = [r.header.shape for r in self._readers if r is not None]
        shapes += [kv[0].shape for kv in self._recovered.values()]
        return (int(shapes[0][1]), int(shapes[0][3])) if shapes else None  # (heads, head_dim) of [L, H, S, D]

    def _planar_layout(self) -> PlaneLayout | None:
        """The side-by-side plane layout when every open chunk's codec has one, the same one."""
        if self._shape is None:
            return None
        shape = self._shape
        layouts = {(r.codec.name, r.header.dtype, str(r.codec.planes(*shape, r.header.dtype)))
                   for r in self._readers if r is not None}
        first = next((r for r in self._readers if r is not None), None)
        planes = first.codec.planes(*shape, first.header.dtype) if first is not None and len(layouts) == 1 else None
        if first is None or planes is None or self._cut:
            return None
        packed = self.device.type in PACKED_STAGING_DEVICES
        return PlaneLayout(first.codec, planes, first.header.dtype, self.lengths, self.offsets, packed)

    def _read(self, j: int, read: Callable[[Any], None]) -> bool:
        """``read(reader)`` for chunk ``j`` if it has an open file; False when it has none or the read
        fails its checks, in which case the chunk is recovered (its cache then in ``_recovered``).
        """
        reader = self._readers[j]
        if reader is None:
            return False
        try:
            read(reader)
            return True
        except CorruptChunkError as exc:
            with self._lock:
                self._recover_chunk(j, exc)
            return False

    def _each_chunk(self, fill: Callable[[int], object]) -> None:
        """``fill(j)`` for every chunk, on the decoding threads when there are several."""
        todo = range(len(self.keys))
        for _ in map(fill, todo) if self._pool is None else self._pool.map(fill, todo):
            pass

    def _region(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Chunk ``j``'s part ``[2, H, n_j, D]`` of a layer's staging buffer on the host-decoding path for CUDA
        (codecs without planes, or chunks stored with different layouts), which holds the chunks one
        after another, each decoded as keys then values (a ``raw`` layer is read straight into it).
        """
        assert self._shape is not None
        h, d = self._shape
        per_token = 2 * h * d
        return flat[per_token * self.offsets[j] : per_token * (self.offsets[j] + self.lengths[j])].view(
            2, h, self.lengths[j], d)

    def _produce(self, i: int) -> tuple[Any, Any]:
        if self._planar is not None:
            return self._produce_planar(i)
        if self._region_codec is not None:
            return self._produce_region(i)
        assert self._shape is not None
        t0 = time.perf_counter()
        h, d = self._shape
        # on CUDA the chunks are staged one after another and put side by side on the GPU; on the CPU each
        # chunk is decoded into its columns of the layer (`ChunkReader.decode_layer_into`), never held twice
        staged = (self._copier.buffer(i) if self._copier is not None
                  else torch.empty((2, h, self.total, d), dtype=self.dtype))

        def fill(j: int) -> None:
            region = self._region(staged, j) if self._copier is not None else staged[:, :, self._columns(j)]
            if not self.available[j]:
                region.zero_()
            elif not self._read(j, lambda reader: reader.decode_layer_into(i, region)):
                kv = self._recovered[j]
                region[0].copy_(kv[0][i])
                region[1].copy_(kv[1][i])

        self._each_chunk(fill)
        self.decode_s += time.perf_counter() - t0
        return self._copier.upload(i, staged) if self._copier is not None else (staged, None)

    def _columns(self, j: int) -> slice:
        """Chunk ``j``'s token columns in the region."""
        return slice(self.offsets[j], self.offsets[j] + self.lengths[j])

    def _side_by_side(self, flat: torch.Tensor) -> torch.Tensor:
        """``[2, H, total, D]``: the staged chunks' keys and values side by side."""
        regions = [self._region(flat, j) for j in range(len(self.keys))]
        return regions[0] if len(regions) == 1 else torch.cat(regions, dim=2)

    def _produce_planar(self, i: int) -> tuple[LayerKV, Any]:
        """Layer ``i`` read still encoded into the plane layout, then decoded for the whole region
        (on the GPU's side stream when the feed targets CUDA).
        """
        planar = self._planar
        assert planar is not None
        t0 = time.perf_counter()
        if self._copier is not None:
            slot = i % len(self._copier.host)
            host = self._copier.buffer(i)
        else:
            slot, host = 0, torch.empty(planar.nbytes, dtype=torch.uint8)

        if self._extents is not None:
            self._read_extents(i, host)
        else:
            if self._copier is None:
                planar.bind([host.numpy()])
            self._each_chunk(lambda j: self._read(j, lambda reader: reader.read_layer_into(i, planar.pieces[slot][j])))

        def decode(staged: torch.Tensor) -> LayerKV:
            keys, values = planar.decode(staged, self.dtype)
            self._fill_unread(keys, values, i)
            return keys, values

        if self._copier is None:
            out: tuple[LayerKV, Any] = (decode(host), None)
        else:
            stream = self._copier.stream
            out = on_stream(stream, lambda: decode(host.to(self.device, non_blocking=True)))
            self._copier.events[slot] = out[1]
        self.decode_s += time.perf_counter() - t0
        return out

    def _produce_region(self, i: int) -> tuple[LayerKV, Any]:
        """Layer ``i``, decoded on the device with the next layers of its group (`_region_group`): every
        chunk's blobs of those layers read whole, then one launch of the Triton rANS decoder and two
        batched matmuls for the region (on the side stream on CUDA). A blob that does not decode has
        its chunk recovered, and the group is decoded without it.
        """
        if i not in self._ahead:
            t0 = time.perf_counter()
            layers = list(range(i, min(i + self._region_group(), self.n_layers)))
            kv, event = self._decode_group(layers)
            for g, layer in enumerate(layers):
                self._ahead[layer] = ((kv[g, 0], kv[g, 1]), event)
            self.decode_s += time.perf_counter() - t0
        return self._ahead.pop(i)

    def _region_group(self) -> int:
        """Layers decoded per launch: on CUDA `layers_per_launch` (fixed on first use); 1 elsewhere unless set."""
        if self._group is None:
            self._group = 1
            if is_cuda(self.device) and self._shape is not None and self._region_codec is not None:
                chunks = max(1, sum(r is not None for r in self._readers))
                self._group = layers_per_launch(self.device, self._shape, self._region_codec, chunks, self.total)
        return self._group

    def _decode_group(self, layers: list[int]) -> tuple[torch.Tensor, Any]:
        """``[len(layers), 2, H, total, D]`` of the region on the device, and the event that marks it ready.

        Each open chunk's blobs of those layers are read and checked straight into their places in one
        reused staging buffer (pinned on CUDA), in which the decoder finds them.
        """
        assert self._shape is not None and self._region_codec is not None
        codec, (h, d) = self._region_codec, self._shape
        column = {j: c for c, j in enumerate(j for j, reader in enumerate(self._readers) if reader is not None)}
        sizes = np.array([[self._readers[j].header.layers[layer][1] for j in column] for layer in layers],
                         np.int64).reshape(len(layers), len(column))
        at, nbytes = cachegen_region.aligned(sizes.ravel())
        at = at.reshape(sizes.shape)
        staged = self._staging.get(nbytes)
        host = staged.numpy()
        blobs: dict[int, int] = {}  # chunk -> its column in at / sizes, once all its blobs are read and checked

        def fill(j: int, reader: Any) -> None:
            for g, layer in enumerate(layers):
                start = int(at[g, column[j]])
                reader.read_layer_into(layer, [host[start : start + int(sizes[g, column[j]])].data])
            blobs[j] = column[j]

        self._each_chunk(lambda j: j in column and self._read(j, lambda reader: fill(j, reader)))

        def decode(chunks: list[int]) -> torch.Tensor:
            if chunks:
                cols = [blobs[j] for j in chunks]
                batch = cachegen_region.batch_from(codec, staged, at[:, cols].ravel(), sizes[:, cols].ravel(),
                                                   layers, [self.lengths[j] for j in chunks],
                                                   [self.offsets[j] for j in chunks], self.total)
                codes = cachegen_region.kernel_codes(codec, batch, self.device)
                stored = self._readers[chunks[0]].header.dtype  # one dtype for all (`region_codec`)
                kv = cachegen_region.transform(codec, codes, layers, stored).to(self.dtype)
            else:
                kv = torch.empty((len(layers), 2, h, self.total, d), dtype=self.dtype, device=self.device)
            for g, layer in enumerate(layers):
                self._fill_unread(kv[g, 0], kv[g, 1], layer)
            return kv

        while True:
            chunks = sorted(blobs)
            try:
                if self._stream is None:
                    return decode(chunks), None
                return on_stream(self._stream, functools.partial(decode, chunks))
            except cachegen_region.RegionDecodeError as exc:
                j = chunks[exc.blob % len(chunks)]
                del blobs[j]
                with self._lock:
                    self._recover_chunk(j, CorruptChunkError(self.keys[j] or "", f"layers {layers[0]}–{layers[-1]}: "
                                                             f"{exc}"))

    def _fill_unread(self, keys: torch.Tensor, values: torch.Tensor, i: int) -> None:
        """Layer ``i``'s columns of the chunks not read from a file: zeros for a chunk without cache,
        the recovered cache for a recovered one.
        """
        for j, (off, n) in enumerate(zip(self.offsets, self.lengths)):
            if not self.available[j]:
                keys[:, off : off + n].zero_()
                values[:, off : off + n].zero_()
            elif j in self._recovered:
                kv = self._recovered[j]
                keys[:, off : off + n].copy_(kv[0][i], non_blocking=True)
                values[:, off : off + n].copy_(kv[1][i], non_blocking=True)

    def _read_extents(self, i: int, host: torch.Tensor) -> None:
        """Layer ``i`` of every chunk read whole into its slot of ``host`` and checked, in batches that
        hold no GIL (`kvrag.loading.extents`); chunks that fail are recovered.
        """
        table = self._extents
        assert table is not None
        failed = table.read_layer(i, host.data_ptr(), self._workers, self._pool)
        for j, why in failed:
            with self._lock:
                self._recover_chunk(j, CorruptChunkError(self.keys[j] or "", f"layer {i} {why}"))

    def _layer(self, i: int) -> LayerKV:
        if self._prefetch is None:
            raise RuntimeError("no chunk in this feed has a cache")
        if self._planar is not None or self._region_codec is not None:
            (k, v), event = self._prefetch.get(i)
            consume(self.device, event, k, v)
            return k, v
        staged, event = self._prefetch.get(i)
        if event is not None:  # copied to the GPU as staged: put the chunks side by side there
            consume(self.device, event, staged)
            staged = self._side_by_side(staged)
        return staged[0], staged[1]

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
        self._staging.release()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for reader in self._readers:
            if reader is not None:
                reader.close()
        self._readers = [None] * len(self.keys)

