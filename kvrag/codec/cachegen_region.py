"""Decoding many ``cachegen`` layer blobs at once into side-by-side K/V (`CacheGenCodec.decode_region`).

A *region* is a run of chunks placed side by side, ``T`` tokens in all, as fusion lays them out. The
blobs of some layers of every chunk of a region are decoded together:

1. *Codes.* Every blob's rANS stream is decoded into one ``float32`` matrix of ``T`` columns, in
   which each chunk owns its columns: first the ``2 * H * m`` cross-head rows (K then V) of every
   layer, then the ``2 * H * D`` head rows (K heads then V heads) of every layer, each layer's rows
   in `LayerPlan.base_s` order. On CUDA this is one launch of the Triton decoder
   (`kvrag.kernels.rans_decode`: one program per blob, its 32 lanes side by side); elsewhere the
   host decoder (`kvrag.codec.rans`) runs blob by blob and its codes are copied in.
2. *Transforms.* One batched matmul per kind undoes the cross-head KLT for the whole region, and one
   ``baddbmm`` the per-head KLT: ``[n_layers * 2H, T, D]``, keys then values, in the cache's dtype.

The host and Triton decoders give the same codes bit for bit; the transforms are the ones
`decode_layer` runs, on the whole region instead of per chunk (float32, so each value agrees with
`decode_layer`'s to float32 rounding of a 64- or 128-term sum).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvrag.codec import rans
from kvrag.codec.cachegen_format import BLOB_FORMAT as _FORMAT
from kvrag.codec.cachegen_format import BLOB_HEADER as _BLOB
from kvrag.codec.cachegen_format import MAX_SEQ as _MAX_SEQ
from kvrag.codec.cachegen_format import check_header
from kvrag.kernels import rans_decode

assert _BLOB.size % 4 == 0  # the lane states of a blob stored at a multiple of 4 bytes are aligned

if TYPE_CHECKING:
    from kvrag.codec.cachegen import CacheGenCodec
    from kvrag.codec.cachegen_tables import LayerPlan, LevelTables

_META, _RUN = 10, 5  # `kvrag.kernels.rans_decode`'s META and RUN


@dataclass(frozen=True)
class StreamBatch:
    """Everything the Triton decoder needs besides the tables, built on the host."""

    data: torch.Tensor  # uint8 on the host: the blobs, each at a multiple of 4 bytes
    meta: np.ndarray  # int32 [n_blobs, _META]
    runs: np.ndarray  # int32 [n_runs, _RUN]
    max_starts: int  # the most run starts in one step of 32 symbols of any blob
    rows: int  # code rows of the region
    total: int  # T, tokens of the region


def layer_runs(plan: LayerPlan, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A layer's runs for chunks of ``seqs`` tokens, all at once: ``(int32 [n, _RUN]`` (chunk after
    chunk), runs per chunk, symbols per chunk, max_starts)``.

    Each segment is a run of tuple symbols then a run of leftover single codes; empty runs are left
    out. A run's first symbol counts from its chunk's first; its row is its segment's first code row
    (`LayerPlan.base_s`); its first code counts from the segment's start.
    """
    seqs = np.asarray(seqs, np.int64).reshape(-1, 1)
    n = seqs * plan.width  # [chunks, segments]
    n_tuples = n // plan.k
    count = np.stack([n_tuples, n - n_tuples * plan.k], axis=2).reshape(len(seqs), 2 * plan.k.size)
    first = np.cumsum(count, axis=1) - count
    fixed = np.stack([np.stack([plan.dist, plan.dist + 1], axis=1).ravel(),
                      np.stack([plan.k, np.ones_like(plan.k)], axis=1).ravel(), np.repeat(plan.base_s, 2)], axis=1)
    code0 = np.stack([np.zeros_like(n_tuples), n_tuples * plan.k], axis=2).reshape(count.shape)
    keep = count > 0
    runs = np.empty((*count.shape, _RUN), np.int64)
    runs[..., 0], runs[..., 1:4], runs[..., 4] = first, fixed, code0
    # run starts after each chunk's first symbol, per step of LANES symbols: how many one step crosses
    starts = keep & (first > 0)
    step = np.flatnonzero(starts) // count.shape[1] * (1 << 40) + (first[starts] - 1) // rans.LANES
    max_starts = int(np.unique(step, return_counts=True)[1].max()) if step.size else 0
    return runs[keep].astype(np.int32), keep.sum(axis=1), count.sum(axis=1), max_starts


