"""The lossless ``raw`` codec: tensors stored as their own bytes in their own dtype."""

from __future__ import annotations

import torch

from kvrag.codec.base import Codec, Plane, register_codec


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

    def planes(self, heads: int, head_dim: int, dtype: torch.dtype) -> list[Plane]:
        return [(2 * heads, head_dim * dtype.itemsize)]

    def decode_planes(
        self, planes: list[torch.Tensor], dtype: torch.dtype, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (plane,) = planes
        rows, tokens, _ = plane.shape
        both = plane.view(dtype).view(2, rows // 2, tokens, -1).to(out_dtype)  # a view when the dtypes agree
        return both[0], both[1]
