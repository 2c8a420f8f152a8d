"""`layer_symbols`, compiled by numba: a ``cachegen`` layer's integer codes to the symbols its rANS coder writes.

Contract: the symbol order is `kvrag.codec.cachegen_format`'s (its docstring), which exports `layer_symbols` lazily;
it lives apart so that importing the format, as opening an index does, does not import numba (about 50 MB resident).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, boundscheck=False)
def layer_symbols(keys: np.ndarray, values: np.ndarray, kind: np.ndarray, col0: np.ndarray, width: np.ndarray,
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