def build_batch(codec: CacheGenCodec, blobs: Sequence[Sequence[bytes]], layers: Sequence[int],
                lengths: Sequence[int], columns: Sequence[int] | None = None, total: int | None = None) -> StreamBatch:
    """Check every blob's header and lay the blobs and their runs out for the Triton decoder.

    ``blobs[i][j]``: layer ``layers[i]`` of chunk ``j`` (``lengths[j]`` tokens). The blobs are copied
    into one buffer; `batch_from` takes them already there. Raises ValueError for a blob that does
    not match (`cachegen_format.check_header`), naming it.
    """
    _check_region(blobs, layers, lengths)
    flat = [blob for row in blobs for blob in row]  # layer-major, as the region's blobs are numbered
    sizes = np.fromiter(map(len, flat), np.int64, len(flat))
    at, nbytes = aligned(sizes)
    data = torch.empty(nbytes, dtype=torch.uint8)
    view = data.numpy()
    for offset, blob in zip(at.tolist(), flat):
        view[offset : offset + len(blob)] = np.frombuffer(blob, np.uint8)
    return batch_from(codec, data, at, sizes, layers, lengths, columns, total)


def aligned(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets of blobs of ``sizes`` bytes laid one after another at multiples of 4, and the bytes in all."""
    padded = (np.asarray(sizes, np.int64) + 3) // 4 * 4
    ends = np.cumsum(padded)
    return ends - padded, int(ends[-1]) if ends.size else 0


def batch_from(codec: CacheGenCodec, data: torch.Tensor, at: np.ndarray, sizes: np.ndarray, layers: Sequence[int],
               lengths: Sequence[int], columns: Sequence[int] | None = None, total: int | None = None) -> StreamBatch:
    """`build_batch` for blobs already in ``data`` (uint8 on the host, e.g. pinned), blob ``i * n_chunks + j``
    (layer ``layers[i]`` of chunk ``j``) at byte ``at[i * n_chunks + j]`` (a multiple of 4), ``sizes`` bytes
    long. Chunk ``j``'s tokens go to the region's columns from ``columns[j]`` (by default right after chunk
    ``j - 1``'s) in a region of ``total`` tokens (by default all the chunks').
    """
    shared = codec._require_fit("decode_region")
    tables = shared.tables(codec.level)
    state = shared.state
    mix_rows, head_rows = _rows(state.n_heads, state.mix_dims, state.head_dim)
    seqs = np.asarray(lengths, np.int64).reshape(-1)
    at, sizes = np.asarray(at, np.int64), np.asarray(sizes, np.int64)
    if len(at) != len(sizes) or len(at) != len(layers) * len(seqs) or (at % 4).any() or (
            at.size and int((at + sizes).max()) > data.numel()):
        raise ValueError(f"decode_region: {len(at)} blobs at {at.tolist()[:8]}… do not fit {len(layers)} layers "
                         f"of {len(seqs)} chunks in {data.numel()} bytes")
    offsets = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int64)
    if columns is not None:
        if len(columns) != len(lengths) or total is None or any(
                c < 0 or c + n > total for c, n in zip(columns, lengths)):
            raise ValueError(f"decode_region: columns {list(columns)} do not place {list(lengths)} tokens "
                             f"in a region of {total}")
        offsets = np.asarray([*columns, total], np.int64)
    for layer in layers:
        codec._check_shape((state.n_heads, 0, state.head_dim), layer)
    counts = _check_headers(codec, data.numpy(), at, sizes, layers, seqs)  # escapes, words
    runs, per_blob, n_sym, max_starts = [], [], [], 0
    for i, layer in enumerate(layers):
        r, n_runs, syms, crossed = layer_runs(tables.plans[layer], seqs)
        row = r[:, 3]  # this layer's rows among the region's (see the module docstring)
        r[:, 3] = np.where(row < mix_rows, i * mix_rows + row, len(layers) * mix_rows + i * head_rows + row - mix_rows)
        runs.append(r)
        per_blob.append(n_runs)
        n_sym.append(syms)
        max_starts = max(max_starts, crossed)
    esc = (at + _BLOB.size) // 2 + 2 * rans.LANES
    run_end = np.cumsum(np.concatenate(per_blob)) if per_blob else np.zeros(0, np.int64)
    n_runs_all = np.concatenate(per_blob) if per_blob else np.zeros(0, np.int64)
    meta = np.stack([(at + _BLOB.size) // 4, esc, counts[:, 0], esc + counts[:, 0], counts[:, 1],
                     np.concatenate(n_sym) if n_sym else np.zeros(0, np.int64), run_end - n_runs_all, run_end,
                     np.tile(offsets[:-1], len(layers)), np.tile(seqs, len(layers))], axis=1)
    return StreamBatch(data, meta.astype(np.int32).reshape(-1, _META),
                       np.concatenate(runs) if runs else np.zeros((0, _RUN), np.int32), max_starts,
                       len(layers) * (mix_rows + head_rows), int(offsets[-1]))


_HEADER = np.dtype([("format", "u1"), ("level", "u1"), ("lanes", "<u2"), ("tag", "<u4"), ("seq", "<u4"),
                    ("n_esc", "<u4"), ("n_words", "<u4")])  # `BLOB_HEADER`'s fields


def _check_headers(codec: CacheGenCodec, data: np.ndarray, at: np.ndarray, sizes: np.ndarray,
                   layers: Sequence[int], seqs: np.ndarray) -> np.ndarray:
    """``int64 [n_blobs, 2]`` escapes and words of every blob, whose headers are checked all at once as
    `cachegen_format.check_header` checks one; the first blob that fails raises its error, named.
    """
    shared = codec._require_fit("decode_region")
    plans = shared.tables(codec.level).plans
    layer_of, seq_of = np.repeat(np.asarray(layers, np.int64), len(seqs)), np.tile(seqs, len(layers))
    ok = (sizes >= _BLOB.size) & (seq_of <= _MAX_SEQ)
    head = np.zeros(len(sizes), _HEADER)
    whole = np.flatnonzero(ok)
    head[whole] = data[at[whole, None] + np.arange(_BLOB.size)].view(_HEADER).ravel()
    n_esc, n_words = head["n_esc"].astype(np.int64), head["n_words"].astype(np.int64)
    bits = np.asarray([plans[layer].bits_per_token for layer in layers]).repeat(len(seqs))
    slack = np.asarray([plans[layer].bits_slack for layer in layers]).repeat(len(seqs))
    ok &= (head["format"] == _FORMAT) & (head["level"] == codec.level) & (head["lanes"] == rans.LANES)
    ok &= (head["tag"] == shared.tag) & (head["seq"] == seq_of)
    ok &= _BLOB.size + 4 * rans.LANES + 2 * (n_esc + n_words) == sizes
    ok &= ~(seq_of * bits - slack > 16 * n_words + 32 * rans.LANES)
    if not ok.all():
        k = int(np.flatnonzero(~ok)[0])
        with _naming(k):
            codec._check_shape((shared.state.n_heads, int(seq_of[k]), shared.state.head_dim), int(layer_of[k]))
            blob = data[at[k] : at[k] + sizes[k]].tobytes()
            check_header(blob, codec.level, shared, int(seq_of[k]), int(layer_of[k]))
        raise RegionDecodeError(k, "its header does not match")  # (the checks above name the reason)
    return np.stack([n_esc, n_words], axis=1)


class RegionDecodeError(ValueError):
    """A blob of a region does not decode; ``blob`` is its layer-major index (``i * n_chunks + j``)."""

    def __init__(self, blob: int, why: str) -> None:
        super().__init__(f"cachegen: blob {blob} of the region does not decode: {why}")
        self.blob = blob


@contextlib.contextmanager
def _naming(blob: int) -> Iterator[None]:
    """Name the blob in a ValueError about it."""
    try:
        yield
    except ValueError as exc:
        raise RegionDecodeError(blob, str(exc)) from None


def _rows(n_heads: int, mix_dims: int, head_dim: int) -> tuple[int, int]:
    """Code rows per layer: cross-head (K and V), head (K and V)."""
    return 2 * n_heads * mix_dims, 2 * n_heads * head_dim


def _check_region(blobs: Sequence[Sequence[bytes]], layers: Sequence[int], lengths: Sequence[int]) -> None:
    if len(blobs) != len(layers) or any(len(b) != len(lengths) for b in blobs):
        raise ValueError(f"decode_region: {len(layers)} layers of {len(lengths)} chunks need as many blobs, "
                         f"got {[len(b) for b in blobs]}")
    if any(int(n) < 0 for n in lengths):
        raise ValueError(f"decode_region: negative chunk length in {list(lengths)}")


def host_codes(codec: CacheGenCodec, blobs: Sequence[Sequence[bytes]], layers: Sequence[int],
               lengths: Sequence[int]) -> torch.Tensor:
    """The region's codes (laid out as the module docstring says) decoded on the host, blob by blob."""
    state = codec._require_fit("decode_region").state
    h, m, d = state.n_heads, state.mix_dims, state.head_dim
    _check_region(blobs, layers, lengths)
    (mix_rows, head_rows), total, pad, n_l = _rows(h, m, d), int(sum(lengths)), rans.TUPLE, len(layers)
    out = torch.empty(n_l * (mix_rows + head_rows), total)
    for i, layer in enumerate(layers):
        mix_out = out[i * mix_rows : (i + 1) * mix_rows].view(2, h * m, total)
        head_out = out[n_l * mix_rows + i * head_rows :][:head_rows]
        col = 0
        for j, (blob, s) in enumerate(zip(blobs[i], (int(n) for n in lengths))):
            with _naming(i * len(lengths) + j):
                flat = torch.from_numpy(codec._codes(blob, layer, (h, s, d)))
            mix = h * m * s
            for kind in (0, 1):
                mix_out[kind, :, col : col + s] = flat[kind * (mix + pad) :][:mix].view(h * m, s)
            head_out[:, col : col + s] = flat[2 * (mix + pad) :][: head_rows * s].view(head_rows, s)
            col += s
    return out


class _DeviceTables:
    """One level's tables on one device, uploaded once."""

    def __init__(self, tables: LevelTables, device: torch.device) -> None:
        models = tables.models

        def put(a: np.ndarray, dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype)).to(device)

        self.rans = {"slot_sym": put(models.slot_sym, np.uint8), "freq": put(models.freq, np.int32),
                     "start": put(models.start, np.int32), "rows": put(models.rows, np.float32),
                     "escapes": put(models.escaped, np.int32)}
        self.mix = tables.decode_mix.to(device)
        self.basis = tables.decode_basis.to(device)
        self.mean = tables.decode_mean.to(device)


