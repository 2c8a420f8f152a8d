"""The fitted state of the ``cachegen`` codec: transforms and symbol distributions, fitted once per
index on sample chunk caches and persisted as JSON + NPZ (no pickle).

Per layer and per kind (K or V), on channels ``c = head * head_dim + dim`` (``C`` channels):

- ``mean`` ``[2, L, C]`` — the channel means (the shared "anchor" every token is coded against);
- ``basis`` ``[2, L, H, D, D]`` — an orthonormal KLT (PCA) basis per head, columns sorted by
  decreasing variance (per head, so that decoding costs ``2 * head_dim`` flops per element);
- ``mix`` ``[2, L, H*m, H*m]`` — a second KLT over the first ``m = mix_dims`` components of every
  head (the strong ones, where heads correlate), columns sorted by decreasing variance;
- ``scale`` ``[2, L]`` — the RMS of the centred channels; quantisation steps are multiples of it;
- ``sigma`` ``[2, L, C]`` — the standard deviation of each *coded column*.

Coded columns, per token: ``[mix (H*m) | head 0 components m..D-1 | head 1 ... | head H-1 ...]``.
Per quality level, the columns are cut into *segments* (contiguous columns of one group in one
``sigma / step`` band): rows ``(kind, layer, col0, col1, band)`` of an int32 table. Each
(kind, band) has one distribution shared by all layers, fitted on every layer's codes in that band:
clamp radius ``E`` (``radius[kind, band]``) and probabilities over ``2E + 2`` symbols (values
``-E..E`` then the escape) in ``probs[kind, band, :2E+2]``.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrag.atomic_files import atomic_write_bytes, atomic_write_json, read_json

STATE_FORMAT = 2
MIX_DIMS = 16  # strong components per head that a second, cross-head KLT decorrelates
MAX_FIT_TOKENS = 65536  # tokens per (layer, kind) used for fitting; more samples are subsampled
ESCAPE_RATE = 1e-3  # the clamp radius E leaves at most this fraction of a band's codes escaped
MAX_RADIUS = 127
# Bands of sigma/step (a factor sqrt(2) apart): columns whose spread is within one band share a
# symbol distribution across layers.
BANDS = tuple(2.0 ** (e / 2) for e in range(10, -9, -1)) + (0.0,)
N_BANDS = len(BANDS)
_JSON, _NPZ = "cachegen.json", "cachegen.npz"


@dataclass
class LevelModel:
    """One level's segments ``[n, 5]`` (kind, layer, col0, col1, band) and band distributions."""

    segments: np.ndarray
    radius: np.ndarray  # int32 [2, N_BANDS]
    probs: np.ndarray  # float32 [2, N_BANDS, 2 * MAX_RADIUS + 2]


