"""One decoder layer of a plain Llama for one token, compiled by numba, in two calls around its attention.

Contract: `before_attention(h, weights, cos, sin, keys, values, n, eps, head_eps, queries, threads)` reads the
residual stream ``h`` ``[hidden]`` (float32) through the layer's RMS norm and q/k/v projections (per-head RMS norms
of queries and keys after them where the layer has them, ``head_eps`` theirs), applies the rotary embedding (``x ·
cos + rotate_half(x) · sin``), writes the queries ``[heads * head_dim]`` into ``queries`` and the token's key/value
row at row ``n`` of ``keys``/``values`` ``[kv_heads, room, head_dim]``. The caller attends (torch's SDPA, whose
vectorised softmax numba cannot match) and passes the heads' output to `after_attention(h, weights, attended, eps,
threads)`, which adds the output projection to ``h``, then the SiLU-gated MLP of its RMS norm. ``weights`` is the
layer's ``(input_norm, q, k, v, o, post_norm, gate, up, down)`` (norms ``[hidden]``, projections ``[out, in]``),
then the seven projections' biases in that order and the query and key norms' weights ``[head_dim]``, each empty
where the layer has none; all C-contiguous float32. These are `kvrag.model.llama_layer.run`'s sums in another order:
a relative difference of about 1e-6.

Why: a decoding step through torch runs about 30 small operations a layer, each a few microseconds of dispatch,
which on a 2-core machine added about 8 ms to SmolLM2-135M's 19 ms of weight reading a token. Here the projections
run in parallel over 64-row weight blocks (q, k and v in one parallel loop, gate and up in another, each MLP row's
activation made where its two products are) and the rest in the calling thread; ``threads`` 0 runs the same code
without a parallel region (a process forked after a parallel kernel ran must). Importing this module imports
numba; `kvrag.generation.layer_steps` decides when to call it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numba
import numpy as np

from kvrag.model.few_rows_gemm import run_on

BLOCK = 64  # weight rows per task, as in `kvrag.model.few_rows_gemm`
_FLAGS: dict[str, Any] = {"fastmath": {"reassoc", "contract"}, "cache": True, "nogil": True, "boundscheck": False}


@numba.njit(inline="always", **_FLAGS)
def _dot(w: np.ndarray, i: int, x: np.ndarray) -> np.float32:
    acc = np.float32(0.0)
    for j in range(x.shape[0]):
        acc += w[i, j] * x[j]
    return acc


@numba.njit(inline="always", **_FLAGS)
def _norm_heads(x: np.ndarray, start: int, heads: int, d: int, weight: np.ndarray, eps: float) -> None:
    """Heads ``x[start:start + heads * d]`` each RMS-normed in place and scaled by ``weight`` ``[d]``."""
    for hh in range(heads):
        base = start + hh * d
        total = np.float32(0.0)
        for i in range(d):
            total += x[base + i] * x[base + i]
        inv = np.float32(1.0) / np.float32(math.sqrt(total / np.float32(d) + np.float32(eps)))
        for i in range(d):
            x[base + i] = weight[i] * (x[base + i] * inv)


@numba.njit(inline="always", **_FLAGS)
def _rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``h`` RMS-normed and scaled by ``weight``, into a new array."""
    out = h.copy()
    _norm_heads(out, 0, 1, h.shape[0], weight, eps)
    return out


@numba.njit(inline="always", **_FLAGS)
def _bias(bias: np.ndarray, i: int) -> np.float32:
    return bias[i] if bias.shape[0] > 0 else np.float32(0.0)


@numba.njit(inline="always", **_FLAGS)
def _rotate(x: np.ndarray, start: int, heads: int, d: int, cos: np.ndarray, sin: np.ndarray) -> None:
    """Heads ``x[start:start + heads * d]`` rotated in place: ``x · cos + rotate_half(x) · sin``."""
    half = d // 2
    for hh in range(heads):
        base = start + hh * d
        for i in range(half):
            a, b = x[base + i], x[base + half + i]
            x[base + i] = a * cos[i] - b * sin[i]
            x[base + half + i] = b * cos[half + i] + a * sin[half + i]


