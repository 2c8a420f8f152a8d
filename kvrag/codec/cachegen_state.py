"""The fitted state of the ``cachegen`` codec: transforms and symbol distributions, fitted once per
index on sample chunk caches and persisted as JSON + NPZ (no pickle).

Per layer and per kind (K or V), on channels ``c = head * head_dim + dim``:

- ``mean`` ``[2, L, C]`` — the channel means (the shared "anchor" every token is coded against);
- ``basis`` ``[2, L, n_blocks, b, b]`` — an orthonormal KLT (PCA) basis per block of ``b`` channels
  (whole heads, ``b <= MAX_BLOCK``), columns sorted by decreasing variance;
- ``scale`` ``[2, L]`` — the RMS of the centred channels; quantisation steps are multiples of it;
- ``sigma`` ``[2, L, C]`` — the standard deviation of each KLT component (block-major order).

Per quality level, the components of each block are cut into *segments* by their ``sigma / step``
band; each segment has a clamp radius ``E``, a tuple width ``k`` and a fitted probability table over
``2E + 2`` symbols (values ``-E..E`` and an escape). Segments are stored as rows of an int32 table
``(kind, layer, block, start, stop, E, k)`` and their tables back to back in a float32 array.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrag.atomic import atomic_write_bytes, atomic_write_json, read_json

STATE_FORMAT = 1
MAX_BLOCK = 256  # channels per KLT block: the decode matmul costs 2 * block flops per element
MAX_FIT_TOKENS = 65536  # tokens per (layer, kind) used for fitting; more samples are subsampled
MAX_TUPLE_ALPHABET = 4096  # k elements share one entropy-coder symbol while (2E+2)**k <= this
ESCAPE_RATE = 1e-3  # the clamp radius E leaves at most this fraction of a segment's codes escaped
MAX_RADIUS = 127
# Bands of sigma/step: components whose spread is within one band share a symbol distribution.
BANDS = (16.0, 8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0)
_JSON, _NPZ = "cachegen.json", "cachegen.npz"


@dataclass
class LevelModel:
    """One level's segments ``[n, 7]`` (kind, layer, block, start, stop, E, k) and probability tables."""

    segments: np.ndarray
    probs: np.ndarray  # float32, the segments' tables back to back (2E + 2 entries each)


