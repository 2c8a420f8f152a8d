"""`TensorFeed`: chunk caches already in memory delivered layer by layer.

Contract: each chunk's cache is ``[L, H, n, D]`` keys and values (or None: zeros), on the host (pinned
or not) or on the device. On CUDA, host caches are copied on a side stream of the highest priority
``depth`` layers ahead; on the CPU a worker thread puts the chunks side by side ``depth`` layers ahead.
What ``layer(i)`` returns is exactly the chunks' layer ``i`` side by side, in the feed's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag.loading.chunk_feed import DEFAULT_DEPTH, ChunkFeed
from kvrag.loading.prefetch import Prefetcher, consume, copy_stream, is_cuda, on_stream
from kvrag.loading.staging import LayerKV
from kvrag.model.prefix import KV


class TensorFeed(ChunkFeed):
    """Chunk caches already in memory: ``[L, H, n, D]`` keys and values per chunk, or None."""

    def __init__(self, chunk_kv: Sequence[KV | None], lengths: Sequence[int], n_layers: int,
                 device: torch.device | str, dtype: torch.dtype, depth: int = DEFAULT_DEPTH) -> None:
        super().__init__(lengths, [kv is not None for kv in chunk_kv], n_layers, device, dtype)
        self.chunk_kv = list(chunk_kv)
        self._shape: tuple[int, int] | None = None
        for kv, n in zip(self.chunk_kv, self.lengths):
            if kv is not None:
                if kv[0].shape != kv[1].shape or kv[0].dim() != 4 or kv[0].shape[2] != n or kv[0].shape[0] < n_layers:
                    raise ValueError(f"chunk cache of shape {tuple(kv[0].shape)} does not fit {n} tokens "
                                     f"and {n_layers} layers")
                self._shape = (int(kv[0].shape[1]), int(kv[0].shape[3]))
        host = [kv for kv in self.chunk_kv if kv is not None and kv[0].device.type == "cpu"]
        self._async = is_cuda(self.device) and bool(host)
        self._prefetch: Prefetcher | None = None
        if self._async:
            self._stream = copy_stream(self.device)
            self._prefetch = Prefetcher(self._upload, n_layers, depth)
        elif self.device.type == "cpu" and self._shape is not None:  # the concatenation off the fusion thread
            self._prefetch = Prefetcher(lambda i: (self._gather(i, self.device), None), n_layers, depth)

    def _gather(self, i: int, device: torch.device) -> LayerKV:
        assert self._shape is not None
        h, d = self._shape
        if all(self.available) and not self._async:  # one concatenation kernel per tensor
            parts = [kv for kv in self.chunk_kv if kv is not None]
            return (torch.cat([kv[0][i] for kv in parts], dim=1).to(device, self.dtype),
                    torch.cat([kv[1][i] for kv in parts], dim=1).to(device, self.dtype))
        k = torch.zeros((h, self.total, d), dtype=self.dtype, device=device)
        v = torch.zeros_like(k)
        for kv, off, n in zip(self.chunk_kv, self.offsets, self.lengths):
            if kv is not None:
                k[:, off : off + n].copy_(kv[0][i], non_blocking=True)
                v[:, off : off + n].copy_(kv[1][i], non_blocking=True)
        return k, v

    def _upload(self, i: int) -> tuple[LayerKV, torch.cuda.Event]:
        return on_stream(self._stream, lambda: self._gather(i, self.device))

    def _layer(self, i: int) -> LayerKV:
        if self._shape is None:
            raise RuntimeError("no chunk in this feed has a cache")
        if self._prefetch is None:
            return self._gather(i, self.device)
        (k, v), event = self._prefetch.get(i)
        consume(self.device, event, k, v)
        return k, v

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
