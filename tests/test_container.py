"""The chunk container and `KVStore`: round trips, every kind of corruption, layer-wise reads,
several quality levels per chunk, and fuzzing (only `CorruptChunkError` may come out)."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import D, H, L, synthetic_kv

from kvrag.codec import make_codec
from kvrag.codec.base import Codec
from kvrag.errors import CorruptChunkError
from kvrag.storage.container import MAGIC, ChunkReader, encode_chunk
from kvrag.storage.kvstore import KVStore, level_key
from kvrag.storage.stores import MemoryStore, make_store

KEY = "0123456789abcdef0123456789abcdef01234567"
FP = "model-fingerprint"


@functools.lru_cache(maxsize=1)
def fitted_cachegen() -> Codec:
    codec = make_codec("cachegen")
    codec.fit([synthetic_kv(i) for i in range(6)], n_layers=L)
    return codec


@pytest.fixture(scope="module")
def cachegen() -> Codec:
    return fitted_cachegen()


@pytest.fixture(params=["raw", "int8", "cachegen"])
def codec(request: pytest.FixtureRequest, cachegen: Codec) -> Codec:
    return cachegen if request.param == "cachegen" else make_codec(request.param)


def container(codec: Codec, seed: int = 0) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    keys, values = synthetic_kv(seed)
    return encode_chunk(codec, KEY, FP, keys, values), keys, values


def read_all(data: bytes, codec: Codec, key: str = KEY, fingerprint: str | None = FP) -> Any:
    with ChunkReader(key, io.BytesIO(data), codec, fingerprint) as reader:
        return reader.decode_all()


def rewrite_header(data: bytes, edit: Any) -> bytes:
    """A container whose JSON header went through ``edit`` (checksum recomputed: a consistent file)."""
    _, version, head_len, _ = struct.unpack_from("<4sHII", data)
    meta = json.loads(data[14 : 14 + head_len])
    edit(meta)
    head = json.dumps(meta, sort_keys=True).encode()
    return struct.pack("<4sHII", MAGIC, version, len(head), zlib.crc32(head)) + head + data[14 + head_len :]


def test_roundtrip_through_the_store(codec: Codec, tmp_path: Path) -> None:
    for store in (MemoryStore(), make_store("disk", tmp_path, fsync=False)):
        kv = KVStore(store, codec, FP)
        keys, values = synthetic_kv(1)
        assert kv.put(KEY, keys, values) == store.nbytes(KEY)
        k, v = kv.load(KEY)
        assert k.shape == keys.shape and kv.is_valid(KEY)
        if codec.name == "raw":
            assert torch.equal(k, keys) and torch.equal(v, values)
        else:
            assert float((k - keys).norm() / keys.norm()) < 0.1


def corruptions(data: bytes, other: Codec) -> dict[str, tuple[bytes, Codec | None, str | None]]:
    """name -> (file bytes, codec to read with (None: the writer's), fingerprint (None: the right one))."""
    head_len = struct.unpack_from("<I", data, 6)[0]
    flip_layer = bytearray(data)
    flip_layer[-3] ^= 0x10
    flip_header = bytearray(data)
    flip_header[14 + head_len // 2] ^= 0x01
    return {
        "truncated": (data[: len(data) - 5], None, None),
        "truncated in the header": (data[:20], None, None),
        "empty file": (b"", None, None),
        "flipped bit in a layer": (bytes(flip_layer), None, None),
        "flipped bit in the header": (bytes(flip_header), None, None),
        "wrong magic": (b"XXXX" + data[4:], None, None),
        "wrong version": (data[:4] + struct.pack("<H", 99) + data[6:], None, None),
        "wrong fingerprint": (data, None, "another-model"),
        "wrong codec": (data, other, None),
        "wrong codec params": (rewrite_header(data, lambda m: m["codec"].update(level=5)), None, None),
        "another chunk's file": (rewrite_header(data, lambda m: m.update(key="ff" * 20)), None, None),
        "layer table not contiguous": (rewrite_header(data, lambda m: m["layers"][1].__setitem__(0, 3)),
                                       None, None),
        "trailing bytes": (data + b"\0", None, None),
    }


@pytest.mark.parametrize("kind", ["truncated", "truncated in the header", "empty file", "flipped bit in a layer",
                                  "flipped bit in the header", "wrong magic", "wrong version",
                                  "wrong fingerprint", "wrong codec", "wrong codec params",
                                  "another chunk's file", "layer table not contiguous", "trailing bytes"])
def test_every_corruption_raises_corrupt_chunk_error(codec: Codec, kind: str) -> None:
    data, _, _ = container(codec)
    other = make_codec("int8" if codec.name != "int8" else "raw")
    bad, reader_codec, fingerprint = corruptions(data, other)[kind]
    with pytest.raises(CorruptChunkError) as info:
        read_all(bad, reader_codec or codec, fingerprint=fingerprint or FP)
    assert info.value.chunk == KEY and KEY in str(info.value)


def test_wrong_level_and_other_fitted_state_raise(cachegen: Codec) -> None:
    data, _, _ = container(cachegen)
    with pytest.raises(CorruptChunkError, match="parameters"):
        read_all(data, cachegen.with_level(0))
    refit = make_codec("cachegen")
    refit.fit([synthetic_kv(40 + i) for i in range(3)], n_layers=L)
    with pytest.raises(CorruptChunkError, match="parameters") as info:
        read_all(data, refit)
    assert info.value.chunk == KEY


def test_codec_level_check_backs_up_the_header(cachegen: Codec) -> None:
    """Even with a header claiming the reader's params, a blob of another level does not decode."""
    level0 = cachegen.with_level(0)
    data = encode_chunk(level0, KEY, FP, *synthetic_kv(2))
    forged = rewrite_header(data, lambda m: m.update(codec=cachegen.params()))
    with pytest.raises(CorruptChunkError, match="level"):
        read_all(forged, cachegen)


def test_missing_chunk(codec: Codec) -> None:
    kv = KVStore(MemoryStore(), codec, FP)
    with pytest.raises(CorruptChunkError, match="missing") as info:
        kv.load(KEY)
    assert info.value.chunk == KEY and not kv.is_valid(KEY)


def test_is_valid_spots_a_damaged_layer(codec: Codec) -> None:
    store = MemoryStore()
    kv = KVStore(store, codec, FP)
    kv.put(KEY, *synthetic_kv(3))
    data = bytearray(store._data[KEY])
    data[-1] ^= 0xFF
    store.put(KEY, bytes(data))
    assert not kv.is_valid(KEY)
    reader = kv.reader(KEY)  # the header is intact: opening works, the layer read does not
    with reader, pytest.raises(CorruptChunkError, match=f"layer {L - 1}"):
        reader.decode_layer(L - 1)


class CountingFile(io.BytesIO):
    """Records the byte ranges read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.ranges: list[tuple[int, int]] = []

    def read(self, size: int | None = -1) -> bytes:
        start = self.tell()
        out = super().read(size)
        self.ranges.append((start, start + len(out)))
        return out


def test_single_layer_decode_reads_only_that_layer(codec: Codec) -> None:
    data, keys, values = container(codec)
    fh = CountingFile(data)
    reader = ChunkReader(KEY, fh, codec, FP)
    header_end = reader.header.data_start
    fh.ranges.clear()
    k, v = reader.decode_layer(2)
    offset, length, _ = reader.header.layers[2]
    assert fh.ranges == [(header_end + offset, header_end + offset + length)]
    full_k, full_v = read_all(data, codec)
    assert torch.equal(k, full_k[2]) and torch.equal(v, full_v[2])


def test_several_levels_per_chunk(cachegen: Codec, tmp_path: Path) -> None:
    store = make_store("disk", tmp_path, fsync=False)
    kv = KVStore(store, cachegen, FP)
    keys, values = synthetic_kv(4)
    sizes = kv.put_levels(KEY, keys, values)
    assert sorted(sizes) == [0, 1, 2, 3] and sizes[0] < sizes[1] < sizes[2] < sizes[3]
    assert kv.stored_levels(KEY) == [0, 1, 2, 3] and kv.contains(KEY) and kv.contains(KEY, level=0)
    assert store.contains(level_key(KEY, 0)) and kv.nbytes(KEY, level=2) == sizes[2]
    errors = []
    for level in (0, 1, 2, 3):
        k, v = kv.load(KEY, level=level)
        errors.append(float((k - keys).norm() / keys.norm()))
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert torch.equal(kv.load(KEY)[0], kv.load(KEY, level=kv.codec.level)[0])  # the index's own level
    kv.discard(KEY)
    assert kv.stored_levels(KEY) == []
    with pytest.raises(CorruptChunkError, match="level 0") as info:
        kv.load(KEY, level=0)
    assert info.value.chunk == KEY


def test_level_file_swapped_for_another_level_is_detected(cachegen: Codec) -> None:
    store = MemoryStore()
    kv = KVStore(store, cachegen, FP)
    other = next(level for level in (3, 2) if level != cachegen.level)  # a level stored under a derived key
    kv.put_levels(KEY, *synthetic_kv(5), levels=(0, other))
    store.put(level_key(KEY, other), store._data[level_key(KEY, 0)])
    with pytest.raises(CorruptChunkError):
        kv.load(KEY, level=other)


@functools.cache
def valid_file(name: str) -> tuple[bytes, Codec, tuple[torch.Tensor, torch.Tensor]]:
    """A valid container written by codec ``name``, the codec, and what it decodes to."""
    codec = fitted_cachegen() if name == "cachegen" else make_codec(name)
    data = container(codec, seed=7)[0]
    return data, codec, read_all(data, codec)


CODECS = st.sampled_from(["raw", "int8", "cachegen"])


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=2000), name=CODECS, magic=st.booleans())
def test_random_bytes_only_raise_corrupt_chunk_error(data: bytes, name: str, magic: bool) -> None:
    codec = valid_file(name)[1]
    with pytest.raises(CorruptChunkError) as info:
        read_all((MAGIC + struct.pack("<H", 1) + data) if magic else data, codec)
    assert info.value.chunk == KEY


@settings(max_examples=200, deadline=None)
@given(name=CODECS, draw=st.data())
def test_mutated_containers_raise_or_decode_exactly(name: str, draw: st.DataObject) -> None:
    data, codec, original = valid_file(name)
    mutated = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        op = draw.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        pos = draw.draw(st.integers(0, max(0, len(mutated) - 1)))
        if op == "set" and mutated:
            mutated[pos] = draw.draw(st.integers(0, 255))
        elif op == "insert":
            mutated.insert(pos, draw.draw(st.integers(0, 255)))
        else:
            del mutated[pos : pos + 1 if op == "delete" else None]
    try:
        k, v = read_all(bytes(mutated), codec)
    except CorruptChunkError as exc:
        assert exc.chunk == KEY
        return
    assert torch.equal(k, original[0]) and torch.equal(v, original[1])


def test_shapes_in_header_match_the_cache(codec: Codec) -> None:
    data, keys, _ = container(codec)
    with ChunkReader(KEY, io.BytesIO(data), codec, FP) as reader:
        assert reader.header.shape == tuple(keys.shape) == (L, H, 37, D)
        assert reader.header.codec == json.loads(json.dumps(codec.params()))


def test_index_reopened_with_saved_codec_state_reads_its_chunks(cachegen: Codec, tmp_path: Path) -> None:
    """The build fits and saves the codec state; `KVRag.open` makes a fresh codec and loads it."""
    store = make_store("disk", tmp_path / "chunks", fsync=False)
    KVStore(store, cachegen, FP).put(KEY, *synthetic_kv(6))
    cachegen.save_state(tmp_path / "codec")
    reopened = make_codec("cachegen", cachegen.level)
    reopened.load_state(tmp_path / "codec")
    k, v = KVStore(store, reopened, FP).load(KEY)
    k0, v0 = KVStore(store, cachegen, FP).load(KEY)
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16])
def test_decode_layer_into_equals_decode_layer(codec: Codec, tmp_path: Path, dtype: torch.dtype | None) -> None:
    """Into a buffer of the stored dtype (``raw``: read straight into it) or another one (converted)."""
    kvstore = KVStore(make_store("disk", tmp_path / "c", fsync=False), codec, FP)
    kvstore.put(KEY, *synthetic_kv(4))
    with kvstore.reader(KEY) as reader:
        out = torch.full((2, *reader.header.shape[1:]), float("nan"), dtype=dtype or reader.header.dtype)
        for layer in (0, L - 1, 1):
            reader.decode_layer_into(layer, out)
            k, v = reader.decode_layer(layer)
            assert torch.equal(out[0], k.to(out.dtype)) and torch.equal(out[1], v.to(out.dtype))
        with pytest.raises(ValueError, match="CPU tensor of shape"):
            reader.decode_layer_into(0, out[:, :, :-1])
        wide = torch.full((2, out.shape[1], out.shape[2] + 3, out.shape[3]), float("nan"), dtype=out.dtype)
        reader.decode_layer_into(1, wide[:, :, 2:-1])  # columns of a wider layer: through a buffer
        k, v = reader.decode_layer(1)
        assert torch.equal(wide[0, :, 2:-1], k.to(out.dtype)) and torch.equal(wide[1, :, 2:-1], v.to(out.dtype))
        assert wide[:, :, :2].isnan().all() and wide[:, :, -1:].isnan().all()
        reader.rows = (1, 2)  # some rows only (a prompt that reads part of a stored cache)
        part = torch.empty((2, out.shape[1], 2, out.shape[3]), dtype=out.dtype)
        reader.decode_layer_into(1, part)
        assert torch.equal(part[0], k[:, 1:3].to(out.dtype)) and torch.equal(part[1], v[:, 1:3].to(out.dtype))
        with pytest.raises(ValueError, match="rows 1..3"):
            reader.decode_layer_into(1, out)
        assert reader.rows == (1, 2)


@pytest.mark.parametrize("target", ["strided", "bfloat16", "float16", "stored bfloat16"])
def test_codec_decode_layer_into_any_buffer(codec: Codec, target: str) -> None:
    """Into a view that is not contiguous, into another dtype, and into the cache's own dtype when that
    is not float32: `decode_layer`'s result, converted."""
    keys, values = synthetic_kv(7)
    stored = torch.bfloat16 if target == "stored bfloat16" else keys.dtype
    blob = codec.encode_layer(keys[1].to(stored), values[1].to(stored), 1)
    shape = tuple(keys.shape[1:])
    k, v = codec.decode_layer(blob, 1, shape, stored)
    if target == "strided":
        out = torch.full((2, shape[0], shape[1], 2 * shape[2]), float("nan"))[..., ::2]
    else:
        out = torch.full((2, *shape), float("nan"), dtype=getattr(torch, target.split()[-1]))
    codec.decode_layer_into(blob, 1, shape, stored, out)
    assert torch.equal(out[0], k.to(out.dtype)) and torch.equal(out[1], v.to(out.dtype))


@pytest.mark.parametrize("damage", ["flipped bit", "truncated"])
def test_decode_layer_into_checks_the_layer(codec: Codec, damage: str) -> None:
    data = bytearray(container(codec)[0])
    if damage == "flipped bit":
        data[-1] ^= 0x10
    with ChunkReader(KEY, io.BytesIO(bytes(data)), codec, FP) as reader:
        out = torch.empty((2, *reader.header.shape[1:]), dtype=reader.header.dtype)
        reader.decode_layer_into(0, out)
        if damage == "truncated":  # the file shrinks after the reader checked its size
            reader._fh = io.BytesIO(bytes(data[:-7]))
        with pytest.raises(CorruptChunkError, match=f"layer {L - 1}") as info:
            reader.decode_layer_into(L - 1, out)
        assert info.value.chunk == KEY


def test_decode_layer_into_notices_a_file_cut_short_after_opening(tmp_path: Path) -> None:
    raw = make_codec("raw")
    path = tmp_path / "chunk"
    path.write_bytes(container(raw)[0])
    with ChunkReader(KEY, path.open("rb"), raw, FP) as reader:
        out = torch.empty((2, *reader.header.shape[1:]), dtype=reader.header.dtype)
        reader.decode_layer_into(L - 1, out)
        os.truncate(path, path.stat().st_size - 5)
        with pytest.raises(CorruptChunkError, match=f"layer {L - 1} truncated"):
            reader.decode_layer_into(L - 1, out)