@dataclass
class CacheGenState:
    """Everything `CacheGenCodec` needs besides its level; immutable once fitted or loaded."""

    n_layers: int
    n_heads: int
    head_dim: int
    mix_dims: int
    steps: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]]
    mean: np.ndarray
    basis: np.ndarray
    mix: np.ndarray
    scale: np.ndarray
    sigma: np.ndarray
    levels: dict[int, LevelModel] = field(default_factory=dict)

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
                "n_heads": self.n_heads, "head_dim": self.head_dim, "mix_dims": self.mix_dims,
                "steps": {str(k): [list(v[0]), list(v[1])] for k, v in sorted(self.steps.items())}}

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays = {"mean": self.mean, "basis": self.basis, "mix": self.mix, "scale": self.scale,
                  "sigma": self.sigma}
        for level, model in sorted(self.levels.items()):
            arrays[f"segments_{level}"] = model.segments
            arrays[f"radius_{level}"] = model.radius
            arrays[f"probs_{level}"] = model.probs
        return arrays

    def save(self, directory: Path) -> None:
        """Write ``cachegen.npz`` then ``cachegen.json`` (which names the state id) atomically."""
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
        except Exception as exc:  # a damaged file fails in many ways (BadZipFile, struct.error...): all are damage
            raise ValueError(f"cannot read cachegen codec state in {directory}: {exc}") from None
        if meta.get("format") != STATE_FORMAT or meta.get("codec") != "cachegen":
            raise ValueError(f"{directory / _JSON}: not a cachegen state of format {STATE_FORMAT} "
                             f"(format {meta.get('format')}); rebuild the index's codec state")
        try:
            steps = {int(k): (tuple(v[0]), tuple(v[1])) for k, v in meta["steps"].items()}
            levels = {lv: LevelModel(arrays[f"segments_{lv}"].astype(np.int32),
                                     arrays[f"radius_{lv}"].astype(np.int32),
                                     arrays[f"probs_{lv}"].astype(np.float32)) for lv in steps}
            state = cls(int(meta["n_layers"]), int(meta["n_heads"]), int(meta["head_dim"]),
                        int(meta["mix_dims"]), steps, arrays["mean"], arrays["basis"], arrays["mix"],
                        arrays["scale"], arrays["sigma"], levels)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed cachegen state in {directory}: {exc}") from None
        if state.state_id != meta.get("state_id"):
            raise ValueError(f"cachegen state in {directory} does not match its recorded state id")
        state.validate()
        return state

    def validate(self) -> None:
        """Check array shapes and probability tables; ValueError naming what is wrong."""
        n_l, h, d, m = self.n_layers, self.n_heads, self.head_dim, self.mix_dims
        if not (n_l > 0 and h > 0 and d > 0 and 0 <= m <= d):
            raise ValueError(f"cachegen state: invalid dimensions L={n_l} H={h} D={d} mix_dims={m}")
        expected = {"mean": (2, n_l, h * d), "scale": (2, n_l), "sigma": (2, n_l, h * d),
                    "basis": (2, n_l, h, d, d), "mix": (2, n_l, h * m, h * m)}
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"cachegen state: {name} is {getattr(self, name).shape}, expected {shape}")
        for level, model in self.levels.items():
            if model.segments.ndim != 2 or model.segments.shape[1] != 5:
                raise ValueError(f"cachegen state: level {level} segment table is {model.segments.shape}")
            if model.radius.shape != (2, N_BANDS) or model.probs.shape != (2, N_BANDS, 2 * MAX_RADIUS + 2):
                raise ValueError(f"cachegen state: level {level} distributions have the wrong shape")
            if not ((model.radius >= 1) & (model.radius <= MAX_RADIUS)).all():
                raise ValueError(f"cachegen state: level {level} has a radius outside 1..{MAX_RADIUS}")
            if not (np.isfinite(model.probs).all() and (model.probs >= 0).all()):
                raise ValueError(f"cachegen state: level {level} has invalid probabilities")

    def groups(self) -> list[tuple[int, int]]:
        """Coded column ranges ``(start, stop)`` of the groups: the mix, then each head's rest."""
        hm, rest = self.n_heads * self.mix_dims, self.head_dim - self.mix_dims
        mix = [(0, hm)] if hm else []
        return mix + [(hm + h * rest, hm + (h + 1) * rest) for h in range(self.n_heads) if rest]


