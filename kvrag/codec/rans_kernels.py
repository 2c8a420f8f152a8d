"""The rANS coder's compiled kernels (numba): `encode`, `decode` and the vector intrinsics `decode` is built from.

Contract: the format is `kvrag.codec.rans`'s (its docstring and `decode_reference`); this module only holds the code
that needs numba and llvmlite, which take about 50 MB of resident memory once imported. `kvrag.codec.rans` exports
these names lazily, so that a process that never encodes or decodes a ``cachegen`` layer (an index opened for full
prefills, one whose caches use another codec) never imports numba.
"""

from __future__ import annotations

import functools

import numba
import numba.extending
import numpy as np
from llvmlite import ir as llvm_ir

from kvrag.codec.rans import (
    BAD_STREAM,
    BAD_SYMBOL,
    ESCAPE,
    ESCAPE_FLAG,
    LANES,
    OK,
    PROB_BITS,
    PROB_SCALE,
    RANS_L,
    TOO_MANY_ESCAPES,
    TUPLE,
)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def encode(symbols: np.ndarray, run_len: np.ndarray, run_dist: np.ndarray, freq: np.ndarray,
           start: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Symbols (runs of ``run_len`` with distribution ``run_dist``) → (words u16, states u32, status).

    ``freq``/``start``: ``u32 [n_dist, MAX_ALPHABET]``; a symbol of frequency 0 is `BAD_SYMBOL`.
    """
    n = symbols.size
    out = np.empty(n + 1, np.uint16)
    x = np.full(LANES, RANS_L, np.uint32)
    p = out.size
    r = run_len.size - 1
    run_start = n
    if r >= 0:
        run_start = n - run_len[r]
    for i in range(n - 1, -1, -1):
        while i < run_start:
            r -= 1
            run_start -= run_len[r]
        d, s = run_dist[r], symbols[i]
        f = freq[d, s]
        if f == 0:
            return out[:0], x, BAD_SYMBOL
        lane = i & (LANES - 1)
        v = x[lane]
        # branch-free renormalisation: the low word is always written below the stream, kept only if emitted
        emit = np.uint32(np.uint64(v) >= (np.uint64(f) << np.uint64(32 - PROB_BITS)))
        out[p - 1] = np.uint16(v & np.uint32(0xFFFF))
        p -= int(emit)
        v >>= emit * np.uint32(16)
        q = v // f
        x[lane] = (q << np.uint32(PROB_BITS)) + (v - q * f) + start[d, s]
    return out[p:].copy(), x, OK


# The decoder's hot paths are numba intrinsics: LLVM IR written here, so that they are vector code
# (numba neither vectorises table lookups nor moves 4 floats at once). They take C-contiguous 1-D arrays
# and read and write them without bounds checks; `decode` sizes what they touch.
_I8, _I16, _I32, _I64 = (llvm_ir.IntType(n) for n in (8, 16, 32, 64))
_LANES8 = llvm_ir.VectorType(_I32, 8)


def _arrays_are(*pairs: tuple[object, object]) -> bool:
    """Whether each ``(numba type, dtype)`` pair is a C-contiguous 1-D array of that dtype."""
    return all(isinstance(a, numba.types.Array) and a.layout == "C" and a.ndim == 1 and a.dtype == dtype
               for a, dtype in pairs)


def _data(context, builder, signature, args, i):  # type: ignore[no-untyped-def]
    """Pointer to the first element of array argument ``i``."""
    return context.make_array(signature.args[i])(context, builder, args[i]).data


def _u64(context, builder, signature, args, i):  # type: ignore[no-untyped-def]
    """Integer argument ``i`` as an unsigned 64-bit value."""
    return context.cast(builder, args[i], signature.args[i], numba.types.uint64)


def _splat(value: int):  # type: ignore[no-untyped-def]
    return llvm_ir.Constant(_LANES8, [value] * 8)


def _move4(builder, src, src_at, dst, dst_at) -> None:  # type: ignore[no-untyped-def]
    """``dst[dst_at:][:4] = src[src_at:][:4]`` (float32 pointers) as one unaligned 16-byte move."""
    vec = llvm_ir.VectorType(llvm_ir.FloatType(), TUPLE).as_pointer()
    value = builder.load(builder.bitcast(builder.gep(src, [src_at]), vec), align=4)
    builder.store(value, builder.bitcast(builder.gep(dst, [dst_at]), vec), align=4)


@numba.extending.intrinsic
def _copy4(typingctx, dst, dst_at, src, src_at):  # type: ignore[no-untyped-def]
    """``dst[dst_at:][:4] = src[src_at:][:4]`` (float32 arrays) as one unaligned 16-byte move."""
    if not _arrays_are((dst, numba.types.float32), (src, numba.types.float32)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data, u64 = (functools.partial(f, context, builder, signature, args) for f in (_data, _u64))
        _move4(builder, data(2), u64(3), data(0), u64(1))
        return context.get_dummy_value()

    return numba.types.void(dst, dst_at, src, src_at), codegen


@numba.extending.intrinsic
def _decode8(typingctx, x, lane0, tab, info, row, out, o, k):  # type: ignore[no-untyped-def]
    """Decode one symbol in each of lanes ``lane0 .. lane0 + 7`` of ``x`` (u32) with one distribution
    (``tab`` u8, ``info`` u32, ``row`` f32: `decode`'s per-distribution tables), writing lane ``j``'s
    ``TUPLE`` row values at ``out[o + j * k:]``; returns the OR of the 8 symbols' ``info`` entries.

    The states are updated as one 8-wide vector; the table lookups and the moves stay per lane.
    """
    if not _arrays_are((x, numba.types.uint32), (tab, numba.types.uint8), (info, numba.types.uint32),
                       (row, numba.types.float32), (out, numba.types.float32)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data, u64 = (functools.partial(f, context, builder, signature, args) for f in (_data, _u64))
        tab, info, row, out = data(2), data(3), data(4), data(5)
        lanes = builder.bitcast(builder.gep(data(0), [u64(1)]), _LANES8.as_pointer())
        state = builder.load(lanes, align=4)
        slot = builder.and_(state, _splat(PROB_SCALE - 1))
        o, k = u64(6), u64(7)
        entries = llvm_ir.Constant(_LANES8, None)
        for j in range(8):
            lane = llvm_ir.Constant(_I32, j)
            at = builder.zext(builder.extract_element(slot, lane), _I64)
            sym = builder.zext(builder.load(builder.gep(tab, [at])), _I64)
            entries = builder.insert_element(entries, builder.load(builder.gep(info, [sym])), lane)
            _move4(builder, row, builder.mul(sym, llvm_ir.Constant(_I64, TUPLE)),
                   out, builder.add(o, builder.mul(k, llvm_ir.Constant(_I64, j))))
        # x = freq * (x >> PROB_BITS) + slot - start, with entry = freq << 16 | flag | start
        freq = builder.lshr(entries, _splat(16))
        start = builder.and_(entries, _splat(PROB_SCALE - 1))
        builder.store(builder.sub(builder.add(builder.mul(freq, builder.lshr(state, _splat(PROB_BITS))), slot), start),
                      lanes, align=4)
        for width in (4, 2, 1):  # OR the 8 entries together
            entries = builder.or_(entries, builder.shuffle_vector(
                entries, entries, llvm_ir.Constant(_LANES8, [j + width if j < width else j for j in range(8)])))
        return builder.extract_element(entries, llvm_ir.Constant(_I32, 0))

    return numba.types.uint32(x, lane0, tab, info, row, out, o, k), codegen


def _refill_offsets() -> np.ndarray:
    """``u8 [256 * 8]``: for each 8-bit mask of lanes that read a word, lane ``b``'s row holds how many
    lanes before ``b`` read one (the index of its word among the next 8); lanes that read none get 0.
    """
    masks = np.arange(256)[:, None]
    reads = (masks >> np.arange(8)) & 1
    return ((np.cumsum(reads, axis=1) - reads) * reads).astype(np.uint8).ravel()


_REFILL_OFFSETS = _refill_offsets()


@numba.extending.intrinsic
def _refill8(typingctx, x, lane0, words, p):  # type: ignore[no-untyped-def]
    """Renormalise lanes ``lane0 .. lane0 + 7`` of ``x`` (u32) from ``words[p:]`` (u16), in lane
    order, as 8-wide vector code; the new read position.

    Lanes below ``RANS_L`` take the next words in turn: the 8 words at ``p`` are loaded at once and
    each such lane picks its own with a permutation (``vpermd`` where AVX2 is enabled), indexed by
    `_REFILL_OFFSETS` at the lanes' mask; ``p`` then advances by the mask's popcount. So it always
    reads ``words[p : p + 8]``.
    """
    if not _arrays_are((x, numba.types.uint32), (words, numba.types.uint16)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data, u64 = (functools.partial(f, context, builder, signature, args) for f in (_data, _u64))
        u8_array = numba.types.Array(numba.types.uint8, 1, "C")
        table = context.make_array(u8_array)(
            context, builder, context.make_constant_array(builder, u8_array, _REFILL_OFFSETS)).data
        lanes = builder.bitcast(builder.gep(data(0), [u64(1)]), _LANES8.as_pointer())
        state = builder.load(lanes, align=4)
        reads = builder.icmp_unsigned("<", state, _splat(RANS_L))
        mask = builder.bitcast(reads, _I8)
        row = builder.gep(table, [builder.shl(builder.zext(mask, _I64), llvm_ir.Constant(_I64, 3))])
        offsets = builder.zext(builder.load(builder.bitcast(row, llvm_ir.VectorType(_I8, 8).as_pointer()), align=1),
                               _LANES8)
        p = u64(3)
        next8 = builder.bitcast(builder.gep(data(2), [p]), llvm_ir.VectorType(_I16, 8).as_pointer())
        ahead = builder.zext(builder.load(next8, align=2), _LANES8)
        picked = llvm_ir.Constant(_LANES8, None)
        for j in range(8):  # a variable permutation: LLVM emits one vpermd for it where AVX2 is on
            lane = llvm_ir.Constant(_I32, j)
            picked = builder.insert_element(
                picked, builder.extract_element(ahead, builder.extract_element(offsets, lane)), lane)
        refilled = builder.or_(builder.shl(state, _splat(16)), picked)
        builder.store(builder.select(reads, refilled, state), lanes, align=4)
        return builder.add(p, builder.zext(builder.ctpop(mask), _I64))

    return numba.types.uint64(x, lane0, words, p), codegen


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _refill(x: np.ndarray, words: np.ndarray, p: np.uint64) -> np.uint64:
    """Renormalise every lane in lane order from ``words[p:]``; the new read position. Reads
    ``words[p : p + LANES]`` at most (8 lanes at a time, `_refill8`).
    """
    for lane0 in range(0, LANES, 8):
        p = _refill8(x, lane0, words, p)  # type: ignore[call-arg]  # mypy sees the intrinsic's typing signature
    return p


@numba.njit(cache=True, nogil=True, boundscheck=False)
def decode(words: np.ndarray, n_words: int, states: np.ndarray, seg_n: np.ndarray, seg_k: np.ndarray,
           seg_dist: np.ndarray, seg_base: np.ndarray, slot_sym: np.ndarray, sym_info: np.ndarray,
           rows: np.ndarray, escapes: np.ndarray, out: np.ndarray) -> int:
    """Decode and dequantise every segment; returns a status code (`OK` when the stream is exact).

    Segment ``j`` holds ``seg_n[j]`` values, written to ``out[seg_base[j]:][:seg_n[j]]``, coded
    ``seg_k[j]`` per symbol with distribution ``seg_dist[j]`` (then the ``seg_n % seg_k`` leftovers
    one per symbol with distribution ``seg_dist[j] + 1``). Each symbol writes ``TUPLE`` floats, so
    the ``TUPLE - 1`` floats after a segment may be overwritten (later segments overwrite them).
    ``words[:n_words]`` is the stream; ``words`` holds at least ``n_symbols + LANES`` words in all (the
    renormalisation of each step's lanes, and of all lanes once at the end, reads at most 8 words per
    8 lanes, so even a corrupt stream stays in bounds). Per distribution (`decode_table`, with the
    `ESCAPE_FLAG` of every symbol whose row holds `ESCAPE`): ``slot_sym`` ``u8 [n_dist, PROB_SCALE]``,
    ``sym_info`` ``u32 [n_dist, MAX_ALPHABET]``; ``rows`` ``f32 [n_dist, MAX_ALPHABET * TUPLE]`` the
    values of each symbol (`ESCAPE` for an escaped one).

    A whole step of ``LANES`` symbols (nearly all of them) is decoded 8 lanes at a time, each 8
    renormalised as soon as they are decoded (`_decode8`, `_refill8`). A step cut short by a segment's
    end is decoded lane by lane, and its lanes are renormalised at the end of the step, together with
    those of the step it completes. Either way the words are read in the same order as renormalising
    after every symbol. Escapes are filled in after a step whose symbols carry the flag, over the
    values that step wrote, in order: the loop that decodes stays free of them (escapes are ~0.1 % of
    `cachegen`'s symbols). ``words``, ``out`` and the rows of the tables must be C-contiguous.
    """
    # Hot indices are unsigned: numba then skips its negative-index wrap-around (~20% faster).
    x = states.copy()
    p = np.uint64(0)
    used = 0
    i = 0
    mask = np.uint32(PROB_SCALE - 1)
    for j in range(seg_n.size):
        n_sym, k, o = seg_n[j] // seg_k[j], seg_k[j], np.uint64(seg_base[j])
        for part in range(2):
            if part == 1:
                n_sym, k = seg_n[j] - n_sym * seg_k[j], 1
            d = seg_dist[j] + part
            tab, info, row = slot_sym[d], sym_info[d], rows[d]
            left = n_sym
            while left > 0:
                first = i & (LANES - 1)
                count = min(LANES - first, left)
                o0, flags = o, np.uint32(0)
                whole = count == LANES
                if whole:
                    for lane0 in range(0, LANES, 8):
                        flags |= _decode8(x, lane0, tab, info, row, out, o, k)  # type: ignore[call-arg]
                        p = _refill8(x, lane0, words, p)
                        o += np.uint64(8 * k)
                else:
                    for lane in range(np.uint64(first), np.uint64(first + count)):
                        v = x[lane]
                        slot = v & mask
                        sym = np.uint64(tab[slot])
                        fs = info[sym]
                        flags |= fs
                        x[lane] = (fs >> np.uint32(16)) * (v >> np.uint32(PROB_BITS)) + slot - (fs & mask)
                        _copy4(out, o, row, sym * np.uint64(TUPLE))  # type: ignore[call-arg]
                        o += np.uint64(k)
                if flags & np.uint32(ESCAPE_FLAG):
                    for t in range(o0, o):
                        if out[t] == ESCAPE:
                            if used >= escapes.size:
                                return TOO_MANY_ESCAPES
                            out[t] = escapes[used]
                            used += 1
                i += count
                left -= count
                if not whole and i & (LANES - 1) == 0:
                    p = _refill(x, words, p)
    p = _refill(x, words, p)
    if p != np.uint64(n_words) or used != escapes.size:
        return BAD_STREAM
    for j in range(LANES):
        if x[j] != RANS_L:
            return BAD_STREAM
    return OK
