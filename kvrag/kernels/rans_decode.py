"""A Triton decoder for `kvrag.codec.rans` streams: many streams at once, one program of 32 lanes each.

It decodes what `kvrag.codec.rans.decode` decodes on the host, bit for bit, but for a batch of
streams on the GPU (e.g. one layer of every chunk of a prompt, or every layer of a chunk), and writes
the dequantised codes into one shared ``float32 [rows, T]`` matrix in which each stream owns a band of
columns. `kvrag.codec.cachegen` (`CacheGenCodec.decode_region`) builds the launch and turns the codes
back into K/V with two batched matmuls.

One program decodes one stream, its ``LANES = 32`` rANS lanes side by side: per step of 32 symbols,
every lane decodes its symbol, the lanes' escaped values are numbered by a prefix sum in lane order,
and the lanes that fall below ``2**16`` read their next words, numbered by another prefix sum
(`kvrag.codec.rans` documents the stream). The step's symbols may belong to several *runs* (a run is
a stretch of symbols with one distribution and one destination); ``MAX_RUNS`` bounds how many run
starts a step can cross, and the launcher computes it.

Without a GPU the same kernel runs in Triton's interpreter (numpy, slow): the tests use that to check
it against the host decoder.

Per stream, ``meta`` int32 ``[n, META]``: the offset of its 32 lane states in ``states`` (int32 view of
the data), of its escapes and of its words in ``halves`` (int16 view of the same data), the number of
escapes, of words and of symbols, its runs ``[run0, run_end)``, its first column in ``out`` and its
column count ``seq``. Per run, ``runs`` int32 ``[n_runs, RUN]``: the first symbol (within the stream),
the distribution, codes per symbol ``k``, the ``out`` row of the run's first code and that code's
index in its segment; code ``c`` of a segment lands at row ``row + c // seq``, column
``col + c % seq``. Tables per distribution: ``slot_sym`` ``[n_dist, 4096]``, ``freq`` and ``start``
``[n_dist, 256]``, ``rows`` float32 ``[n_dist, 256 * 4]`` and ``escapes`` ``[n_dist, 256]`` (how many of a
symbol's values are escaped).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

from kvrag.codec import rans

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # kvrag runs without it: the host decoder is used
    triton = None

log = logging.getLogger(__name__)
META = 10  # states_off, esc_off, n_esc, words_off, n_words, n_symbols, run0, run_end, col, seq
RUN = 5  # first symbol, distribution, k, row, first code
LANES = 32
# status codes, as `kvrag.codec.rans`
OK, TOO_MANY_ESCAPES, BAD_STREAM = 0, 2, 3


def available() -> bool:
    """Whether Triton is importable (the kernel then runs on CUDA, or interpreted on the CPU)."""
    return triton is not None


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
def _kernel() -> Any:
    return triton.jit(_decode)  # an interpreted function when TRITON_INTERPRET=1 was set before triton's import


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (on CPU tensors), as the tests run it."""
    return isinstance(_kernel(), InterpretedFunction)


def decode(data: torch.Tensor, meta: torch.Tensor, runs: torch.Tensor, tables: dict[str, torch.Tensor],
           out: torch.Tensor, max_starts: int) -> torch.Tensor:
    """Decode every stream of ``data`` into ``out``; the int32 status of each (`OK` when exact).

    ``data``: uint8, 4-byte aligned streams (see the module docstring for ``meta`` and ``runs``);
    ``max_starts``: the most run starts in any ``(32 t, 32 t + 32]`` of a stream's symbols;
    ``tables``: ``slot_sym``, ``freq``, ``start`` (int32), ``rows`` (float32), ``escapes`` (int32), all on
    ``data``'s device, as is ``out`` (float32 ``[rows, T]``, contiguous). Asynchronous on CUDA.
    """
    if triton is None:
        raise RuntimeError("the Triton rANS decoder needs triton (pip install triton)")
    if data.numel() % 4:
        raise ValueError("rans_decode: data must be a whole number of 32-bit words")
    status = torch.empty(meta.shape[0], dtype=torch.int32, device=data.device)
    if meta.shape[0] == 0:
        return status
    if data.device.type != "cuda" and not interpreted():
        raise RuntimeError("the Triton rANS decoder runs on CUDA, or on the CPU in Triton's interpreter "
                           "(set TRITON_INTERPRET=1 before triton is imported)")
    kernel = _kernel()
    bound = 1 << max(1, max_starts).bit_length()  # a power of two above the run starts one step crosses
    kernel[(meta.shape[0],)](
        data.view(torch.int32), data.view(torch.int16), meta, runs, tables["slot_sym"], tables["freq"],
        tables["start"], tables["rows"], tables["escapes"], out, status, out.shape[1],
        MAX_RUNS=bound, N_LANES=LANES, N_META=META, N_RUN=RUN, num_warps=1)
    return status


@functools.cache
def works(device: torch.device) -> bool:
    """Whether the kernel compiles and runs on ``device`` and decodes a small two-run stream exactly as
    written (checked once per device). False, with a warning, where Triton is missing or fails.
    """
    if triton is None:
        log.warning("the Triton rANS decoder needs triton; cachegen caches decode on the host")
        return False
    try:
        gen = np.random.default_rng(0)
        freq = np.stack([rans.quantise_frequencies(gen.random(n) ** 3) for n in (256, 256)])
        start = np.stack([rans.starts(f) for f in freq])
        symbols = gen.choice(256, 200, p=freq[0] / freq[0].sum()).astype(np.uint8)
        words, states, status = rans.encode(symbols, np.array([120, 80]), np.array([0, 1]), freq, start)
        data = np.zeros(-(-(4 * LANES + 2 * words.size) // 4) * 4, np.uint8)
        data[: 4 * LANES] = states.astype("<u4").view(np.uint8)
        data[4 * LANES : 4 * LANES + 2 * words.size] = words.astype("<u2").view(np.uint8)
        meta = [0, 2 * LANES, 0, 2 * LANES, words.size, symbols.size, 0, 2, 0, symbols.size]
        runs = [[0, 0, 1, 0, 0], [120, 1, 1, 0, 120]]
        on = {"slot_sym": np.stack([rans.decode_table(f)[0] for f in freq]), "freq": freq.astype(np.int32),
              "start": start.astype(np.int32),
              "rows": np.repeat(np.arange(256, dtype=np.float32)[None, :, None], 4, 2).reshape(1, -1).repeat(2, 0),
              "escapes": np.zeros((2, 256), np.int32)}
        out = torch.zeros(1, symbols.size, device=device)
        got = decode(torch.from_numpy(data).to(device), torch.tensor([meta], dtype=torch.int32, device=device),
                     torch.tensor(runs, dtype=torch.int32, device=device),
                     {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in on.items()}, out, 1)
        exact = status == 0 and int(got[0]) == OK and torch.equal(out[0].cpu(), torch.from_numpy(symbols).float())
    except Exception as exc:  # noqa: BLE001 (any compiler or launch failure means: decode on the host)
        log.warning("the Triton rANS decoder failed on %s (%s: %s); cachegen caches decode on the host",
                    device, type(exc).__name__, exc)
        return False
    if not exact:
        log.warning("the Triton rANS decoder decodes wrongly on %s; cachegen caches decode on the host", device)
    return exact