_DEVICE_LOCK = threading.Lock()


def device_tables(codec: CacheGenCodec, device: torch.device) -> _DeviceTables:
    shared = codec._require_fit("decode_region")
    key = (codec.level, str(device))
    tables = shared.tables(codec.level)
    with _DEVICE_LOCK:
        if key not in shared.on_device:
            shared.on_device[key] = _DeviceTables(tables, device)
        return shared.on_device[key]


def kernel_codes(codec: CacheGenCodec, batch: StreamBatch, device: torch.device) -> torch.Tensor:
    """The region's codes decoded by the Triton decoder on ``device`` (interpreted on the CPU).

    Raises `RegionDecodeError` for the first blob whose stream does not decode.
    """
    tables = device_tables(codec, device)
    data = batch.data.to(device, non_blocking=True)
    meta = torch.from_numpy(batch.meta).to(device, non_blocking=True)
    runs = torch.from_numpy(batch.runs).to(device, non_blocking=True)
    codes = torch.empty(batch.rows, batch.total, device=device)
    status = rans_decode.decode(data, meta, runs, tables.rans, codes, batch.max_starts).cpu()
    bad = torch.nonzero(status != rans.OK).flatten()
    if bad.numel():
        raise RegionDecodeError(int(bad[0]), f"entropy decoding failed (status {int(status[bad[0]])}): the "
                                "stream, its escapes and its header do not match")
    return codes


