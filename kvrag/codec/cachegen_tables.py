"""Per-level tables of the ``cachegen`` codec, derived from a fitted `CacheGenState`.

Contract: `build_tables` turns a fitted state and a level into everything encoding and decoding need —
the rANS models of every (kind, band) distribution (`Models`: tuples then singles), each layer's
segment plan in coding order (`LayerPlan`: where its codes go when decoding, and bounds on its
stream), and the transform matrices scaled by the level's quantisation steps (`LevelTables`). The
tables are a pure function of the state and the level, so a blob decodes identically whenever they
are rebuilt. `SharedState` holds one fitted state and builds each level's tables once, under a lock,
for the codecs of every level.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvrag.codec import rans
from kvrag.codec.cachegen_state import N_BANDS, CacheGenState, layer_group

MAX_TUPLE_ALPHABET = 256
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
class Models:
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
class LayerPlan:
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
class LevelTables:
    """Everything one level needs: its rANS models, every layer's plan and the scaled transforms."""

    models: Models
    plans: list[LayerPlan]
    encode_basis: torch.Tensor  # [2, L, H, D, D]: U / Δ
    mix: torch.Tensor  # [2, L, H*m, H*m]
    mean: torch.Tensor  # [2, L, C]
    decode_basis: torch.Tensor  # [L, 2H, D, D]: Δ * Uᵀ (K heads then V heads)
    decode_mix: torch.Tensor  # [L, 2, H*m, H*m]
    decode_mean: torch.Tensor  # [L, 2H, 1, D]


def tuple_rows(radius: int, width: int) -> np.ndarray:
    """i8 ``[256 * 4]``: the codes of every tuple symbol (`rans.ESCAPE` for an escape digit)."""
    alphabet = 2 * radius + 2
    sym = np.arange(alphabet**width)
    digits = (sym[:, None] // alphabet ** np.arange(width - 1, -1, -1)) % alphabet  # [n, width]
    values = np.where(digits == alphabet - 1, rans.ESCAPE, digits - radius).astype(np.int8)
    rows = np.zeros((rans.MAX_ALPHABET, rans.TUPLE), np.int8)
    rows[: sym.size, :width] = values
    return rows.ravel()


def build_models(state: CacheGenState, level: int) -> Models:
    """The rANS models of ``level``: per (kind, band), a tuple distribution then a single one."""
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
            rows[2 * i + d] = tuple_rows(int(e), w)
            escaped[2 * i + d] = (rows[2 * i + d].reshape(rans.MAX_ALPHABET, rans.TUPLE) == rans.ESCAPE).sum(axis=1)
            slot_sym[2 * i + d], sym_info[2 * i + d] = rans.decode_table(f, escaped[2 * i + d, : f.size] > 0)
    start = np.stack([rans.starts(f) for f in freq])
    min_bits = -np.log2(freq.max(axis=1) / rans.PROB_SCALE)
    return Models(radius, width, freq, start, slot_sym, sym_info, rows.astype(np.float32), escaped, min_bits)


def build_plans(state: CacheGenState, level: int, models: Models) -> list[LayerPlan]:
    """Every layer's segment plan at ``level``.

    Raises:
        ValueError: the state's segments are invalid or do not tile a layer's columns.
    """
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
        plans.append(LayerPlan(kind, col0, col1 - col0, 2 * dist, k, models.radius[dist], head, dim0, base0, base_s,
                               float(per_token @ tuple_bits), float(tuple_bits.sum()), float(per_token.sum()),
                               int((k - 1).sum())))
    return plans


def build_tables(state: CacheGenState, level: int) -> LevelTables:
    """All of ``level``'s tables for the fitted ``state``.

    Raises:
        ValueError: the state has no model or steps for ``level``, or invalid segments.
    """
    if level not in state.levels or level not in state.steps:
        raise ValueError(f"cachegen state has no tables for level {level}")
    models = build_models(state, level)
    third = [layer_group(layer, state.n_layers) for layer in range(state.n_layers)]
    step = torch.tensor([[state.steps[level][kind][t] for t in third] for kind in (0, 1)])
    step = (step * torch.from_numpy(state.scale).float())[..., None, None, None]  # [2, L, 1, 1, 1]
    basis = torch.from_numpy(state.basis).float()  # [2, L, H, D, D]
    mix, mean = torch.from_numpy(state.mix).float(), torch.from_numpy(state.mean).float()
    n_l, h, d = state.n_layers, state.n_heads, state.head_dim
    decode_basis = (basis * step).transpose(-1, -2).transpose(0, 1).reshape(n_l, 2 * h, d, d).contiguous()
    return LevelTables(models, build_plans(state, level, models), basis / step, mix, mean, decode_basis,
                       mix.transpose(0, 1).contiguous(), mean.transpose(0, 1).reshape(n_l, 2 * h, 1, d).contiguous())


class SharedState:
    """A fitted state and its per-level tables, shared by the codecs of every level."""

    def __init__(self, state: CacheGenState) -> None:
        self.state, self.state_id = state, state.state_id
        self.tag = int(self.state_id[:8], 16)
        self._tables: dict[int, LevelTables] = {}
        self._lock = threading.Lock()
        self.on_device: dict[tuple[int, str], Any] = {}  # per (level, device): `cachegen_region` tables

    def tables(self, level: int) -> LevelTables:
        """``level``'s tables, built on first use (thread-safe)."""
        with self._lock:
            if level not in self._tables:
                self._tables[level] = build_tables(self.state, level)
            return self._tables[level]
