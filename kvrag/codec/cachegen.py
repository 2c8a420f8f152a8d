"""The ``cachegen`` codec: CacheGen-style KV compression with statistics fitted once per index.

Per layer, separately for pre-RoPE K and for V, on the ``C = kv_heads * head_dim`` channels:

1. *Anchor.* Tokens are coded against the per-channel mean fitted on the index's sample chunks (the
   anchor shared by all chunks), not against the first token of their group of ~10 as in CacheGen:
   once the mean is removed, channels correlate only ~0.3 with the next token and ~0.1 with the
   ninth, so a delta has ~1.8× the variance of the value and the 8-bit anchors cost ~0.5
   bits/element more.
2. *Transform.* A KLT (PCA) basis per head, then a second KLT across heads over the ``m = 16``
   strongest components of every head (pre-RoPE keys are nearly low-rank and heads correlate
   mostly in their strong directions). On SmolLM2 this keeps most of a 192-channel KLT's gain
   (ideal 2.49 bits/element at level 1, vs 2.29 for one 192-channel KLT and 2.59 per head alone)
   while decoding costs ``2 * head_dim + 2 * (H*m)**2 / C`` flops per element instead of ``2 * C``.
3. *Layer-wise quantisation.* One uniform step ``Δ = steps[level][kind][group] * rms(layer, kind)``
   on every coded component; steps grow over three layer groups, early layers finer, as in CacheGen.
   Both transforms are orthonormal, so every token's error is at most ``Δ/2 * sqrt(C)`` in L2 norm,
   unless a coefficient exceeds ``32767 Δ`` (clamped).
4. *Entropy coding.* Components are cut into segments by their ``sigma/Δ`` band; each (kind, band)
   has one fitted distribution over codes ``-E..E`` plus an escape (escaped codes follow the blob
   header as int16). ``k <= 4`` codes share one symbol of a product model over
   ``(2E+2)**k <= 256`` tuples. Symbols are coded with kvrag's interleaved rANS coder
   (`kvrag.codec.rans`: 32 lanes, 12-bit probabilities, 16-bit words), whose numba decoder writes
   the dequantised codes straight into the matrices that two batched matmuls turn back into K/V.

Measured on SmolLM2-135M (60 chunks of <= 256 tokens, fitted on 120 others, one core of a shared
2-core EPYC): level 1 takes 2.61 bits/element (6.1× smaller than bf16, container included; format 1
with constriction: 2.40 bits, decoded at 0.064 GB/s); ``mix_dims`` 8 / 24 give 2.65 / 2.57 bits at
about the same speed. On MuSiQue passages of ~590 tokens level 1 decodes at 0.41–0.46 GB/s of bf16
output into new tensors and ~0.6 GB/s into a reused buffer (`decode_layer_into`), one core. That
time is about 25% the rANS kernel (~0.58 symbols per element), 55% the per-head matmul, the rest the
cross-head matmul and glue.

`decode_region` decodes a layer (or several) of many chunks together, side by side as fusion lays
them out: on CUDA with the Triton rANS decoder (`kvrag.kernels.rans_decode`, one launch for every
blob) and two batched matmuls for the region (`kvrag.codec.cachegen_region`).

Levels 0–3 (higher = finer steps, larger blobs); `default_level` is 1. ``params()`` records the
level, the blob format and the fitted state's id; a blob of another level, state or format raises
ValueError on decode (the container turns it into `CorruptChunkError`). Decoding is thread-safe and
releases the GIL in the entropy decoder (tables are built once per level under a lock).

Layer blob, format 2 (little endian)::

    u8 format=2 | u8 level | u16 lanes=32 | u32 state tag | u32 seq | u32 n_escapes | u32 n_words
    | u32 lane states[32] | int16 escapes[n_escapes] | u16 rANS words[n_words]

Symbol order (lane of symbol ``i`` is ``i % 32``): K then V; per kind the layer's segments in
state order (`cachegen_state`); per segment its ``n = seq * w`` codes column by column (``w`` = the
segment's columns), each column's codes in token order; the first ``k * floor(n / k)`` codes as
``k``-tuples (first code most significant; digit ``E + code``, digit ``2E + 1`` for an escape),
the rest one per symbol. Escaped values are listed in code order.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

from kvrag.codec import rans
from kvrag.codec.base import Codec, CodecNotFittedError, register_codec
from kvrag.codec.cachegen_state import MIX_DIMS, N_BANDS, CacheGenState, fit_state, layer_group

BLOB_FORMAT = 2
MAX_TUPLE_ALPHABET = 256
_BLOB = struct.Struct("<BBHIIII")
_Q_MAX = 32767
MAX_SEQ = 1 << 20
Steps = dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]
# Quantisation step per level, per kind (K, V), per layer third (early, middle, late), in units of
# the layer's RMS.
DEFAULT_STEPS: Steps = {
    0: ((0.70, 0.85, 1.00), (0.70, 0.85, 1.00)),
    1: ((0.40, 0.50, 0.60), (0.40, 0.50, 0.60)),
    2: ((0.25, 0.30, 0.35), (0.25, 0.30, 0.35)),
    3: ((0.12, 0.14, 0.16), (0.12, 0.14, 0.16)),
}


@dataclass(frozen=True)
class _Models:
    """The rANS tables of one level: two distributions per (kind, band), tuples then singles."""

    radius: np.ndarray  # int64 [2 * N_BANDS]
    width: np.ndarray  # int64 [2 * N_BANDS]: codes per tuple symbol
    freq: np.ndarray  # u32 [n_dist, 256]
    start: np.ndarray  # u32 [n_dist, 256]
    slot_sym: np.ndarray  # u8 [n_dist, 4096]
    sym_info: np.ndarray  # u32 [n_dist, 256], with `rans.ESCAPE_FLAG` on the symbols that hold an escape
    rows: np.ndarray  # f32 [n_dist, 256 * 4]: the codes of each symbol
    escaped: np.ndarray  # i32 [n_dist, 256]: how many of each symbol's codes are escaped
    min_bits: np.ndarray  # f64 [n_dist]: information content of each distribution's likeliest symbol


@dataclass(frozen=True)
class _LayerPlan:
    """One layer's segments in coding order (K then V) and where their codes go when decoding."""

    kind: np.ndarray
    col0: np.ndarray
    width: np.ndarray  # columns per segment
    dist: np.ndarray  # tuple distribution (the single one is dist + 1)
    k: np.ndarray
    radius: np.ndarray
    head: np.ndarray  # -1 for a segment of the mix group
    dim0: np.ndarray  # first head dimension (head segments)
    # Where the decoder writes each segment's codes for a chunk of S tokens: base0 + S * base_s.
    base0: np.ndarray
    base_s: np.ndarray
    # Bounds for a chunk of S tokens: the layer codes at least S * bits_per_token - bits_slack bits in
    # at most S * symbols_per_token + symbols_slack symbols.
    bits_per_token: float
    bits_slack: float
    symbols_per_token: float
    symbols_slack: int