def _attention_input_body(h: np.ndarray, weights: tuple, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                          values: np.ndarray, n: int, eps: float, head_eps: float, queries: np.ndarray) -> None:
    norm1, wq, wk, wv = weights[0], weights[1], weights[2], weights[3]
    kv_heads, d = keys.shape[0], keys.shape[2]
    nq, nk = wq.shape[0], wk.shape[0]
    x = _rms_norm(h, norm1, eps)
    qkv = np.empty(nq + 2 * nk, np.float32)
    bq, bk = (nq + BLOCK - 1) // BLOCK, (nk + BLOCK - 1) // BLOCK
    for b in numba.prange(bq + 2 * bk):
        if b < bq:
            w, bias, at, first = wq, weights[9], 0, b * BLOCK
        elif b < bq + bk:
            w, bias, at, first = wk, weights[10], nq, (b - bq) * BLOCK
        else:
            w, bias, at, first = wv, weights[11], nq + nk, (b - bq - bk) * BLOCK
        for i in range(first, min(w.shape[0], first + BLOCK)):
            qkv[at + i] = _dot(w, i, x) + _bias(bias, i)
    if weights[16].shape[0] > 0:
        _norm_heads(qkv, 0, nq // d, d, weights[16], head_eps)
        _norm_heads(qkv, nq, kv_heads, d, weights[17], head_eps)
    _rotate(qkv, 0, nq // d, d, cos, sin)
    _rotate(qkv, nq, kv_heads, d, cos, sin)
    for i in range(nq):
        queries[i] = qkv[i]
    for g in range(kv_heads):
        for i in range(d):
            keys[g, n, i] = qkv[nq + g * d + i]
            values[g, n, i] = qkv[nq + nk + g * d + i]


def _attention_output_body(h: np.ndarray, weights: tuple, attended: np.ndarray, eps: float) -> None:
    wo, norm2, wg, wu, wd = weights[4], weights[5], weights[6], weights[7], weights[8]
    hidden = h.shape[0]
    for b in numba.prange((hidden + BLOCK - 1) // BLOCK):
        for i in range(b * BLOCK, min(hidden, (b + 1) * BLOCK)):
            h[i] += _dot(wo, i, attended) + _bias(weights[12], i)
    x = _rms_norm(h, norm2, eps)
    inner = wg.shape[0]
    act = np.empty(inner, np.float32)
    for b in numba.prange((inner + BLOCK - 1) // BLOCK):
        for i in range(b * BLOCK, min(inner, (b + 1) * BLOCK)):
            gate = _dot(wg, i, x) + _bias(weights[13], i)
            act[i] = gate / (np.float32(1.0) + np.float32(math.exp(-gate))) * (_dot(wu, i, x) + _bias(weights[14], i))
    for b in numba.prange((hidden + BLOCK - 1) // BLOCK):
        for i in range(b * BLOCK, min(hidden, (b + 1) * BLOCK)):
            h[i] += _dot(wd, i, act) + _bias(weights[15], i)


attention_input = numba.njit(parallel=True, **_FLAGS)(_attention_input_body)
attention_output = numba.njit(parallel=True, **_FLAGS)(_attention_output_body)
one_thread_attention_input = numba.njit(**_FLAGS)(_attention_input_body)
one_thread_attention_output = numba.njit(**_FLAGS)(_attention_output_body)


def before_attention(h: np.ndarray, weights: tuple, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                     values: np.ndarray, n: int, eps: float, head_eps: float, queries: np.ndarray,
                     threads: int) -> None:
    """The attention's input: ``queries`` ``[heads * head_dim]`` written, the token's key/value row written at row
    ``n`` of ``keys``/``values`` ``[kv_heads, room, head_dim]``, on ``threads`` threads (0: no parallel region).
    """
    run_on(threads, attention_input, one_thread_attention_input, h, weights, cos, sin, keys, values, n, eps,
           head_eps, queries)


def after_attention(h: np.ndarray, weights: tuple, attended: np.ndarray, eps: float, threads: int) -> None:
    """The output projection of ``attended`` ``[heads * head_dim]`` and the MLP, each added to ``h``."""
    run_on(threads, attention_output, one_thread_attention_output, h, weights, attended, eps)


def compiled_here() -> bool:
    """Whether numba's cache on this machine holds the parallel kernels (False: the first call compiles them, about
    8 s on 2 cores; an unknown numba says True).
    """
    try:
        return all(os.path.exists(f._cache._cache_file._index_path) for f in (attention_input, attention_output))
    except AttributeError:
        return True
