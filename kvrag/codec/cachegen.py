"""The ``cachegen`` codec: CacheGen-style KV compression with statistics fitted once per index.

Per layer, separately for pre-RoPE K and for V, on the ``C = kv_heads * head_dim`` channels:

1. *Anchor.* Tokens are coded against the per-channel mean fitted on the index's sample chunks (the
   anchor shared by all chunks), not against the first token of their group of ~10 as in CacheGen:
   once the mean is removed, channels correlate only ~0.3 with the next token and ~0.1 with the
   ninth, so a delta has ~1.8× the variance of the value and the 8-bit anchors cost ~0.5
   bits/element more. Measured on SmolLM2 (300 chunks, same entropy coding): at 6.7 % / 13 %
   relative error CacheGen's anchor+delta coding needs 3.6 / 3.7 bits per K / V element, per-channel
   coding against the mean 2.8 / 3.0, and this codec 2.0 / 2.5.
2. *Transform.* A KLT (PCA) basis per block of whole heads (``<= 256`` channels), fitted once:
   pre-RoPE keys are nearly low-rank and heads are correlated.
3. *Layer-wise quantisation.* One uniform step ``Δ = steps[level][kind][group] * rms(layer, kind)``
   on every KLT component (equal distortion per component is MSE-optimal; weak components round to
   zero and cost ~nothing); steps grow over three layer groups, early layers finer, as in CacheGen
   (on SmolLM2, coarse steps in the first third hurt ~15× more than in the others). Error bound, per
   token: ``||x - x̂||_2 <= Δ/2 * sqrt(C)``, unless a coefficient exceeds ``32767 Δ`` (clamped).
4. *Entropy coding.* Per (layer, kind, block), components are cut into bands of ``sigma/Δ``; each
   band has a fitted distribution over codes ``-E..E`` plus an escape (escaped codes follow the
   blob header as int16), with ``E`` covering 99.9 % of the fitted codes. ``k`` codes share one
   symbol of a product model over ``(2E+2)**k <= 4096`` tuples. Symbols are coded with
   `constriction`'s rANS ``AnsCoder`` (its decoder beat the range decoder by 5–30 % here; decode
   speed is bound by the coder's 25–60 M symbols/s), one whole array per segment.

Levels 0–3 (higher = finer steps, larger blobs); `default_level` is 1, the finest that stays under
the 2.67 bits/element (6× vs bf16) target with margin. ``params()`` records the level, the blob
format and the fitted state's id; a blob of another level or state raises ValueError on decode
(the container turns it into `CorruptChunkError`). Decoding is thread-safe (tables are built once
per level under a lock and never mutated).

Layer blob (little endian)::

    u8 format | u8 level | u16 0 | u32 state tag | u32 seq | u32 n_escapes | u32 n_words
    | int16 escapes[n_escapes] | pad to 4 bytes | u32 rANS words[n_words]
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import constriction
import numpy as np
import torch

from kvrag.codec.base import Codec, CodecNotFittedError, register_codec
from kvrag.codec.cachegen_state import MAX_TUPLE_ALPHABET, CacheGenState, fit_state, layer_group

BLOB_FORMAT = 1
_BLOB = struct.Struct("<BBHIIII")
_SENTINEL = -32768
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
class _Coding:
    """One entropy model: ``width`` codes per symbol, and the float32 codes of every symbol."""

    model: Any  # constriction Categorical over (2E+2)**width symbols
    lut: np.ndarray  # float32 [(2E+2)**width, width]; _SENTINEL marks an escaped code
    has_escape: np.ndarray  # bool [(2E+2)**width]
    zero: int  # the symbol of all-zero codes
    min_bits: float  # information content of the most probable symbol


@dataclass(frozen=True)
class _Segment:
    """A contiguous range of one block's components that share one symbol distribution.

    Its codes, component-major (``[stop - start, S]`` flattened), are coded as tuples of ``width``
    followed by the < ``width`` leftover codes one at a time.
    """

    col0: int  # first row in the layer's [C, S] block-major coefficient matrix
    col1: int
    block: int
    stop: int  # end of the range within its block
    radius: int
    tuples: _Coding
    singles: _Coding

    @property
    def width(self) -> int:
        return int(self.tuples.lut.shape[1])

    def counts(self, seq: int) -> tuple[int, int]:
        """(tuple symbols, single symbols) for ``seq`` tokens."""
        return divmod(seq * (self.col1 - self.col0), self.width)


@dataclass
class _LevelTables:
    segments: list[list[list[_Segment]]]  # [kind][layer] -> segments in coding order
    encode_basis: torch.Tensor  # [2, L, n_blocks, b, b]: U / Δ
    decode_basis: torch.Tensor  # [2, L, n_blocks, b, b]: Δ * Uᵀ
    mean: torch.Tensor  # [2, L, C]


def _coding(probs: np.ndarray, radius: int, width: int) -> _Coding:
    alphabet = 2 * radius + 2
    joint = probs.astype(np.float64)
    for _ in range(width - 1):
        joint = np.outer(joint, probs.astype(np.float64)).ravel()  # most significant code first
    digits = (np.arange(alphabet**width)[:, None] // alphabet ** np.arange(width - 1, -1, -1)) % alphabet
    lut = np.where(digits == alphabet - 1, _SENTINEL, digits - radius).astype(np.float32)
    zero = int(sum(radius * alphabet**j for j in range(width)))
    model = constriction.stream.model.Categorical(joint, perfect=False)
    return _Coding(model, lut, (lut == _SENTINEL).any(axis=1), zero, float(-np.log2(joint.max() / joint.sum())))


def _segment(row: np.ndarray, probs: np.ndarray, block: int) -> _Segment:
    _, _, b, lo, hi, radius, width = (int(v) for v in row)
    if not (0 <= lo < hi <= block and 1 <= radius and 1 <= width
            and (2 * radius + 2) ** width <= MAX_TUPLE_ALPHABET):
        raise ValueError(f"cachegen state: invalid segment {row.tolist()}")
    return _Segment(b * block + lo, b * block + hi, b, hi, radius, _coding(probs, radius, width),
                    _coding(probs, radius, 1))


def _build_tables(state: CacheGenState, level: int) -> _LevelTables:
    if level not in state.levels or level not in state.steps:
        raise ValueError(f"cachegen state has no tables for level {level}")
    model, n_layers = state.levels[level], state.n_layers
    segments: list[list[list[_Segment]]] = [[[] for _ in range(n_layers)] for _ in range(2)]
    offset = 0
    for row in model.segments:
        kind, layer, radius = int(row[0]), int(row[1]), int(row[5])
        if kind not in (0, 1) or not 0 <= layer < n_layers or offset + 2 * radius + 2 > model.probs.size:
            raise ValueError(f"cachegen state: invalid segment {row.tolist()}")
        segments[kind][layer].append(_segment(row, model.probs[offset : offset + 2 * radius + 2], state.block))
        offset += 2 * radius + 2
    channels = state.n_heads * state.head_dim
    for per_layer in segments:
        for segs in per_layer:
            if not segs or [s.col0 for s in segs] != [0, *[s.col1 for s in segs[:-1]]] or segs[-1].col1 != channels:
                raise ValueError("cachegen state: segments do not tile the channels")
    third = [layer_group(layer, n_layers) for layer in range(n_layers)]
    step = torch.tensor([[state.steps[level][kind][t] for t in third] for kind in (0, 1)])
    step = step * torch.from_numpy(state.scale).float()  # [2, L]
    basis = torch.from_numpy(state.basis).float()  # [2, L, n_blocks, b, b]
    return _LevelTables(segments, basis / step[..., None, None, None],
                        (basis * step[..., None, None, None]).transpose(-1, -2).contiguous(),
                        torch.from_numpy(state.mean).float())


class _Shared:
    """A fitted state and its per-level tables, shared by the codecs of every level."""

    def __init__(self, state: CacheGenState) -> None:
        self.state, self.state_id = state, state.state_id
        self.tag = int(self.state_id[:8], 16)
        self._tables: dict[int, _LevelTables] = {}
        self._lock = threading.Lock()

    def tables(self, level: int) -> _LevelTables:
        with self._lock:
            if level not in self._tables:
                self._tables[level] = _build_tables(self.state, level)
            return self._tables[level]


def _symbols(codes: np.ndarray, seg: _Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One segment's codes ``[w, S]`` → (tuple symbols, single symbols, escaped codes)."""
    flat = np.ascontiguousarray(codes).ravel()
    escaped = np.abs(flat) > seg.radius
    alphabet = 2 * seg.radius + 2
    digits = np.where(escaped, alphabet - 1, flat + seg.radius)
    n_tuples = flat.size // seg.width
    grouped = digits[: n_tuples * seg.width].reshape(n_tuples, seg.width)
    tuples = grouped[:, 0].astype(np.int64)
    for j in range(1, seg.width):
        tuples = tuples * alphabet + grouped[:, j]
    return tuples.astype(np.int32), digits[n_tuples * seg.width :].astype(np.int32), flat[escaped]