@dataclass
class CacheGenState:
    """Everything `CacheGenCodec` needs besides its level; immutable once fitted or loaded."""

    n_layers: int
    n_heads: int
    head_dim: int
    heads_per_block: int
    steps: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]
    mean: np.ndarray
    basis: np.ndarray
    scale: np.ndarray
    sigma: np.ndarray
    levels: dict[int, LevelModel] = field(default_factory=dict)

    @property
    def block(self) -> int:
        return self.heads_per_block * self.head_dim

    @property
    def state_id(self) -> str:
        """A content hash of the state: blobs record it, and decoding checks it."""
        h = hashlib.sha256(json.dumps(self._meta(), sort_keys=True).encode())
        for name, array in self._arrays().items():
            h.update(f"{name}{array.dtype.str}{array.shape}".encode())
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()[:16]

    def _meta(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "codec": "cachegen", "n_layers": self.n_layers,
                "n_heads": self.n_heads, "head_dim": self.head_dim,
                "heads_per_block": self.heads_per_block,
                "steps": {str(k): [list(v[0]), list(v[1])] for k, v in sorted(self.steps.items())}}

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"mean": self.mean, "basis": self.basis, "scale": self.scale, "sigma": self.sigma}
        for level, model in sorted(self.levels.items()):
            arrays[f"segments_{level}"] = model.segments
            arrays[f"probs_{level}"] = model.probs
        return arrays

    def save(self, directory: Path) -> None:
        """Write ``cachegen.npz`` then ``cachegen.json`` (which names the state id) atomically."""
        import io

        directory.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez(buf, **self._arrays())  # type: ignore[arg-type]  # numeric arrays only: no pickle
        atomic_write_bytes(directory / _NPZ, buf.getvalue())
        atomic_write_json(directory / _JSON, {**self._meta(), "state_id": self.state_id})

    @classmethod
    def load(cls, directory: Path) -> CacheGenState:
        """Read a state written by `save`; ValueError when files are missing, malformed or mismatched."""
        try:
            meta = read_json(directory / _JSON)
            with np.load(directory / _NPZ, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read cachegen codec state in {directory}: {exc}") from None
        if meta.get("format") != STATE_FORMAT or meta.get("codec") != "cachegen":
            raise ValueError(f"{directory / _JSON}: not a cachegen state of format {STATE_FORMAT}")
        try:
            steps = {int(k): (tuple(v[0]), tuple(v[1])) for k, v in meta["steps"].items()}
            levels = {lv: LevelModel(arrays[f"segments_{lv}"].astype(np.int32),
                                     arrays[f"probs_{lv}"].astype(np.float32)) for lv in steps}
            state = cls(int(meta["n_layers"]), int(meta["n_heads"]), int(meta["head_dim"]),
                        int(meta["heads_per_block"]), steps, arrays["mean"], arrays["basis"],
                        arrays["scale"], arrays["sigma"], levels)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed cachegen state in {directory}: {exc}") from None
        if state.state_id != meta.get("state_id"):
            raise ValueError(f"cachegen state in {directory} does not match its recorded state id")
        state.validate()
        return state

    def validate(self) -> None:
        """Check array shapes and probability tables; ValueError naming what is wrong."""
        n_l, c, b = self.n_layers, self.n_heads * self.head_dim, self.block
        expected = {"mean": (2, n_l, c), "scale": (2, n_l), "sigma": (2, n_l, c),
                    "basis": (2, n_l, c // b if b and c % b == 0 else -1, b, b)}
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"cachegen state: {name} is {getattr(self, name).shape}, expected {shape}")
        for level, model in self.levels.items():
            if model.segments.ndim != 2 or model.segments.shape[1] != 7:
                raise ValueError(f"cachegen state: level {level} segment table is {model.segments.shape}")
            if not (np.isfinite(model.probs).all() and (model.probs > 0).all()):
                raise ValueError(f"cachegen state: level {level} has invalid probabilities")


def layer_group(layer: int, n_layers: int) -> int:
    """Which third of the layers ``layer`` is in (0 early, 1 middle, 2 late): steps grow with it."""
    return min(2, 3 * layer // n_layers)


def _heads_per_block(n_heads: int, head_dim: int) -> int:
    return max([d for d in range(1, n_heads + 1) if n_heads % d == 0 and d * head_dim <= MAX_BLOCK] or [1])


def _token_rows(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Per sample, the token indices used for fitting: every token, or an even subsample of all."""
    lengths = np.array([s[0].shape[2] for s in samples])
    keep = np.arange(lengths.sum())
    if keep.size > MAX_FIT_TOKENS:
        keep = np.linspace(0, keep.size - 1, MAX_FIT_TOKENS).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    rows = []
    for i in range(len(samples)):
        tokens = keep[(keep >= starts[i]) & (keep < starts[i + 1])] - starts[i]
        if tokens.size:
            rows.append((i, torch.from_numpy(tokens)))
    return rows


def _gather(samples: list[tuple[torch.Tensor, torch.Tensor]], kind: int, layer: int,
            rows: list[tuple[int, torch.Tensor]], out: np.ndarray) -> np.ndarray:
    """The fitting tokens of one (kind, layer) written into ``out`` ``[N, C]`` float32."""
    row = 0
    for i, tokens in rows:
        x = samples[i][kind][layer].detach().to("cpu", torch.float32)  # [H, S, D]
        if tokens.numel() < x.shape[1]:
            x = x[:, tokens]
        n = x.shape[1]
        out[row : row + n].reshape(n, x.shape[0], x.shape[2])[:] = x.numpy().transpose(1, 0, 2)
        row += n
    if not np.isfinite(out).all():
        raise ValueError(f"cachegen fit: non-finite values in the samples (layer {layer})")
    return out


def _klt(centred: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of channels: basis ``[n_blocks, b, b]`` and component variances ``[C]``."""
    bases, variances = [], []
    for start in range(0, centred.shape[1], block):
        xb = centred[:, start : start + block]
        cov = (xb.T @ xb).astype(np.float64) / max(1, xb.shape[0])
        ev, vec = np.linalg.eigh(cov)
        ev, vec = ev[::-1], vec[:, ::-1]
        # Fix each column's sign (largest entry positive) so that the basis is reproducible.
        signs = np.sign(vec[np.abs(vec).argmax(axis=0), np.arange(vec.shape[1])])
        bases.append(vec * np.where(signs == 0, 1.0, signs))
        variances.append(np.maximum(ev, 0.0))
    return np.stack(bases), np.concatenate(variances)


def _segment_rows(sigma_over_step: np.ndarray, block: int) -> list[tuple[int, int, int]]:
    """(block, start, stop) of the contiguous component ranges that fall into one band."""
    rows = []
    for b, start in enumerate(range(0, len(sigma_over_step), block)):
        band = np.searchsorted(-np.asarray(BANDS), -sigma_over_step[start : start + block], side="left")
        cuts = [0, *np.flatnonzero(np.diff(band)) + 1, len(band)]
        rows += [(b, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]
    return rows


def _symbol_table(codes: np.ndarray) -> tuple[int, int, np.ndarray]:
    """Clamp radius E, tuple width k and the fitted probabilities over ``-E..E`` and escape."""
    flat = codes.ravel().astype(np.int64)
    mags = np.bincount(np.minimum(np.abs(flat), MAX_RADIUS + 1), minlength=MAX_RADIUS + 2)
    tail = 1.0 - np.cumsum(mags) / max(1, flat.size)  # tail[e] = P(|code| > e)
    radius = int(np.clip(np.argmax(tail <= ESCAPE_RATE), 1, MAX_RADIUS))
    alphabet = 2 * radius + 2
    width = max(1, int(np.floor(np.log(MAX_TUPLE_ALPHABET) / np.log(alphabet) + 1e-9)))
    symbols = np.where(np.abs(flat) > radius, alphabet - 1, flat + radius)
    counts = np.bincount(symbols, minlength=alphabet).astype(np.float64) + 0.5
    return radius, width, (counts / counts.sum()).astype(np.float32)


def fit_state(
    samples: list[tuple[torch.Tensor, torch.Tensor]], n_layers: int,
    steps: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]],
) -> CacheGenState:
    """Fit means, KLT bases and per-level symbol tables on ``samples`` (each ``[L, H, S, D]`` K, V)."""
    if not samples:
        raise ValueError("cachegen fit needs at least one sample chunk")
    shape = tuple(samples[0][0].shape)
    for keys, values in samples:
        if tuple(keys.shape[:2]) + tuple(keys.shape[3:]) != shape[:2] + shape[3:] or keys.shape != values.shape:
            raise ValueError(f"cachegen fit: sample shapes {tuple(keys.shape)}/{tuple(values.shape)} "
                             f"disagree with {shape}")
    if len(shape) != 4 or shape[0] != n_layers:
        raise ValueError(f"cachegen fit: samples are {shape}, expected [n_layers={n_layers}, H, S, D]")
    _, n_heads, _, head_dim = shape
    hpb = _heads_per_block(n_heads, head_dim)
    block, channels = hpb * head_dim, n_heads * head_dim
    mean = np.zeros((2, n_layers, channels), np.float32)
    basis = np.zeros((2, n_layers, n_heads // hpb, block, block), np.float32)
    scale, sigma = np.ones((2, n_layers), np.float32), np.zeros((2, n_layers, channels), np.float32)
    seg_rows: dict[int, list[list[int]]] = {lv: [] for lv in steps}
    tables: dict[int, list[np.ndarray]] = {lv: [] for lv in steps}
    rows = _token_rows(samples)
    n_tokens = sum(int(t.numel()) for _, t in rows)
    for kind in (0, 1):
        x = np.empty((n_tokens, channels), np.float32)  # reused across layers
        for layer in range(n_layers):
            _gather(samples, kind, layer, rows, x)
            mean[kind, layer] = x.mean(axis=0, dtype=np.float64)
            x -= mean[kind, layer]
            basis[kind, layer], var = _klt(x, block)
            rms = float(np.sqrt(var.mean()))
            scale[kind, layer] = rms if rms > 1e-12 else 1.0
            sigma[kind, layer] = np.sqrt(var)
            # [C, N] block-major components, so that a segment's codes are contiguous rows.
            coeffs = np.concatenate([basis[kind, layer, b].T @ x[:, b * block : (b + 1) * block].T
                                     for b in range(basis.shape[2])])
            for level, per_kind in steps.items():
                step = per_kind[kind][layer_group(layer, n_layers)] * float(scale[kind, layer])
                codes = np.rint(coeffs / step)
                for b, lo, hi in _segment_rows(sigma[kind, layer] / step, block):
                    radius, width, probs = _symbol_table(codes[b * block + lo : b * block + hi])
                    seg_rows[level].append([kind, layer, b, lo, hi, radius, width])
                    tables[level].append(probs)
    levels = {lv: LevelModel(np.asarray(seg_rows[lv], np.int32).reshape(-1, 7),
                             np.concatenate(tables[lv]).astype(np.float32)) for lv in steps}
    return CacheGenState(n_layers, n_heads, head_dim, hpb, dict(steps), mean, basis, scale, sigma, levels)
