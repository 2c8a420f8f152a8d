"""The lossless ``raw`` codec: tensors stored as their own bytes in their own dtype."""

from __future__ import annotations

import torch

from kvrag.codec.base import Codec, register_codec


@register_codec("raw")
class RawCodec(Codec):
    """Stores keys then values verbatim; exact round trip in any dtype."""

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        both = torch.stack([keys, values]).contiguous().cpu()  # [2, H, S, D]
        return both.view(torch.uint8).numpy().tobytes()

    def decode_layer(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        expected = 2 * shape[0] * shape[1] * shape[2] * itemsize
        if len(blob) != expected:
            raise ValueError(f"raw layer {layer}: {len(blob)} bytes, expected {expected}")
        flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dtype)
        both = flat.view(2, *shape)
        return both[0], both[1]
