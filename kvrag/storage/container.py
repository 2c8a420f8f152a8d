"""The on-disk chunk-cache container: one file per chunk, one independently readable blob per layer.

Layout (little endian)::

    b"KVRC" | u16 format version | u32 header length | u32 header crc32 | header (JSON, UTF-8)
    | layer 0 blob | layer 1 blob | ...

The header names the chunk key, the model fingerprint, the codec and its parameters, the cache
shape ``[layers, kv_heads, seq, head_dim]`` and dtype, and for every layer its (offset, length,
crc32) relative to the end of the header, so one layer is read and checked without the rest.
Nothing here is pickled: a hostile file can at worst raise `CorruptChunkError`.

A layer with a sliding window keeps only its last ``window`` rows (``rows`` in the header, present when some
layer is cut): no later token's query can see the others. Such a layer reads back at full length with zeros
for the rows it does not keep (`ChunkHeader.rows`), which fusion never lets a query see
(`kvrag.fusion.attention.unstored_rows`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import torch

from kvrag.codec.base import Codec
from kvrag.errors import CorruptChunkError
from kvrag.storage.checksum import crc32

MAGIC = b"KVRC"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sHII")
_MAX_HEADER = 1 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """The container's name for a torch dtype."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported cache dtype {dtype}")


def kept_rows(seq: int, windows: Sequence[int | None] | None, n_layers: int) -> list[int]:
    """Per layer, the rows of a ``seq``-token chunk's cache that are stored: all, or a windowed layer's last
    ``window`` (``windows``: per layer, None for a layer without a window; None for no windowed layer).
    """
    if windows is None:
        return [seq] * n_layers
    if len(windows) != n_layers:
        raise ValueError(f"{len(windows)} layer windows for a cache of {n_layers} layers")
    return [seq if w is None else min(seq, int(w)) for w in windows]


def encode_chunk(
    codec: Codec, key: str, fingerprint: str, keys: torch.Tensor, values: torch.Tensor,
    windows: Sequence[int | None] | None = None,
) -> bytes:
    """Frame a chunk's cache (``keys``/``values``: ``[L, H, S, D]``, keys pre-RoPE) as bytes; a layer with a
    window in ``windows`` (per layer, None for none) keeps only its last ``window`` rows.
    """
    seq = keys.shape[2]
    rows = kept_rows(seq, windows, keys.shape[0])
    blobs = [codec.encode_layer(keys[i, :, seq - r:].contiguous(), values[i, :, seq - r:].contiguous(), i)
             for i, r in enumerate(rows)]  # (every row: the layer itself, no copy)
    table, offset = [], 0
    for blob in blobs:
        table.append([offset, len(blob), crc32(blob)])
        offset += len(blob)
    header = {
        "key": key,
        "fingerprint": fingerprint,
        "codec": codec.params(),
        "shape": list(keys.shape),
        "dtype": dtype_name(keys.dtype),
        "layers": table,
    }
    if any(r < seq for r in rows):
        header["rows"] = rows
    head = json.dumps(header, sort_keys=True).encode()
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head), crc32(head)) + head + b"".join(blobs)


@dataclass(frozen=True)
class ChunkHeader:
    """A validated container header."""

    key: str
    fingerprint: str
    codec: dict[str, Any]
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    layers: tuple[tuple[int, int, int], ...]
    data_start: int
    rows: tuple[int, ...] = ()  # per layer, the last rows stored (a windowed layer's); empty: every row

    @property
    def n_layers(self) -> int:
        return self.shape[0]

    def stored_rows(self, layer: int) -> int:
        """How many of the chunk's last rows ``layer`` stores (the rest read back as zeros)."""
        return self.rows[layer] if self.rows else self.shape[2]

    @property
    def cut(self) -> bool:
        """Whether some layer stores fewer rows than the chunk has tokens."""
        return any(r < self.shape[2] for r in self.rows)


