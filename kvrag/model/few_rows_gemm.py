"""`few_rows_times_weight`, compiled by numba: ``x @ weight.T`` for a few rows of float32 on the CPU's cores.

Contract: ``out[r, i] = sum_j x[r, j] * weight[i, j]`` for ``x`` ``[m, k]``, ``weight`` ``[n, k]`` (both C-contiguous
float32) into ``out`` ``[m, n]``. The weight's rows are split in blocks of `BLOCK` over numba's threads; each output
is one dot product, summed in an order fixed by ``k`` alone (vectorised, reassociated once at compile time), so a
row's result does not depend on ``m``, on the other rows or on the thread that computed it. Decoding reads every
weight once per token: this reads it at the memory's speed (about 2x torch's single-row ``F.linear`` on a 2-core
AVX-512 machine, which runs it on one core). `kvrag.model.cpu_linear` decides when to call it; importing this
module imports numba, and the first call of a process loads the compiled kernel from numba's cache (compiling it
once per machine). `multiply` is the call: it sets numba's thread count for the calling thread first, or runs the
same loops compiled without threads (`one_thread`: the same numbers, bit for bit, checked in the tests), which a
process forked after a parallel kernel ran must use (numba's OpenMP layer ends a child that launches one).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

BLOCK = 64  # weight rows per task: 64 rows of a 576-wide weight are 147 KB, a few tasks per core for every layer


_FLAGS: dict[str, Any] = {"fastmath": {"reassoc", "contract"}, "cache": True, "nogil": True, "boundscheck": False}


@numba.njit(inline="always", **_FLAGS)
def _block(x: np.ndarray, weight: np.ndarray, out: np.ndarray, block: int) -> None:
    """Rows ``[block * BLOCK, (block + 1) * BLOCK)`` of ``weight``: their dot products with every row of ``x``."""
    m, k = x.shape
    for i in range(block * BLOCK, min(weight.shape[0], (block + 1) * BLOCK)):
        for r in range(m):
            acc = np.float32(0.0)
            for j in range(k):
                acc += x[r, j] * weight[i, j]
            out[r, i] = acc


@numba.njit(parallel=True, **_FLAGS)
def few_rows_times_weight(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ weight.T`` (see the module docstring), the blocks over numba's threads."""
    for block in numba.prange((weight.shape[0] + BLOCK - 1) // BLOCK):
        _block(x, weight, out, block)


@numba.njit(**_FLAGS)
def one_thread(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """`few_rows_times_weight` in the calling thread, no parallel region: the same numbers."""
    for block in range((weight.shape[0] + BLOCK - 1) // BLOCK):
        _block(x, weight, out, block)


def multiply(x: np.ndarray, weight: np.ndarray, out: np.ndarray, threads: int) -> None:
    """`few_rows_times_weight` on ``threads`` threads; 0 threads: `one_thread` (`run_on`)."""
    run_on(threads, few_rows_times_weight, one_thread, x, weight, out)


def run_on(threads: int, parallel: Any, serial: Any, *args: Any) -> None:
    """``parallel(*args)`` on ``threads`` threads (at most numba's own limit, ``NUMBA_NUM_THREADS``); 0 threads:
    ``serial(*args)``, the same loops compiled without a parallel region.
    """
    if threads == 0:
        serial(*args)
        return
    limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # (set by numba at import)
    numba.set_num_threads(max(1, min(threads, limit)))
    parallel(*args)


def threading_layer() -> str:
    """The threading layer numba chose for this process (known once a parallel kernel ran)."""
    return str(numba.threading_layer())
