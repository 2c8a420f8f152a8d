"""The ``int8`` codec: per-token uniform 8-bit quantisation (CacheGen's baseline).

Every ``(head, token)`` row of ``head_dim`` values gets its own float16 offset (the row minimum) and
scale (range / 255); the row is stored as uint8 codes. Round-trip error per element is at most half a
step plus float16 rounding of the scale and offset: ``|x - x̂| <= 0.51 * (max - min) / 255 + eps``.
At ``head_dim = 64`` this costs 8.5 bits per element (4 bytes of metadata per row of 64 codes).

Blob layout for one layer (little endian)::

    K offsets f16 [H*S] | K scales f16 [H*S] | V offsets f16 [H*S] | V scales f16 [H*S]
    | K codes u8 [H*S*D] | V codes u8 [H*S*D]
"""

from __future__ import annotations

import numpy as np
import torch

from kvrag.codec.base import Codec, Plane, register_codec

_F16_MAX = 65504.0


def _quantise(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x``: ``[H, S, D]`` → (offsets f16 ``[H, S]``, scales f16 ``[H, S]``, codes u8 ``[H, S, D]``)."""
    a = x.detach().to(device="cpu", dtype=torch.float32).numpy()
    if not np.isfinite(a).all() or (a.size and np.abs(a).max() > _F16_MAX):
        raise ValueError(f"int8 codec: the cache holds values that are non-finite or beyond ±{_F16_MAX}")
    lo, hi = a.min(axis=-1, initial=np.inf), a.max(axis=-1, initial=-np.inf)  # [H, S]
    if a.shape[-1] == 0:
        lo, hi = np.zeros(a.shape[:-1], np.float32), np.zeros(a.shape[:-1], np.float32)
    offset = lo.astype(np.float16)
    scale = np.maximum((hi - offset.astype(np.float32)) / 255, 0).astype(np.float16)
    # Round the scale up in float16 where needed, so that the top code still reaches the maximum.
    short = scale.astype(np.float32) * 255 + offset.astype(np.float32) < hi
    scale[short] = np.nextafter(scale[short], np.float16(np.inf))
    safe = np.where(scale > 0, scale, 1).astype(np.float32)[..., None]
    codes = np.clip(np.rint((a - offset.astype(np.float32)[..., None]) / safe), 0, 255).astype(np.uint8)
    return offset, scale, codes


def _dequantise(offset: np.ndarray, scale: np.ndarray, codes: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = codes.astype(np.float32)  # [H, S, D]
    out *= scale.astype(np.float32)[..., None]
    out += offset.astype(np.float32)[..., None]
    return torch.from_numpy(out).to(dtype)


@register_codec("int8")
class Int8Codec(Codec):
    """Per-token 8-bit quantisation with float16 scale and offset; no fitting needed."""

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        if keys.shape != values.shape or keys.dim() != 3:
            raise ValueError(f"int8 codec: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                             "must both be [kv_heads, seq, head_dim]")
        ko, ks, kc = _quantise(keys)
        vo, vs, vc = _quantise(values)
        return b"".join(a.tobytes() for a in (ko, ks, vo, vs, kc, vc))

    def decode_layer(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, s, d = shape
        if min(shape) < 0:
            raise ValueError(f"int8 layer {layer}: negative shape {shape}")
        rows, n = h * s, h * s * d
        expected = 4 * 2 * rows + 2 * n
        if len(blob) != expected:
            raise ValueError(f"int8 layer {layer}: {len(blob)} bytes, expected {expected}")
        buf = np.frombuffer(blob, dtype=np.uint8)
        meta = buf[: 8 * rows].view(np.float16).reshape(4, h, s)  # K off, K scale, V off, V scale
        codes = buf[8 * rows :].reshape(2, h, s, d)
        keys = _dequantise(meta[0], meta[1], codes[0], dtype)
        values = _dequantise(meta[2], meta[3], codes[1], dtype)
        return keys, values

    def planes(self, heads: int, head_dim: int, dtype: torch.dtype) -> list[Plane]:
        return [(heads, 2)] * 4 + [(heads, head_dim)] * 2  # the four float16 rows, then K and V codes

    def decode_planes(
        self, planes: list[torch.Tensor], dtype: torch.dtype, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_off, k_scale, v_off, v_scale, k_codes, v_codes = planes

        def one(offset: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
            # the host decoder's float32 arithmetic, one rounding per step, and its output dtype
            out = codes.float().mul_(scale.view(torch.float16).float())
            return out.add_(offset.view(torch.float16).float()).to(dtype).to(out_dtype)

        return one(k_off, k_scale, k_codes), one(v_off, v_scale, v_codes)