@dataclass
class _LevelTables:
    models: _Models
    plans: list[_LayerPlan]
    encode_basis: torch.Tensor  # [2, L, H, D, D]: U / Δ
    mix: torch.Tensor  # [2, L, H*m, H*m]
    mean: torch.Tensor  # [2, L, C]
    decode_basis: torch.Tensor  # [L, 2H, D, D]: Δ * Uᵀ (K heads then V heads)
    decode_mix: torch.Tensor  # [L, 2, H*m, H*m]
    decode_mean: torch.Tensor  # [L, 2H, 1, D]


def _tuple_rows(radius: int, width: int) -> np.ndarray:
    """i8 ``[256 * 4]``: the codes of every tuple symbol (`rans.ESCAPE` for an escape digit)."""
    alphabet = 2 * radius + 2
    sym = np.arange(alphabet**width)
    digits = (sym[:, None] // alphabet ** np.arange(width - 1, -1, -1)) % alphabet  # [n, width]
    values = np.where(digits == alphabet - 1, rans.ESCAPE, digits - radius).astype(np.int8)
    rows = np.zeros((rans.MAX_ALPHABET, rans.TUPLE), np.int8)
    rows[: sym.size, :width] = values
    return rows.ravel()


def _models(state: CacheGenState, level: int) -> _Models:
    model = state.levels[level]
    n_dist = 4 * N_BANDS
    radius = model.radius.reshape(-1).astype(np.int64)
    width = np.maximum(1, np.floor(np.log(MAX_TUPLE_ALPHABET) / np.log(2 * radius + 2) + 1e-9)).astype(np.int64)
    width = np.minimum(width, rans.TUPLE)
    freq = np.zeros((n_dist, rans.MAX_ALPHABET), np.uint32)
    slot_sym = np.zeros((n_dist, rans.PROB_SCALE), np.uint8)
    sym_info = np.zeros((n_dist, rans.MAX_ALPHABET), np.uint32)
    rows = np.zeros((n_dist, rans.MAX_ALPHABET * rans.TUPLE), np.int8)
    escaped = np.zeros((n_dist, rans.MAX_ALPHABET), np.int32)
    for i, (e, k) in enumerate(zip(radius, width)):
        single = model.probs.reshape(-1, model.probs.shape[-1])[i, : 2 * e + 2].astype(np.float64)
        joint = single
        for _ in range(k - 1):
            joint = np.outer(joint, single).ravel()  # most significant code first
        for d, (p, w) in enumerate(((joint, k), (single, 1))):
            f = rans.quantise_frequencies(p)
            freq[2 * i + d, : f.size] = f
            rows[2 * i + d] = _tuple_rows(int(e), w)
            escaped[2 * i + d] = (rows[2 * i + d].reshape(rans.MAX_ALPHABET, rans.TUPLE) == rans.ESCAPE).sum(axis=1)
            slot_sym[2 * i + d], sym_info[2 * i + d] = rans.decode_table(f, escaped[2 * i + d, : f.size] > 0)
    start = np.stack([rans.starts(f) for f in freq])
    min_bits = -np.log2(freq.max(axis=1) / rans.PROB_SCALE)
    return _Models(radius, width, freq, start, slot_sym, sym_info, rows.astype(np.float32), escaped, min_bits)


def _plans(state: CacheGenState, level: int, models: _Models) -> list[_LayerPlan]:
    segments, hm = state.levels[level].segments, state.n_heads * state.mix_dims
    rest = state.head_dim - state.mix_dims
    plans = []
    for layer in range(state.n_layers):
        rows = segments[segments[:, 1] == layer]
        rows = rows[np.lexsort((rows[:, 2], rows[:, 0]))]  # K then V, by column
        kind, col0, col1, band = (rows[:, i].astype(np.int64) for i in (0, 2, 3, 4))
        if not ((kind >= 0) & (kind <= 1) & (band >= 0) & (band < N_BANDS)).all():
            raise ValueError(f"cachegen state: invalid segment in layer {layer}")
        for kd in (0, 1):
            c0, c1 = col0[kind == kd], col1[kind == kd]
            if c0.size == 0 or c0[0] != 0 or (c0[1:] != c1[:-1]).any() or c1[-1] != state.n_heads * state.head_dim:
                raise ValueError(f"cachegen state: segments do not tile the columns of layer {layer}")
        dist = kind * N_BANDS + band
        in_head = np.maximum(col0 - hm, 0)
        head = np.where(col0 < hm, -1, in_head // max(rest, 1))
        dim0 = state.mix_dims + in_head % max(rest, 1)
        # Component-major codes: the mix columns of K, of V ([H*m, S] each, then TUPLE floats that
        # the decoder may overwrite), then the heads of K and V ([2H, D, S]).
        pad, hd = rans.TUPLE, state.n_heads * state.head_dim
        base0 = np.where(head < 0, kind * pad, 2 * pad)
        base_s = np.where(head < 0, kind * hm + col0, 2 * hm + kind * hd + head * state.head_dim + dim0)
        k, tuple_bits = models.width[dist], models.min_bits[2 * dist]
        per_token = (col1 - col0) / k  # tuple symbols per token; each segment adds < k singles
        plans.append(_LayerPlan(kind, col0, col1 - col0, 2 * dist, k, models.radius[dist], head, dim0, base0, base_s,
                                float(per_token @ tuple_bits), float(tuple_bits.sum()), float(per_token.sum()),
                                int((k - 1).sum())))
    return plans


def _build_tables(state: CacheGenState, level: int) -> _LevelTables:
    if level not in state.levels or level not in state.steps:
        raise ValueError(f"cachegen state has no tables for level {level}")
    models = _models(state, level)
    third = [layer_group(layer, state.n_layers) for layer in range(state.n_layers)]
    step = torch.tensor([[state.steps[level][kind][t] for t in third] for kind in (0, 1)])
    step = (step * torch.from_numpy(state.scale).float())[..., None, None, None]  # [2, L, 1, 1, 1]
    basis = torch.from_numpy(state.basis).float()  # [2, L, H, D, D]
    mix, mean = torch.from_numpy(state.mix).float(), torch.from_numpy(state.mean).float()
    n_l, h, d = state.n_layers, state.n_heads, state.head_dim
    decode_basis = (basis * step).transpose(-1, -2).transpose(0, 1).reshape(n_l, 2 * h, d, d).contiguous()
    return _LevelTables(models, _plans(state, level, models), basis / step, mix, mean, decode_basis,
                        mix.transpose(0, 1).contiguous(), mean.transpose(0, 1).reshape(n_l, 2 * h, 1, d).contiguous())


class _Shared:
    """A fitted state and its per-level tables, shared by the codecs of every level."""

    def __init__(self, state: CacheGenState) -> None:
        self.state, self.state_id = state, state.state_id
        self.tag = int(self.state_id[:8], 16)
        self._tables: dict[int, _LevelTables] = {}
        self._lock = threading.Lock()
        self.on_device: dict[tuple[int, str], Any] = {}  # per (level, device): `cachegen_region` tables

    def tables(self, level: int) -> _LevelTables:
        with self._lock:
            if level not in self._tables:
                self._tables[level] = _build_tables(self.state, level)
            return self._tables[level]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _layer_symbols(keys: np.ndarray, values: np.ndarray, kind: np.ndarray, col0: np.ndarray, width: np.ndarray,
                   radius: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's integer codes (``[S, C]`` of K and of V) → ``(symbols, run lengths, escaped codes)``.

    Per segment, in order: its codes column by column, each column in token order; the first
    ``k * floor(n / k)`` as ``k``-tuples (first code most significant, digit ``code + E`` or ``2E + 1``
    for an escape), then the rest one per symbol. Runs alternate tuples and singles, two per segment;
    escaped codes are listed in code order.
    """
    seq = keys.shape[0]
    total = seq * (keys.shape[1] + values.shape[1])
    symbols = np.empty(total, np.int32)
    escaped = np.empty(total, np.int16)
    run_len = np.empty(2 * kind.size, np.int64)
    n_sym = n_esc = 0
    for j in range(kind.size):
        codes = keys if kind[j] == 0 else values
        e, kk = radius[j], k[j]
        alphabet, n_tuples = 2 * e + 2, (seq * width[j]) // kk
        acc = count = at = 0
        for c in range(col0[j], col0[j] + width[j]):
            for t in range(seq):
                code = codes[t, c]
                digit = code + e
                if code > e or code < -e:
                    digit = alphabet - 1
                    escaped[n_esc] = code
                    n_esc += 1
                if at < n_tuples * kk:
                    acc = acc * alphabet + digit
                    count += 1
                    if count == kk:
                        symbols[n_sym] = acc
                        n_sym += 1
                        acc = count = 0
                else:
                    symbols[n_sym] = digit
                    n_sym += 1
                at += 1
        run_len[2 * j] = n_tuples
        run_len[2 * j + 1] = seq * width[j] - n_tuples * kk
    return symbols[:n_sym], run_len, escaped[:n_esc]


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
        self._shared: _Shared | None = None

    @classmethod
    def default_level(cls) -> int:
        return 1

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
        self._shared = _Shared(fit_state(samples, n_layers, self.steps, self.mix_dims))

    def save_state(self, directory: Path) -> None:
        self._require_fit("save_state").state.save(Path(directory))

    def load_state(self, directory: Path) -> None:
        shared = _Shared(CacheGenState.load(Path(directory)))
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

    def _require_fit(self, what: str) -> _Shared:
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

    def _quantise(self, x: torch.Tensor, kind: int, layer: int, tables: _LevelTables) -> np.ndarray:
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
        return coded.round_().clamp_(-_Q_MAX, _Q_MAX).to(torch.int32).numpy()

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        shared = self._require_fit("encode_layer")
        if keys.shape != values.shape:
            raise ValueError(f"cachegen: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
        self._check_shape(tuple(keys.shape), layer)
        tables = shared.tables(self.level)
        plan = tables.plans[layer]
        codes = [self._quantise(x, kind, layer, tables) for kind, x in enumerate((keys, values))]
        symbols, run_len, escaped = _layer_symbols(  # type: ignore[call-arg]  # numba's Dispatcher stub
            *codes, plan.kind, plan.col0, plan.width, plan.radius, plan.k)
        run_dist = np.stack([plan.dist, plan.dist + 1], axis=1).ravel()  # tuples, then singles, per segment
        words, states, status = rans.encode(symbols, run_len, run_dist, tables.models.freq, tables.models.start)
        assert status == rans.OK, status  # every symbol of a fitted alphabet has a frequency >= 1
        esc = escaped.astype("<i2")
        head = _BLOB.pack(BLOB_FORMAT, self.level, rans.LANES, shared.tag, keys.shape[1], esc.size, words.size)
        return head + states.astype("<u4").tobytes() + esc.tobytes() + words.astype("<u2").tobytes()

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
        from kvrag.codec import cachegen_region as region
        from kvrag.kernels import rans_decode

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
        code row ``r`` (`_LayerPlan.base_s`) starts at ``base0 + S * r`` (mix rows of K, of V, then
        ``TUPLE`` floats of slack each; head rows of K and V, then ``TUPLE`` floats).
        """
        shared = self._require_fit("decode_layer")
        self._check_shape(tuple(shape), layer)
        tables = shared.tables(self.level)
        h, s, d = shape
        plan, models = tables.plans[layer], tables.models
        states, esc, words, n_words = self._parse_blob(
            blob, shared, s, math.ceil(s * plan.symbols_per_token) + plan.symbols_slack, layer)
        m = tables.mix.shape[-1] // h
        pad = rans.TUPLE
        buf = np.empty(2 * (h * m * s + pad + h * d * s) + pad, np.float32)
        status = rans.decode(words, n_words, states, s * plan.width, plan.k, plan.dist, plan.base0 + s * plan.base_s,
                             models.slot_sym, models.sym_info, models.rows, esc, buf)
        if status != rans.OK:
            raise ValueError(f"cachegen layer {layer}: entropy decoding failed (status {status}): the stream, "
                             "its escapes and its header do not match")
        return buf

    def _parse_blob(self, blob: bytes, shared: _Shared, seq: int, max_symbols: int,
                    layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        n_esc, n_words = self._check_header(blob, shared, seq, layer)
        esc_start = _BLOB.size + 4 * rans.LANES
        words_start = esc_start + 2 * n_esc
        states = np.frombuffer(blob, "<u4", rans.LANES, _BLOB.size).astype(np.uint32)
        esc = np.frombuffer(blob, "<i2", n_esc, esc_start).astype(np.float32)
        # the padding `rans.decode` needs; its content never matters (a stream that uses it fails)
        words = np.empty(n_words + max_symbols + rans.LANES, np.uint16)
        words[:n_words] = np.frombuffer(blob, "<u2", n_words, words_start)
        return states, esc, words, n_words

    def _check_header(self, blob: bytes, shared: _Shared, seq: int, layer: int) -> tuple[int, int]:
        """``(n_escapes, n_words)`` of a layer blob whose header and size match this codec, ``seq`` and
        the fewest bits ``layer`` can code ``seq`` tokens in.
        """
        if len(blob) < _BLOB.size:
            raise ValueError(f"cachegen blob of {len(blob)} bytes is shorter than its header")
        version, level, lanes, tag, blob_seq, n_esc, n_words = _BLOB.unpack_from(blob)
        if version != BLOB_FORMAT:
            raise ValueError(f"cachegen blob format {version}, this kvrag reads format {BLOB_FORMAT} "
                             "(re-encode the index's chunks)")
        if lanes != rans.LANES:
            raise ValueError(f"cachegen blob has {lanes} rANS lanes, this kvrag decodes {rans.LANES}")
        if level != self.level:
            raise ValueError(f"cachegen blob is level {level}, this codec decodes level {self.level}")
        if tag != shared.tag:
            raise ValueError("cachegen blob was written with a different fitted codec state")
        if blob_seq != seq:
            raise ValueError(f"cachegen blob holds {blob_seq} tokens, header says {seq}")
        esc_start = _BLOB.size + 4 * lanes
        words_start = esc_start + 2 * n_esc
        if words_start + 2 * n_words != len(blob):
            raise ValueError(f"cachegen blob of {len(blob)} bytes does not match its section lengths")
        plan = shared.tables(self.level).plans[layer]
        if seq * plan.bits_per_token - plan.bits_slack > 16 * n_words + 32 * rans.LANES:
            raise ValueError(f"cachegen layer {layer}: {n_words} words cannot hold {seq} tokens")
        return n_esc, n_words

    def with_level(self, level: int) -> CacheGenCodec:
        """A copy of the codec at another quality level, sharing the fitted state."""
        clone = CacheGenCodec(level, self.steps, self.mix_dims)
        clone._shared = self._shared
        if clone._shared is not None and level not in clone._shared.state.levels:
            raise ValueError(f"the fitted cachegen state has no level {level}")
        return clone
