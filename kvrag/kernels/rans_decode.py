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
import importlib.util
import logging
from typing import Any

import numpy as np
import torch

from kvrag.codec import rans

HAS_TRITON = importlib.util.find_spec("triton") is not None  # without it, the host decoder is used

log = logging.getLogger(__name__)
META = 10  # states_off, esc_off, n_esc, words_off, n_words, n_symbols, run0, run_end, col, seq
RUN = 5  # first symbol, distribution, k, row, first code
LANES = 32
# status codes, as `kvrag.codec.rans`
OK, TOO_MANY_ESCAPES, BAD_STREAM = 0, 2, 3


def available() -> bool:
    """Whether Triton is importable (the kernel then runs on CUDA, or interpreted on the CPU)."""
    return HAS_TRITON


def _kernel_module() -> Any:
    # triton takes about 0.2 s to import: loaded only when a decode runs on the kernel
    from kvrag.kernels import rans_kernel

    return rans_kernel


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (on CPU tensors), as the tests run it."""
    return bool(_kernel_module().interpreted())


def decode(data: torch.Tensor, meta: torch.Tensor, runs: torch.Tensor, tables: dict[str, torch.Tensor],
           out: torch.Tensor, max_starts: int) -> torch.Tensor:
    """Decode every stream of ``data`` into ``out``; the int32 status of each (`OK` when exact).

    ``data``: uint8, 4-byte aligned streams (see the module docstring for ``meta`` and ``runs``);
    ``max_starts``: the most run starts in any ``(32 t, 32 t + 32]`` of a stream's symbols;
    ``tables``: ``slot_sym``, ``freq``, ``start`` (int32), ``rows`` (float32), ``escapes`` (int32), all on
    ``data``'s device, as is ``out`` (float32 ``[rows, T]``, contiguous). Asynchronous on CUDA.
    """
    if not HAS_TRITON:
        raise RuntimeError("the Triton rANS decoder needs triton (pip install triton)")
    if data.numel() % 4:
        raise ValueError("rans_decode: data must be a whole number of 32-bit words")
    status = torch.empty(meta.shape[0], dtype=torch.int32, device=data.device)
    if meta.shape[0] == 0:
        return status
    if data.device.type != "cuda" and not interpreted():
        raise RuntimeError("the Triton rANS decoder runs on CUDA, or on the CPU in Triton's interpreter "
                           "(set TRITON_INTERPRET=1 before triton is imported)")
    kernel = _kernel_module().kernel()
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
    if not HAS_TRITON:
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
