"""The Triton kernel of `kvrag.kernels.rans_decode`: one program decodes one rANS stream, 32 lanes side by side.

Contract: `kernel()` is the jitted kernel (an interpreted function when ``TRITON_INTERPRET=1`` was set before triton's
import, as the tests set it), `interpreted()` says which. The launch, its arguments and the streams' layout are
`kvrag.kernels.rans_decode`'s, which imports this module only when a decode runs on the kernel: importing triton
takes about 0.2 s, which no answer without a GPU should pay.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def _decode(states_ptr, halves_ptr, meta_ptr, runs_ptr, slot_ptr, freq_ptr, start_ptr, rows_ptr, esc_cnt_ptr,
            out_ptr, status_ptr, T, MAX_RUNS: tl.constexpr, N_LANES: tl.constexpr, N_META: tl.constexpr,
            N_RUN: tl.constexpr):
    b = tl.program_id(0)
    m = meta_ptr + b * N_META
    states_off, esc_off, n_esc = tl.load(m), tl.load(m + 1), tl.load(m + 2)
    words_off, n_words, n_sym = tl.load(m + 3), tl.load(m + 4), tl.load(m + 5)
    cur, run_end, col, seq = tl.load(m + 6), tl.load(m + 7), tl.load(m + 8), tl.load(m + 9)
    lanes = tl.arange(0, N_LANES)
    x = tl.load(states_ptr + states_off + lanes).to(tl.uint32, bitcast=True)
    p = tl.full([], 0, tl.int32)
    used = tl.full([], 0, tl.int32)
    for t in range(0, (n_sym + N_LANES - 1) // N_LANES):
        i = t * N_LANES + lanes
        active = i < n_sym
        # the run of each lane's symbol, and the run that holds the next step's first symbol
        r = tl.zeros([N_LANES], tl.int32) + cur
        nxt = cur
        for j in tl.static_range(1, MAX_RUNS):
            first = tl.load(runs_ptr + (cur + j) * N_RUN, mask=cur + j < run_end, other=2147483647)
            r += (first <= i).to(tl.int32)
            nxt += (first <= (t + 1) * N_LANES).to(tl.int32)
        run = runs_ptr + r * N_RUN
        run_first = tl.load(run, mask=active, other=0)
        dist = tl.load(run + 1, mask=active, other=0)
        k = tl.load(run + 2, mask=active, other=0)
        row = tl.load(run + 3, mask=active, other=0)
        code0 = tl.load(run + 4, mask=active, other=0)
        # rANS: slot -> symbol -> next state
        slot = x & 4095
        sym = tl.load(slot_ptr + dist * 4096 + slot.to(tl.int32), mask=active, other=0).to(tl.int32)
        f = tl.load(freq_ptr + dist * 256 + sym, mask=active, other=1).to(tl.uint32)
        c = tl.load(start_ptr + dist * 256 + sym, mask=active, other=0).to(tl.uint32)
        x = tl.where(active, f * (x >> 12) + slot - c, x)
        # the symbol's values; escaped ones are taken from the list in lane order
        n_e = tl.load(esc_cnt_ptr + dist * 256 + sym, mask=active, other=0)
        before = used + tl.cumsum(n_e, 0) - n_e
        code = code0 + (i - run_first) * k
        for q in tl.static_range(4):
            live = active & (q < k)
            v = tl.load(rows_ptr + dist * 1024 + sym * 4 + q, mask=live, other=0.0)
            escaped = live & (v == -128.0)
            e = tl.load(halves_ptr + esc_off + before, mask=escaped & (before < n_esc), other=0)
            v = tl.where(escaped, e.to(tl.float32), v)
            before += escaped.to(tl.int32)
            column = (code + q) // seq
            dest = (row + column).to(tl.int64) * T + col + (code + q - column * seq)
            tl.store(out_ptr + dest, v, mask=live)
        used += tl.sum(n_e, 0)
        # renormalise: the lanes below 2**16 read the next words in lane order
        low = (x >> 16) == 0  # below 2**16 (a shift: no signed compare of states >= 2**31)
        need = low.to(tl.int32)
        at = p + tl.cumsum(need, 0) - need
        word = tl.load(halves_ptr + words_off + at, mask=low & (at < n_words), other=0)
        word = (word.to(tl.int32) & 65535).to(tl.uint32)
        x = tl.where(low, (x << 16) | word, x)
        p += tl.sum(need, 0)
        cur = nxt
    clean = (p == n_words) & (used == n_esc) & (tl.sum((x != 65536).to(tl.int32), 0) == 0)
    status = tl.where(used > n_esc, 2, tl.where(clean, 0, 3))
    tl.store(status_ptr + b, status)


@functools.cache
def kernel() -> Any:
    """The kernel, jitted once."""
    return triton.jit(_decode)


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (on CPU tensors)."""
    return isinstance(kernel(), InterpretedFunction)
