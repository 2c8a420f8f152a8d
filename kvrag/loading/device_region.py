"""Helpers of `StoreFeed`'s region path: ``cachegen`` layers of every chunk decoded together on the device.

Contract: `region_codec` decides once per feed whether the region path runs and with which codec (all
open chunks stored with one codec and parameters that has ``decode_region``); `layers_per_launch`
sizes the groups of layers decoded per launch on CUDA; `StagingBuffer` is the grow-only host buffer
(pinned on CUDA) the blobs of a group are read into. The decoding itself is
`kvrag.codec.cachegen_region`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag.kernels import rans_decode
from kvrag.loading.prefetch import is_cuda


def region_codec(readers: Sequence[Any], device: torch.device, wanted: bool | None) -> Any:
    """The codec that decodes each layer of all open chunks together on the device
    (`CacheGenCodec.decode_region`; by default on CUDA when Triton is installed), or None. Codecs
    with planes decode on the device in any case (`StoreFeed._produce_planar`).

    Args:
        readers: the feed's chunk readers, None for chunks without an open file.
        device: the feed's device.
        wanted: True to require the region path, False to refuse it, None to take it where it works.

    Raises:
        ValueError: ``wanted`` is True but the chunks do not share one codec that decodes regions.
    """
    opened = [r for r in readers if r is not None]
    kinds = {(str(sorted(r.codec.params().items())), r.header.dtype) for r in opened}
    codec = opened[0].codec if opened and len(kinds) == 1 else None
    able = codec is not None and hasattr(codec, "decode_region")
    if wanted is None:
        wanted = able and is_cuda(device) and rans_decode.works(device)
    if wanted and not able:
        raise ValueError("device_decode needs chunks stored with one codec that decodes on the device "
                         "(cachegen, one fitted state and level)")
    return codec if wanted else None


def layers_per_launch(device: torch.device, shape: tuple[int, int], codec: Any, chunks: int, total: int) -> int:
    """Layers decoded per launch on CUDA: enough blobs for ~4 programs per multiprocessor (each blob is one
    program of 32 lanes), within ~1 GiB of float32 codes.

    Args:
        device: a CUDA device.
        shape: ``(kv_heads, head_dim)`` of the caches.
        codec: the fitted region codec.
        chunks: open chunks in the region (at least 1).
        total: tokens in the region.
    """
    h, d = shape
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    codes = 4 * total * 2 * h * (d + codec._require_fit("decode_region").state.mix_dims)
    return max(1, min(-(-4 * sms // chunks), (1 << 30) // max(1, codes)))


class StagingBuffer:
    """A host byte buffer for the device path, kept for the next groups (pinned on CUDA) and grown by at
    least a quarter when too small. Reusing it is safe: each group's upload has finished when its
    decoding reports back.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffer: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (the previous one when large enough)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, int(1.25 * (self._buffer.numel() if self._buffer is not None else 0)))
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        return self._buffer

    def release(self) -> None:
        """Drop the buffer (a later `get` allocates a new one)."""
        self._buffer = None
