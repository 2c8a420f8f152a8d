"""An interleaved rANS entropy coder with static, fitted distributions (numba kernels, loaded on first use).

The coder knows nothing about KV caches: it turns a sequence of symbols (each ``< 256``), cut into
*runs* that share one distribution, into a stream of 16-bit words plus ``LANES`` final states, and
back. It is built so that a GPU decoder with one thread per lane is direct:

- **Lanes.** Symbol ``i`` belongs to lane ``i % LANES`` (``LANES = 32``); every lane is an rANS
  state of 32 bits, normalised to ``[2**16, 2**32)``.
- **Distributions.** Frequencies are integers summing to ``2**PROB_BITS`` (``PROB_BITS = 12``),
  every symbol at least 1. Decoding symbol ``s`` with frequency ``f`` and cumulative start ``c``
  from state ``x``: ``slot = x & 4095``, ``s`` = the symbol whose range holds ``slot``,
  ``x = f * (x >> 12) + slot - c``.
- **Renormalisation.** After decoding a symbol, if ``x < 2**16`` the lane reads the next word:
  ``x = (x << 16) | words[p]; p += 1``. The words of all lanes form one stream in symbol order:
  within a step of ``LANES`` symbols, lanes read in increasing lane order (on a GPU: a prefix sum
  of the lanes' read flags gives each lane its word; on the host, 8 lanes at a time, the same
  prefix counts from a table). At most one word per symbol.
- **Stream.** ``u32 states[LANES]`` (the lanes' states before symbol 0) then ``u16 words[n]``. The
  encoder starts every lane at ``2**16``, so after the last symbol a correct decode leaves every
  lane at ``2**16`` with every word consumed: a built-in integrity check.

The decoder also dequantises: each symbol indexes a row of up to 4 values (a tuple of codes, as
float32) written to the segment's destination, and a row value equal to `ESCAPE` is replaced by
the next value of a side list. `decode` and `encode` are the kernels, compiled by numba in
`kvrag.codec.rans_kernels` and loaded from there the first time they are read here (numba is then imported);
`decode_reference` is a plain Python decoder of the same format, for tests and as the specification of the GPU
decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvrag.lazy import lazy_exports

if TYPE_CHECKING:
    from kvrag.codec.rans_kernels import _REFILL_OFFSETS as _REFILL_OFFSETS
    from kvrag.codec.rans_kernels import _refill as _refill
    from kvrag.codec.rans_kernels import decode as decode
    from kvrag.codec.rans_kernels import encode as encode

LANES = 32  # a multiple of 8: the decoder renormalises 8 lanes at a time
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
MAX_ALPHABET = 256
TUPLE = 4  # float32 values per symbol row (a symbol codes 1..4 values)
ESCAPE = -128  # a row value (no code is this low) that stands for "the next escaped value"
# Kernel status codes.
OK, BAD_SYMBOL, TOO_MANY_ESCAPES, BAD_STREAM = 0, 1, 2, 3
# Bit of a `decode_table` entry for a symbol with an escaped value (frequencies and starts are < 2**12).
ESCAPE_FLAG = 1 << 15


def quantise_frequencies(probs: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to ``PROB_SCALE``, each >= 1, close to ``probs`` (2..256 entries)."""
    p = np.asarray(probs, np.float64)
    if not 2 <= p.size <= MAX_ALPHABET or not (np.isfinite(p).all() and (p >= 0).all() and p.sum() > 0):
        raise ValueError(f"rans: invalid distribution of {p.size} probabilities")
    freq = np.maximum(1, np.round(p / p.sum() * PROB_SCALE)).astype(np.int64)
    while freq.sum() != PROB_SCALE:  # fix the rounding on the symbols that lose the least
        excess = int(freq.sum() - PROB_SCALE)
        order = np.argsort(-freq) if excess > 0 else np.argsort(-p)
        for s in order[: abs(excess)]:
            if excess < 0 or freq[s] > 1:
                freq[s] -= np.sign(excess)
    return freq.astype(np.uint32)


def decode_table(freq: np.ndarray, escape: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(u8 [PROB_SCALE]`` symbol of every slot, ``u32 [MAX_ALPHABET]`` ``freq << 16 | flag | start)``.

    ``flag`` is `ESCAPE_FLAG` for the symbols where ``escape`` (bool, one per symbol) is set: those
    whose row may hold `ESCAPE` (`decode` looks for escapes only in steps that decoded one).
    """
    sym = np.repeat(np.arange(freq.size), freq.astype(np.int64)).astype(np.uint8)
    info = np.zeros(MAX_ALPHABET, np.uint32)
    info[: freq.size] = (freq.astype(np.uint32) << np.uint32(16)) | starts(freq)
    if escape is not None:
        info[np.flatnonzero(escape)] |= np.uint32(ESCAPE_FLAG)
    return sym, info


def starts(freq: np.ndarray) -> np.ndarray:
    """Cumulative starts of ``freq`` (u32)."""
    return np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint32)


def decode_reference(words: np.ndarray, states: np.ndarray, segments: list[tuple[int, int, int]],
                     freqs: list[np.ndarray], rows: np.ndarray) -> list[np.ndarray]:
    """Plain-Python decoder (slow; the format's specification).

    Returns, per segment ``(n, k, dist)``, its symbols' row values ``[n]`` (escapes left as
    `ESCAPE`); ``freqs[d]`` are the frequencies of distribution ``d``, ``words`` has no padding.
    """
    x, p, i, out = [int(s) for s in states], 0, 0, []
    for n, k, dist in segments:
        values: list[float] = []
        for part, count in ((0, n // k), (1, n - (n // k) * k)):
            f = freqs[dist + part].astype(np.int64)
            cum = np.concatenate([[0], np.cumsum(f)])
            for _ in range(count):
                lane, slot = i % LANES, x[i % LANES] & (PROB_SCALE - 1)
                s = int(np.searchsorted(cum, slot, side="right") - 1)
                x[lane] = int(f[s]) * (x[lane] >> PROB_BITS) + slot - int(cum[s])
                if x[lane] < RANS_L:
                    x[lane] = (x[lane] << 16) | int(words[p])
                    p += 1
                values += [float(v) for v in rows[dist + part][s * TUPLE : s * TUPLE + (k if part == 0 else 1)]]
                i += 1
        out.append(np.asarray(values, np.float32))
    if p != len(words) or any(v != RANS_L for v in x):
        raise ValueError("rans: stream does not end cleanly")
    return out


# the compiled kernels load with numba on first use (`kvrag.codec.rans_kernels`)
__getattr__ = lazy_exports(__name__, dict.fromkeys(("encode", "decode", "_refill", "_REFILL_OFFSETS"),
                                                   "kvrag.codec.rans_kernels"))