def transform(codec: CacheGenCodec, codes: torch.Tensor, layers: Sequence[int],
              dtype: torch.dtype) -> torch.Tensor:
    """``[n_layers, 2, H, T, D]`` K/V in ``dtype`` from a region's codes (on their device)."""
    shared = codec._require_fit("decode_region")
    h, m, d = shared.state.n_heads, shared.state.mix_dims, shared.state.head_dim
    n_l, total = len(layers), codes.shape[1]
    mix_rows = n_l * _rows(h, m, d)[0]
    if codes.device.type == "cpu":
        tables = shared.tables(codec.level)
        mix, basis, mean = tables.decode_mix, tables.decode_basis, tables.decode_mean
    else:
        dev = device_tables(codec, codes.device)
        mix, basis, mean = dev.mix, dev.basis, dev.mean
    index = torch.as_tensor(list(layers), device=mix.device)
    heads = codes[mix_rows:].view(n_l * 2 * h, d, total)
    if m:  # the cross-head KLT, [H*m, H*m] @ [H*m, T] per layer and kind, into each head's first m rows
        top = codes[:mix_rows].view(n_l * 2, h * m, total)
        mixed = torch.bmm(mix[index].reshape(n_l * 2, h * m, h * m), top)
        heads.view(n_l * 2, h, d, total)[:, :, :m].copy_(mixed.view(n_l * 2, h, m, total))
    out = torch.baddbmm(mean[index].reshape(n_l * 2 * h, 1, d), heads.transpose(1, 2),
                        basis[index].reshape(n_l * 2 * h, d, d))
    return out.to(dtype).view(n_l, 2, h, total, d)