@register_codec("cachegen")
class CacheGenCodec(Codec):
    """KLT transform coding with layer-wise steps and fitted rANS models; see the module docstring.

    Example:
        >>> codec = make_codec("cachegen", level=1)  # doctest: +SKIP
        >>> codec.fit(sample_caches, n_layers=30); codec.save_state(index_dir / "codec")  # doctest: +SKIP
        >>> blob = codec.encode_layer(keys[0], values[0], layer=0)  # doctest: +SKIP
    """

    needs_fit = True

    def __init__(self, level: int | None = None, steps: Steps | None = None) -> None:
        super().__init__(level)
        if self.level not in self.levels():
            raise ValueError(f"cachegen has levels {self.levels()}, got level={self.level}")
        self.steps = dict(DEFAULT_STEPS if steps is None else steps)
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
        self._shared = _Shared(fit_state(samples, n_layers, self.steps))

    def save_state(self, directory: Path) -> None:
        self._require_fit("save_state").state.save(Path(directory))

    def load_state(self, directory: Path) -> None:
        shared = _Shared(CacheGenState.load(Path(directory)))
        if self.level not in shared.state.levels:
            raise ValueError(f"cachegen state in {directory} has levels {sorted(shared.state.levels)}, "
                             f"not level {self.level}")
        self._shared, self.steps = shared, dict(shared.state.steps)

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
        """``x`` ``[H, S, D]`` → integer KLT coefficients ``[C, S]`` (block-major components)."""
        h, s, d = x.shape
        rows = x.detach().to("cpu", torch.float32).permute(1, 0, 2).reshape(s, h * d)  # [S, C]
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"cachegen: non-finite values in layer {layer}")
        rows = rows - tables.mean[kind, layer]
        basis = tables.encode_basis[kind, layer]  # [n_blocks, b, b]
        b = basis.shape[-1]
        coeffs = torch.cat([basis[i].t() @ rows[:, i * b : (i + 1) * b].t() for i in range(basis.shape[0])])
        return coeffs.round_().clamp_(-_Q_MAX, _Q_MAX).to(torch.int32).numpy()

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> bytes:
        shared = self._require_fit("encode_layer")
        if keys.shape != values.shape:
            raise ValueError(f"cachegen: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
        self._check_shape(tuple(keys.shape), layer)
        tables = shared.tables(self.level)
        streams, escapes = [], []
        for kind, x in enumerate((keys, values)):
            codes = self._quantise(x, kind, layer, tables)
            for seg in tables.segments[kind][layer]:
                tuples, singles, escaped = _symbols(codes[seg.col0 : seg.col1], seg)
                streams += [(tuples, seg.tuples.model), (singles, seg.singles.model)]
                escapes.append(escaped)
        coder = constriction.stream.stack.AnsCoder()
        for symbols, model in reversed(streams):  # a stack: the decoder pops them in coding order
            if symbols.size:
                coder.encode_reverse(symbols, model)
        words = coder.get_compressed().astype("<u4")
        esc = np.concatenate(escapes).astype("<i2") if escapes else np.zeros(0, "<i2")
        head = _BLOB.pack(BLOB_FORMAT, self.level, 0, shared.tag, keys.shape[1], esc.size, words.size)
        return head + esc.tobytes() + b"\0" * (-esc.nbytes % 4) + words.tobytes()

    def decode_layer(
        self, blob: bytes, layer: int, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shared = self._require_fit("decode_layer")
        self._check_shape(tuple(shape), layer)
        tables = shared.tables(self.level)
        esc, words = self._parse_blob(blob, shared, shape[1])
        segs = tables.segments
        min_bits = sum(n * coding.min_bits for kind in (0, 1) for seg in segs[kind][layer]
                       for n, coding in zip(seg.counts(shape[1]), (seg.tuples, seg.singles)))
        if min_bits > 32 * words.size + 64:
            raise ValueError(f"cachegen layer {layer}: {words.size} words cannot hold {shape[1]} tokens")
        try:
            coder = constriction.stream.stack.AnsCoder(words)
            used, out = 0, []
            for kind in (0, 1):
                coeffs, used, rank = self._decode_codes(coder, segs[kind][layer], shape[1], esc, used)
                out.append(self._reconstruct(coeffs, rank, kind, layer, shape, tables))
            clean = coder.is_empty()
        except (ValueError, RuntimeError, OverflowError, IndexError, TypeError) as exc:
            raise ValueError(f"cachegen layer {layer}: entropy decoding failed: {exc}") from None
        if used != esc.size or not clean:
            raise ValueError(f"cachegen layer {layer}: stream and escapes do not match its header")
        return out[0].to(dtype), out[1].to(dtype)

    def _parse_blob(self, blob: bytes, shared: _Shared, seq: int) -> tuple[np.ndarray, np.ndarray]:
        if len(blob) < _BLOB.size:
            raise ValueError(f"cachegen blob of {len(blob)} bytes is shorter than its header")
        version, level, _, tag, blob_seq, n_esc, n_words = _BLOB.unpack_from(blob)
        if version != BLOB_FORMAT:
            raise ValueError(f"cachegen blob format {version}, this kvrag reads {BLOB_FORMAT}")
        if level != self.level:
            raise ValueError(f"cachegen blob is level {level}, this codec decodes level {self.level}")
        if tag != shared.tag:
            raise ValueError("cachegen blob was written with a different fitted codec state")
        if blob_seq != seq:
            raise ValueError(f"cachegen blob holds {blob_seq} tokens, header says {seq}")
        esc_end = _BLOB.size + 2 * n_esc
        words_start = esc_end + (-2 * n_esc) % 4
        if words_start + 4 * n_words != len(blob):
            raise ValueError(f"cachegen blob of {len(blob)} bytes does not match its section lengths")
        esc = np.frombuffer(blob, "<i2", n_esc, _BLOB.size).astype(np.float32)
        words = np.frombuffer(blob, "<u4", n_words, words_start).astype(np.uint32)
        return esc, words

    def _decode_codes(
        self, coder: Any, segments: list[_Segment], seq: int, esc: np.ndarray, used: int
    ) -> tuple[np.ndarray, int, list[int]]:
        """Decode one kind's codes ``[C, S]`` float32; also the escapes used and per-block rank."""
        coeffs = np.empty((segments[-1].col1, seq), np.float32)
        rank = [0] * (segments[-1].block + 1)
        for seg in segments:
            region = coeffs[seg.col0 : seg.col1].reshape(-1)
            n_tuples, n_singles = seg.counts(seq)
            split = n_tuples * seg.width
            nonzero = escapes = False
            for coding, n, out in ((seg.tuples, n_tuples, region[:split]), (seg.singles, n_singles, region[split:])):
                if n == 0:
                    continue
                symbols = coder.decode(coding.model, n)
                np.take(coding.lut, symbols, axis=0, out=out.reshape(n, -1))
                escapes = escapes or bool(coding.has_escape[symbols].any())
                nonzero = nonzero or bool((symbols != coding.zero).any())
            if escapes:
                hit = np.flatnonzero(region == _SENTINEL)
                if used + hit.size > esc.size:
                    raise ValueError("more escape symbols than escaped values")
                region[hit] = esc[used : used + hit.size]
                used += hit.size
            if nonzero:
                rank[seg.block] = max(rank[seg.block], seg.stop)
        return coeffs, used, rank

    def _reconstruct(
        self, coeffs: np.ndarray, rank: list[int], kind: int, layer: int,
        shape: tuple[int, int, int], tables: _LevelTables,
    ) -> torch.Tensor:
        """``x̂ = mean + coeffs @ (Δ Uᵀ)`` per head, skipping components that are zero in this chunk."""
        h, s, d = shape
        out = torch.empty((h, s, d), dtype=torch.float32)
        coeffs_t = torch.from_numpy(coeffs)  # [C, S]
        basis = tables.decode_basis[kind, layer]  # [n_blocks, b, b]
        mean = tables.mean[kind, layer].view(h, d)
        heads_per_block = basis.shape[-1] // d
        for head in range(h):
            blk, sub = divmod(head, heads_per_block)
            r = rank[blk]
            if r == 0 or s == 0:
                out[head] = mean[head]
                continue
            b0 = blk * basis.shape[-1]
            torch.addmm(mean[head], coeffs_t[b0 : b0 + r].t(), basis[blk, :r, sub * d : (sub + 1) * d],
                        out=out[head])
        return out

    def with_level(self, level: int) -> CacheGenCodec:
        """A copy of the codec at another quality level, sharing the fitted state."""
        clone = CacheGenCodec(level, self.steps)
        clone._shared = self._shared
        if clone._shared is not None and level not in clone._shared.state.levels:
            raise ValueError(f"the fitted cachegen state has no level {level}")
        return clone

