"""The ``cachegen`` layer blob: its byte layout, symbol order, header checks and parsing.

Contract: `pack_blob` writes and `check_header` / `parse_blob` read exactly the layout below; a blob
whose header, size or section lengths do not match the decoding codec raises ValueError (the
container turns it into `CorruptChunkError`). `layer_symbols` turns a layer's integer codes into the
symbols the rANS coder writes, in the symbol order below. Changing anything here changes stored bytes:
bump `BLOB_FORMAT` instead.

Layer blob, format 2 (little endian)::

    u8 format=2 | u8 level | u16 lanes=32 | u32 state tag | u32 seq | u32 n_escapes | u32 n_words
    | u32 lane states[32] | int16 escapes[n_escapes] | u16 rANS words[n_words]

Symbol order (lane of symbol ``i`` is ``i % 32``): K then V; per kind the layer's segments in
state order (`cachegen_state`); per segment its ``n = seq * w`` codes column by column (``w`` = the
segment's columns), each column's codes in token order; the first ``k * floor(n / k)`` codes as
``k``-tuples (first code most significant; digit ``E + code``, digit ``2E + 1`` for an escape),
the rest one per symbol. Escaped values are listed in code order.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from kvrag.codec import rans
from kvrag.lazy import lazy_exports

if TYPE_CHECKING:
    from kvrag.codec.cachegen_symbols import layer_symbols as layer_symbols
    from kvrag.codec.cachegen_tables import SharedState

BLOB_FORMAT = 2
BLOB_HEADER = struct.Struct("<BBHIIII")  # format, level, lanes, state tag, seq, n_escapes, n_words
MAX_SEQ = 1 << 20
Q_MAX = 32767  # coded values are clamped to +-Q_MAX: every escape fits an int16


def pack_blob(level: int, tag: int, seq: int, states: np.ndarray, escaped: np.ndarray, words: np.ndarray) -> bytes:
    """A layer blob of ``seq`` tokens from the rANS coder's lane ``states``, the ``escaped`` codes and its
    ``words``.
    """
    esc = escaped.astype("<i2")
    head = BLOB_HEADER.pack(BLOB_FORMAT, level, rans.LANES, tag, seq, esc.size, words.size)
    return head + states.astype("<u4").tobytes() + esc.tobytes() + words.astype("<u2").tobytes()


def check_header(blob: bytes, level: int, shared: SharedState, seq: int, layer: int) -> tuple[int, int]:
    """``(n_escapes, n_words)`` of a layer blob whose header and size match ``level``, the fitted state,
    ``seq`` and the fewest bits ``layer`` can code ``seq`` tokens in.

    Raises:
        ValueError: the blob does not match (the message says how).
    """
    if len(blob) < BLOB_HEADER.size:
        raise ValueError(f"cachegen blob of {len(blob)} bytes is shorter than its header")
    version, blob_level, lanes, tag, blob_seq, n_esc, n_words = BLOB_HEADER.unpack_from(blob)
    if version != BLOB_FORMAT:
        raise ValueError(f"cachegen blob format {version}, this kvrag reads format {BLOB_FORMAT} "
                         "(re-encode the index's chunks)")
    if lanes != rans.LANES:
        raise ValueError(f"cachegen blob has {lanes} rANS lanes, this kvrag decodes {rans.LANES}")
    if blob_level != level:
        raise ValueError(f"cachegen blob is level {blob_level}, this codec decodes level {level}")
    if tag != shared.tag:
        raise ValueError("cachegen blob was written with a different fitted codec state")
    if blob_seq != seq:
        raise ValueError(f"cachegen blob holds {blob_seq} tokens, header says {seq}")
    esc_start = BLOB_HEADER.size + 4 * lanes
    words_start = esc_start + 2 * n_esc
    if words_start + 2 * n_words != len(blob):
        raise ValueError(f"cachegen blob of {len(blob)} bytes does not match its section lengths")
    plan = shared.tables(level).plans[layer]
    if seq * plan.bits_per_token - plan.bits_slack > 16 * n_words + 32 * rans.LANES:
        raise ValueError(f"cachegen layer {layer}: {n_words} words cannot hold {seq} tokens")
    return n_esc, n_words


def parse_blob(blob: bytes, level: int, shared: SharedState, seq: int, max_symbols: int,
               layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A checked blob's ``(lane states, escaped values, words, n_words)`` as `rans.decode` takes them; the
    words are padded by ``max_symbols + LANES`` (the padding's content never matters).

    Raises:
        ValueError: as `check_header`.
    """
    n_esc, n_words = check_header(blob, level, shared, seq, layer)
    esc_start = BLOB_HEADER.size + 4 * rans.LANES
    words_start = esc_start + 2 * n_esc
    states = np.frombuffer(blob, "<u4", rans.LANES, BLOB_HEADER.size).astype(np.uint32)
    esc = np.frombuffer(blob, "<i2", n_esc, esc_start).astype(np.float32)
    # the padding `rans.decode` needs; its content never matters (a stream that uses it fails)
    words = np.empty(n_words + max_symbols + rans.LANES, np.uint16)
    words[:n_words] = np.frombuffer(blob, "<u2", n_words, words_start)
    return states, esc, words, n_words


# `layer_symbols` is compiled by numba: it loads with it on first use (`kvrag.codec.cachegen_symbols`)
__getattr__ = lazy_exports(__name__, {"layer_symbols": "kvrag.codec.cachegen_symbols"})
