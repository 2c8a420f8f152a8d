"""The ``cachegen`` codec: CacheGen-style KV compression with statistics fitted once per index.

Contract: per layer, separately for pre-RoPE K and V, tokens are coded against a fitted per-channel mean,
transformed by a per-head KLT and a cross-head KLT of the strongest components, quantised with one uniform step
per layer group and kind, and entropy-coded with kvrag's interleaved rANS coder (`kvrag.codec.rans`). Both
transforms are orthonormal, so every token's error is at most ``Δ/2 * sqrt(C)`` in L2 norm unless a coefficient
is clamped (logged, naming the layer). Levels 0–3 (higher = finer, larger); `default_level` is 2. ``params()``
records the level, blob format and fitted state's id; a blob of another level, state or format raises ValueError
on decode (the container makes it a `CorruptChunkError`). Decoding is thread-safe and releases the GIL in the
entropy decoder. `decode_region` decodes a region of many chunks at once (on CUDA with the Triton decoder).
The blob format is in `kvrag.codec.cachegen_format`, the per-level tables in `kvrag.codec.cachegen_tables`,
the fitted statistics in `kvrag.codec.cachegen_state`; docs/codecs.md gives the design and its measurements.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrag.codec import cachegen_format, rans
from kvrag.codec import cachegen_region as region
from kvrag.codec.base import Codec, CodecNotFittedError, register_codec
from kvrag.codec.cachegen_format import BLOB_FORMAT, MAX_SEQ, Q_MAX, pack_blob, parse_blob
from kvrag.codec.cachegen_state import MIX_DIMS, CacheGenState, fit_state, layer_group
from kvrag.codec.cachegen_tables import DEFAULT_STEPS, LevelTables, SharedState, Steps
from kvrag.kernels import rans_decode

log = logging.getLogger(__name__)

__all__ = ["BLOB_FORMAT", "DEFAULT_STEPS", "CacheGenCodec", "Steps"]


@register_codec("cachegen")
class CacheGenCodec(Codec):
    """Two-stage KLT transform coding with layer-wise steps and fitted rANS models; see the module docstring.

    Example:
        >>> codec = make_codec("cachegen", level=1)  # doctest: +SKIP
        >>> codec.fit(sample_caches, n_layers=30); codec.save_state(index_dir / "codec")  # doctest: +SKIP
        >>> blob = codec.encode_layer(keys[0], values[0], layer=0)  # doctest: +SKIP
    """

    needs_fit = True

    def __init__(self, level: int | None = None, steps: Steps | None = None, mix_dims: int = MIX_DIMS) -> None:
        super().__init__(level)
        if self.level not in self.levels():
            raise ValueError(f"cachegen has levels {self.levels()}, got level={self.level}")
        if mix_dims < 0:
            raise ValueError(f"cachegen: mix_dims must be >= 0, got {mix_dims}")
        self.steps = dict(DEFAULT_STEPS if steps is None else steps)
        self.mix_dims = mix_dims  # used by fit(); a loaded state carries its own
        self._shared: SharedState | None = None

    @classmethod
    def default_level(cls) -> int:
        # level 2: answers closest to uncompressed caches per byte among the levels measured
        # (benchmarks/codec-default-level); level 1 is 21 % smaller but moves more answers
        return 2

    @classmethod
    def levels(cls) -> tuple[int, ...]:
        return tuple(sorted(DEFAULT_STEPS))

    @property
    def fitted(self) -> bool:
        return self._shared is not None

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"name": self.name, "level": self.level, "format": BLOB_FORMAT}
        if self._shared is not None:
            params["state"] = self._shared.state_id
        return params

    def fit(self, samples: list[tuple[torch.Tensor, torch.Tensor]], n_layers: int) -> None:
        self._shared = SharedState(fit_state(samples, n_layers, self.steps, self.mix_dims))

    def save_state(self, directory: Path) -> None:
        self._require_fit("save_state").state.save(Path(directory))

    def load_state(self, directory: Path) -> None:
        shared = SharedState(CacheGenState.load(Path(directory)))
        if self.level not in shared.state.levels:
            raise ValueError(f"cachegen state in {directory} has levels {sorted(shared.state.levels)}, "
                             f"not level {self.level}")
        self._shared, self.steps, self.mix_dims = shared, dict(shared.state.steps), shared.state.mix_dims

    def step(self, layer: int, kind: int) -> float:
        """The quantisation step Δ of ``layer`` for keys (``kind=0``) or values (1) at this level.

        Every token's reconstruction error is at most ``Δ/2 * sqrt(kv_heads * head_dim)`` in L2 norm.
        """
        state = self._require_fit("step").state
        return float(state.steps[self.level][kind][layer_group(layer, state.n_layers)] * state.scale[kind, layer])

    def _require_fit(self, what: str) -> SharedState:
        if self._shared is None:
            raise CodecNotFittedError(
                f"cachegen codec: {what} called before fit() or load_state(); fit it on sample chunk "
                "caches (codec.fit(samples, n_layers)) or load the index's state (codec.load_state(dir))")
        return self._shared

    def _check_shape(self, shape: tuple[int, ...], layer: int) -> None:
        state = self._require_fit("encode/decode").state
        if len(shape) != 3 or shape[0] != state.n_heads or shape[2] != state.head_dim:
            raise ValueError(f"cachegen: layer shape {tuple(shape)} does not match the fitted "
                             f"[{state.n_heads}, seq, {state.head_dim}]")
        if not 0 <= layer < state.n_layers:
            raise ValueError(f"cachegen: layer {layer} outside the fitted 0..{state.n_layers - 1}")
        if not 0 <= shape[1] <= MAX_SEQ:
            raise ValueError(f"cachegen: seq {shape[1]} outside 0..{MAX_SEQ}")

    def _quantise(self, x: torch.Tensor, kind: int, layer: int, tables: LevelTables) -> np.ndarray:
        """``x`` ``[H, S, D]`` → integer coded columns ``[S, C]`` (see `cachegen_state`)."""
        h, s, d = x.shape
        x = x.detach().to("cpu", torch.float32)
        # a finite sum means every value is finite (inf and nan do not cancel); check them all only if not
        if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
            raise ValueError(f"cachegen: non-finite values in layer {layer}")
        centred = x - tables.mean[kind, layer].view(h, 1, d)
        comps = torch.bmm(centred, tables.encode_basis[kind, layer])  # [H, S, D], in units of Δ
        m = tables.mix.shape[-1] // h
        top = comps[:, :, :m].transpose(0, 1).reshape(s, h * m) @ tables.mix[kind, layer]  # [S, H*m]
        coded = torch.cat([top, comps[:, :, m:].transpose(0, 1).reshape(s, h * (d - m))], dim=1)  # [S, C]
        coded.round_()
        beyond = int((coded.abs() > Q_MAX).sum())
        if beyond:  # the error bound does not hold for these: say so rather than clamp in silence
            log.warning("cachegen: %d coded value%s of layer %d (%s) beyond %d steps clamped; those tokens' error "
                        "exceeds the codec's bound (the raw codec stores them exactly)", beyond,
                        "s" if beyond > 1 else "", layer, ("keys", "values")[kind], Q_MAX)
        return coded.clamp_(-Q_MAX, Q_MAX).to(torch.int32).numpy()

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        shared = self._require_fit("encode_layer")
        if keys.shape != values.shape:
            raise ValueError(f"cachegen: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
        self._check_shape(tuple(keys.shape), layer)
        tables = shared.tables(self.level)
        plan = tables.plans[layer]
        codes = [self._quantise(x, kind, layer, tables) for kind, x in enumerate((keys, values))]
        symbols, run_len, escaped = cachegen_format.layer_symbols(  # type: ignore[call-arg]  # numba's Dispatcher stub
            *codes, plan.kind, plan.col0, plan.width, plan.radius, plan.k)
        run_dist = np.stack([plan.dist, plan.dist + 1], axis=1).ravel()  # tuples, then singles, per segment
        words, states, status = rans.encode(symbols, run_len, run_dist, tables.models.freq, tables.models.start)
        assert status == rans.OK, status  # every symbol of a fitted alphabet has a frequency >= 1
        return pack_blob(self.level, shared.tag, keys.shape[1], states, escaped, words)

    def decode_layer(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean, rows, basis = self._components(blob, layer, shape)
        out = torch.baddbmm(mean, rows, basis)
        return out[: shape[0]].to(dtype), out[shape[0] :].to(dtype)  # [H, S, D] each

    def decode_layer_into(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype, out: torch.Tensor
    ) -> None:
        """As `decode_layer`. When ``out`` is contiguous and of the cache's dtype, the last transform
        writes straight into it (float32), or is rounded into it in one pass (other dtypes).
        """
        if not (out.dtype == dtype and out.is_contiguous() and out.shape == (2, *shape)):
            super().decode_layer_into(blob, layer, shape, dtype, out)
            return
        mean, rows, basis = self._components(blob, layer, shape)
        heads = out.view(2 * shape[0], *shape[1:])
        if dtype == torch.float32:
            torch.baddbmm(mean, rows, basis, out=heads)
        else:  # the same single rounding as decode_layer's .to(dtype)
            heads.copy_(torch.baddbmm(mean, rows, basis))

    def decode_region(self, blobs: Sequence[Sequence[bytes]], layers: Sequence[int], lengths: Sequence[int],
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      kernel: bool | None = None) -> torch.Tensor:
        """Layers of several chunks decoded together and put side by side: ``[len(layers), 2, H, T, D]``
        in ``dtype`` on ``device`` (keys then values; ``T = sum(lengths)``, chunk ``j``'s tokens after
        chunk ``j - 1``'s). ``blobs[i][j]`` is layer ``layers[i]`` of chunk ``j``, of ``lengths[j]`` tokens.

        ``kernel`` picks the rANS decoder: the Triton one (`kvrag.kernels.rans_decode`, all blobs in one
        launch) or the host one (blob by blob); None uses Triton on CUDA where it passes its check
        (`kvrag.kernels.rans_decode.works`), as fusion's loader does. Both give
        the same codes; the transforms then run on ``device``, once for the region. Each value is
        `decode_layer`'s up to float32 rounding (see `kvrag.codec.cachegen_region`).

        Raises:
            ValueError: a blob does not decode (the message names it).
        """
        device = torch.device(device)
        if kernel is None:
            kernel = device.type == "cuda" and rans_decode.works(device)
        if kernel:
            codes = region.kernel_codes(self, region.build_batch(self, blobs, layers, lengths), device)
        else:
            codes = region.host_codes(self, blobs, layers, lengths).to(device)
        return region.transform(self, codes, layers, dtype)

    def _components(self, blob: bytes, layer: int,
                    shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's decoded components as ``(mean [2H, 1, D], rows [2H, S, D], basis [2H, D, D])``
        (K heads then V heads): the layer is ``mean + rows @ basis``.
        """
        flat = torch.from_numpy(self._codes(blob, layer, shape))  # checks the fit and the shape first
        tables = self._require_fit("decode_layer").tables(self.level)
        h, s, d = shape
        m = tables.mix.shape[-1] // h
        size_a, pad = h * m * s, rans.TUPLE
        at = 2 * (size_a + pad)  # the heads' codes, [2H, D, S]
        if m:  # undo the cross-head KLT: [H*m, H*m] @ [H*m, S] per kind, into each head's first m rows
            top = flat.as_strided((2, h * m, s), (size_a + pad, s, 1))
            flat.as_strided((2, h, m, s), (h * d * s, d * s, s, 1), at).copy_(
                torch.bmm(tables.decode_mix[layer], top).view(2, h, m, s))
        rows = flat.as_strided((2 * h, s, d), (d * s, 1, s), at)
        return tables.decode_mean[layer], rows, tables.decode_basis[layer]

    def _codes(self, blob: bytes, layer: int, shape: tuple[int, int, int]) -> np.ndarray:
        """The layer's dequantised codes, as the rANS decoder writes them: for a chunk of ``S`` tokens,
        code row ``r`` (`cachegen_tables.LayerPlan.base_s`) starts at ``base0 + S * r`` (mix rows of K, of V, then
        ``TUPLE`` floats of slack each; head rows of K and V, then ``TUPLE`` floats).
        """
        shared = self._require_fit("decode_layer")
        self._check_shape(tuple(shape), layer)
        tables = shared.tables(self.level)
        h, s, d = shape
        plan, models = tables.plans[layer], tables.models
        states, esc, words, n_words = parse_blob(
            blob, self.level, shared, s, math.ceil(s * plan.symbols_per_token) + plan.symbols_slack, layer)
        m = tables.mix.shape[-1] // h
        pad = rans.TUPLE
        buf = np.empty(2 * (h * m * s + pad + h * d * s) + pad, np.float32)
        status = rans.decode(words, n_words, states, s * plan.width, plan.k, plan.dist, plan.base0 + s * plan.base_s,
                             models.slot_sym, models.sym_info, models.rows, esc, buf)
        if status != rans.OK:
            raise ValueError(f"cachegen layer {layer}: entropy decoding failed (status {status}): the stream, "
                             "its escapes and its header do not match")
        return buf

    def with_level(self, level: int) -> CacheGenCodec:
        """A copy of the codec at another quality level, sharing the fitted state."""
        clone = CacheGenCodec(level, self.steps, self.mix_dims)
        clone._shared = self._shared
        if clone._shared is not None and level not in clone._shared.state.levels:
            raise ValueError(f"the fitted cachegen state has no level {level}")
        return clone