def _parse_header(key: str, preamble: bytes, read: Any) -> ChunkHeader:
    if len(preamble) < _PREAMBLE.size:
        raise CorruptChunkError(key, "truncated preamble")
    magic, version, head_len, head_crc = _PREAMBLE.unpack(preamble[: _PREAMBLE.size])
    if magic != MAGIC:
        raise CorruptChunkError(key, f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptChunkError(key, f"format version {version}, this kvrag reads {FORMAT_VERSION}")
    if head_len > _MAX_HEADER:
        raise CorruptChunkError(key, f"header length {head_len} is implausible")
    head = read(head_len)
    if len(head) != head_len or crc32(head) != head_crc:
        raise CorruptChunkError(key, "header checksum mismatch")
    try:
        meta = json.loads(head)
        shape = tuple(int(s) for s in meta["shape"])
        layers = tuple((int(o), int(n), int(c)) for o, n, c in meta["layers"])
        rows = tuple(int(r) for r in meta.get("rows", ()))
        header = ChunkHeader(
            key=str(meta["key"]),
            fingerprint=str(meta["fingerprint"]),
            codec=dict(meta["codec"]),
            shape=shape,  # type: ignore[arg-type]
            dtype=_DTYPES[meta["dtype"]],
            layers=layers,
            data_start=_PREAMBLE.size + head_len,
            rows=rows,
        )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise CorruptChunkError(key, f"malformed header: {type(exc).__name__}: {exc}") from None
    if len(shape) != 4 or len(layers) != shape[0] or min(shape) < 0:
        raise CorruptChunkError(key, "header shape and layer table disagree")
    if rows and (len(rows) != shape[0] or not all(0 <= r <= shape[2] for r in rows)):
        raise CorruptChunkError(key, "header rows and shape disagree")
    offset = 0
    for start, length, _ in layers:
        if start != offset or length < 0:
            raise CorruptChunkError(key, "layer table is not contiguous")
        offset += length
    return header


def _fileno(fh: Any) -> int | None:
    """The OS file descriptor behind ``fh``, or None (in-memory streams)."""
    try:
        return int(fh.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _normal(params: Any) -> Any:
    """``params`` as they read back from JSON (tuples become lists), for comparison."""
    return json.loads(json.dumps(params, sort_keys=True))


class ChunkReader:
    """Reads and checks one layer at a time from an open container file or bytes."""

    def __init__(self, key: str, fh: BinaryIO, codec: Codec, fingerprint: str | None = None) -> None:
        self.key, self._fh, self._codec = key, fh, codec
        self.rows: tuple[int, int] | None = None  # (start, n): `decode_layer_into` gives only these rows
        self.header = _parse_header(key, fh.read(_PREAMBLE.size), fh.read)
        if self.header.key != key:
            raise CorruptChunkError(key, f"file holds chunk {self.header.key}")
        if fingerprint is not None and self.header.fingerprint != fingerprint:
            raise CorruptChunkError(key, "written by a different model (fingerprint mismatch)")
        if self.header.codec.get("name") != codec.name:
            raise CorruptChunkError(key, f"encoded with codec {self.header.codec.get('name')!r}")
        if _normal(self.header.codec) != _normal(codec.params()):
            raise CorruptChunkError(
                key, f"encoded with codec parameters {self.header.codec}, the reader expects {codec.params()}")
        size = fh.seek(0, io.SEEK_END)
        expected = self.header.data_start + sum(n for _, n, _ in self.header.layers)
        if size != expected:
            raise CorruptChunkError(key, f"file is {size} bytes, its header describes {expected} (truncated?)")

    @property
    def codec(self) -> Codec:
        """The codec this reader decodes with."""
        return self._codec

    def fileno(self) -> int | None:
        """The OS file descriptor of the open file (None for in-memory streams)."""
        return _fileno(self._fh)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_layer_bytes(self, layer: int) -> bytes:
        """The checked bytes of one layer."""
        offset, length, _ = self.header.layers[layer]
        self._fh.seek(self.header.data_start + offset)
        blob = self._fh.read(length)
        self._check(layer, len(blob), lambda: crc32(blob))
        return blob

    def _check(self, layer: int, size: int, crc: Callable[[], int]) -> None:
        """Raise `CorruptChunkError` unless the ``size`` bytes read of ``layer`` are all of it and
        their checksum ``crc()`` matches.
        """
        _, length, expected = self.header.layers[layer]
        if size != length:
            raise CorruptChunkError(self.key, f"layer {layer} truncated")
        if crc() != expected:
            raise CorruptChunkError(self.key, f"layer {layer} checksum mismatch")

    def decode_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of one layer, each ``[H, S, D]`` (zeros for rows a windowed layer does not store)."""
        keys, values = self._decode_kept(layer)
        s = self.header.shape[2]
        if keys.shape[1] == s:
            return keys, values
        return _front_zeros(keys, s), _front_zeros(values, s)

    def _decode_kept(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of the rows ``layer`` stores, each ``[H, stored_rows, D]``."""
        blob = self.read_layer_bytes(layer)
        _, h, _, d = self.header.shape
        with self._decoding(layer):
            return self._codec.decode_layer(blob, layer, (h, self.header.stored_rows(layer), d), self.header.dtype)

    @contextlib.contextmanager
    def _decoding(self, layer: int) -> Iterator[None]:
        """Turn a codec's complaint about ``layer``'s blob into `CorruptChunkError`."""
        try:
            yield
        except (ValueError, RuntimeError, OverflowError, IndexError, TypeError) as exc:
            raise CorruptChunkError(self.key, f"layer {layer} does not decode: {exc}") from None

    def decode_layer_into(self, layer: int, out: torch.Tensor) -> None:
        """Decode one layer into ``out``, a CPU tensor ``[2, H, S, D]`` (keys, then values).

        A ``raw`` layer stored in ``out``'s dtype is read straight into a contiguous ``out`` and checked there:
        one copy, and both the read and the checksum run without holding the GIL. Other codecs decode
        into it (`Codec.decode_layer_into`: in place where the codec can, else through a copy that
        converts the dtype). An ``out`` that is columns of a wider tensor goes through a buffer of the chunk's own
        size; a windowed layer's kept rows are copied in after zeros. With ``rows`` set to ``(start, n)``,
        ``out`` is ``[2, H, n, D]`` and takes the layer's rows ``[start, start + n)`` (the layer decoded whole first).
        """
        _, h, s, d = self.header.shape
        if self.rows is None:
            self._decode_whole_into(layer, out)
            return
        start, n = self.rows
        if tuple(out.shape) != (2, h, n, d) or start + n > s:
            raise ValueError(f"rows {start}..{start + n} of {s} need a tensor of shape {(2, h, n, d)}, "
                             f"got {tuple(out.shape)}")
        whole = torch.empty((2, h, s, d), dtype=out.dtype)
        self._decode_whole_into(layer, whole)
        out.copy_(whole[:, :, start : start + n])

    def _decode_whole_into(self, layer: int, out: torch.Tensor) -> None:
        """`decode_layer_into` of every row of the layer."""
        _, h, s, d = self.header.shape
        if tuple(out.shape) != (2, h, s, d) or out.device.type != "cpu":
            raise ValueError(f"decode_layer_into needs a CPU tensor of shape {(2, h, s, d)}, "
                             f"got {tuple(out.shape)} on {out.device}")
        r = self.header.stored_rows(layer)
        if r < s:  # a windowed layer's last rows, after zeros
            keys, values = self._decode_kept(layer)
            out[:, :, : s - r].zero_()
            out[0, :, s - r:].copy_(keys)
            out[1, :, s - r:].copy_(values)
            return
        if not out.is_contiguous():
            part = torch.empty(out.shape, dtype=out.dtype)
            self._decode_whole_into(layer, part)
            out.copy_(part)
            return
        if self._codec.name == "raw" and out.dtype == self.header.dtype:  # read_layer_into checks the size
            self.read_layer_into(layer, [out.view(-1).view(torch.uint8).numpy().data])
            return
        blob = self.read_layer_bytes(layer)
        with self._decoding(layer):
            self._codec.decode_layer_into(blob, layer, (h, s, d), self.header.dtype, out)

    def read_layer_into(self, layer: int, pieces: Sequence[memoryview]) -> None:
        """Read one layer's blob scattered over ``pieces`` (writable byte buffers, filled in order,
        together exactly the blob's size) and check it. One positioned read per layer where the
        file allows it; neither the read nor the checksum holds the GIL for large pieces.
        """
        offset, length, _ = self.header.layers[layer]
        if sum(p.nbytes for p in pieces) != length:
            raise CorruptChunkError(self.key, f"layer {layer} holds {length} bytes, "
                                    f"the buffers take {sum(p.nbytes for p in pieces)}")
        start = self.header.data_start + offset
        fd = _fileno(self._fh)
        if fd is not None and hasattr(os, "preadv"):
            filled = os.preadv(fd, pieces, start)
        else:
            self._fh.seek(start)
            readinto = cast(io.BufferedIOBase, self._fh).readinto  # files and BytesIO both have it
            filled = 0
            for piece in pieces:
                got = 0
                while got < piece.nbytes and (n := readinto(piece[got:])):
                    got += n
                filled += got
                if got < piece.nbytes:
                    break

        def crc() -> int:
            value = 0
            for piece in pieces:
                value = crc32(piece, value)
            return value

        self._check(layer, filled, crc)

    def layers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.header.n_layers):
            yield self.decode_layer(i)

    def decode_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers stacked: ``(keys, values)``, each ``[L, H, S, D]``."""
        ks, vs = zip(*self.layers())
        return torch.stack(ks), torch.stack(vs)


def _front_zeros(rows: torch.Tensor, seq: int) -> torch.Tensor:
    """``rows`` ``[H, r, D]`` as the last rows of ``[H, seq, D]``, zeros before them."""
    out = rows.new_zeros((rows.shape[0], seq, rows.shape[2]))
    out[:, seq - rows.shape[1]:] = rows
    return out