def layer_group(layer: int, n_layers: int) -> int:
    """Which third of the layers ``layer`` is in (0 early, 1 middle, 2 late): steps grow with it."""
    return min(2, 3 * layer // n_layers)


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


def _klt(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal basis ``[n, n]`` (columns by decreasing variance) and variances ``[n]`` of ``x`` ``[N, n]``."""
    cov = (x.T.astype(np.float64) @ x.astype(np.float64)) / max(1, x.shape[0])
    ev, vec = np.linalg.eigh(cov)
    ev, vec = ev[::-1], vec[:, ::-1]
    # Fix each column's sign (largest entry positive) so that the basis is reproducible.
    signs = np.sign(vec[np.abs(vec).argmax(axis=0), np.arange(vec.shape[1])])
    return vec * np.where(signs == 0, 1.0, signs), np.maximum(ev, 0.0)


def coded_columns(x: np.ndarray, basis: np.ndarray, mix: np.ndarray, mix_dims: int) -> np.ndarray:
    """Centred rows ``[N, C]`` → coded columns ``[N, C]`` (see the module docstring)."""
    n, h, d = x.shape[0], basis.shape[0], basis.shape[1]
    comps = np.einsum("nhd,hde->nhe", x.reshape(n, h, d), basis)  # [N, H, D] per-head KLT
    top = comps[:, :, :mix_dims].reshape(n, h * mix_dims) @ mix
    return np.concatenate([top, comps[:, :, mix_dims:].reshape(n, h * (d - mix_dims))], axis=1)


def _segment_rows(sigma_over_step: np.ndarray, groups: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(col0, col1, band) of the contiguous column ranges of one group that fall into one band."""
    rows = []
    for g0, g1 in groups:
        band = np.searchsorted(-np.asarray(BANDS), -sigma_over_step[g0:g1], side="left")
        cuts = [0, *np.flatnonzero(np.diff(band)) + 1, g1 - g0]
        rows += [(g0 + lo, g0 + hi, int(band[lo])) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]
    return rows


def _distribution(hist: np.ndarray) -> tuple[int, np.ndarray]:
    """Radius E and probabilities over ``-E..E`` and escape from a histogram of codes ``-R-1..R+1``."""
    total = max(1.0, float(hist.sum()))
    centre = MAX_RADIUS + 1
    mags = hist[centre:].copy()
    mags[1:] += hist[:centre][::-1]
    tail = 1.0 - np.cumsum(mags) / total  # tail[e] = P(|code| > e)
    radius = int(np.clip(np.argmax(tail <= ESCAPE_RATE), 1, MAX_RADIUS))
    counts = np.concatenate([hist[centre - radius : centre + radius + 1],
                             [hist.sum() - hist[centre - radius : centre + radius + 1].sum()]]) + 0.5
    probs = np.zeros(2 * MAX_RADIUS + 2, np.float32)
    probs[: 2 * radius + 2] = counts / counts.sum()
    return radius, probs


def fit_state(
    samples: list[tuple[torch.Tensor, torch.Tensor]], n_layers: int,
    steps: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]], mix_dims: int = MIX_DIMS,
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
    m, channels = min(mix_dims, head_dim), n_heads * head_dim
    mean = np.zeros((2, n_layers, channels), np.float32)
    basis = np.zeros((2, n_layers, n_heads, head_dim, head_dim), np.float32)
    mix = np.zeros((2, n_layers, n_heads * m, n_heads * m), np.float32)
    scale, sigma = np.ones((2, n_layers), np.float32), np.zeros((2, n_layers, channels), np.float32)
    seg_rows: dict[int, list[list[int]]] = {lv: [] for lv in steps}
    hists = {lv: np.zeros((2, N_BANDS, 2 * MAX_RADIUS + 3), np.float64) for lv in steps}
    rows = _token_rows(samples)
    n_tokens = sum(int(t.numel()) for _, t in rows)
    groups = CacheGenState(n_layers, n_heads, head_dim, m, {}, mean, basis, mix, scale, sigma).groups()
    for kind in (0, 1):
        x = np.empty((n_tokens, channels), np.float32)  # reused across layers
        for layer in range(n_layers):
            _gather(samples, kind, layer, rows, x)
            mean[kind, layer] = x.mean(axis=0, dtype=np.float64)
            x -= mean[kind, layer]
            for h in range(n_heads):
                basis[kind, layer, h] = _klt(x[:, h * head_dim : (h + 1) * head_dim])[0]
            identity = np.eye(n_heads * m, dtype=np.float32)
            top = coded_columns(x, basis[kind, layer], identity, m)[:, : n_heads * m]
            mix[kind, layer] = _klt(top)[0] if m else identity
            coeffs = coded_columns(x, basis[kind, layer], mix[kind, layer], m)  # [N, C]
            var = (coeffs.astype(np.float64) ** 2).mean(axis=0)
            rms = float(np.sqrt(var.mean()))
            scale[kind, layer] = rms if rms > 1e-12 else 1.0
            sigma[kind, layer] = np.sqrt(var)
            for level, per_kind in steps.items():
                step = per_kind[kind][layer_group(layer, n_layers)] * float(scale[kind, layer])
                codes = np.clip(np.rint(coeffs / step), -MAX_RADIUS - 1, MAX_RADIUS + 1).astype(np.int64)
                for col0, col1, band in _segment_rows(sigma[kind, layer] / step, groups):
                    seg_rows[level].append([kind, layer, col0, col1, band])
                    hists[level][kind, band] += np.bincount(codes[:, col0:col1].ravel() + MAX_RADIUS + 1,
                                                            minlength=2 * MAX_RADIUS + 3)
    levels = {}
    for lv in steps:
        radius = np.ones((2, N_BANDS), np.int32)
        probs = np.zeros((2, N_BANDS, 2 * MAX_RADIUS + 2), np.float32)
        for kind in (0, 1):
            for band in range(N_BANDS):
                radius[kind, band], probs[kind, band] = _distribution(hists[lv][kind, band])
        levels[lv] = LevelModel(np.asarray(seg_rows[lv], np.int32).reshape(-1, 5), radius, probs)
    return CacheGenState(n_layers, n_heads, head_dim, m, dict(steps), mean, basis, mix, scale, sigma, levels)
