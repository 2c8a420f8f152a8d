"""A windowed layer's stored chunk cache keeps only its last ``window`` rows, and fusion stays exact where it was.

Tiny models of the windowed families (16-token windows over chunks of 23-45 tokens): the container stores those
rows and reads the layer back at full length with zeros before them; reusing stored caches and recomputing every
token give the same logits from cut caches as from whole ones, read from memory or through a `StoreFeed`; a piece
shorter than its stored cache is computed again rather than read from rows a windowed layer did not keep; an index
of such a model is smaller by what its windowed layers do not store.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer, tiny_model
from test_fuse import _reference_logits, _setup

from kvrag import KVRag, SplitConfig
from kvrag.codec.base import make_codec
from kvrag.config import FuseConfig
from kvrag.errors import CorruptChunkError
from kvrag.fusion import FusionInput, fuse
from kvrag.loading.feed import StoreFeed
from kvrag.model.families import Family
from kvrag.model.loading import wrap_model
from kvrag.storage.checksum import crc32
from kvrag.storage.container import ChunkReader, encode_chunk
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import make_store

WINDOWED = ["gemma2", "gemma3", "gpt_oss"]
LENS = (23, 45, 31)  # each longer than the 16-token window


@pytest.fixture(scope="module", params=WINDOWED)
def setup(request):
    return _setup(request.param, lens=LENS)


def _cut_store(tmp_path: Path, lm, kv) -> tuple[KVStore, list[str]]:
    kvstore = KVStore(make_store("disk", tmp_path / "chunks", fsync=False), make_codec("raw"), lm.fingerprint,
                      lm.family.windows)
    keys = [f"c{i}" for i in range(len(kv))]
    for key, (k, v) in zip(keys, kv):
        kvstore.put(key, k, v)
    return kvstore, keys


def _read(kvstore: KVStore, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    with kvstore.reader(key) as reader:
        return reader.decode_all()


def test_the_container_keeps_a_windowed_layers_last_rows_and_reads_zeros_before_them():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(4, 2, 10, 8, generator=gen), torch.randn(4, 2, 10, 8, generator=gen)
    windows = [None, 4, None, 12]
    whole = encode_chunk(make_codec("raw"), "k", "fp", keys, values)
    cut = encode_chunk(make_codec("raw"), "k", "fp", keys, values, windows)
    assert len(cut) < len(whole) - 2 * (2 * 6 * 8 * 4) + 100  # layer 1's 6 unkept rows of keys and values
    import io

    with ChunkReader("k", io.BytesIO(cut), make_codec("raw"), "fp") as reader:
        assert reader.header.cut and [reader.header.stored_rows(i) for i in range(4)] == [10, 4, 10, 10]
        assert reader.header.layers[1][1] * 10 == reader.header.layers[0][1] * 4
        got_k, got_v = reader.decode_all()
        out = torch.empty(2, 2, 10, 8)
        reader.decode_layer_into(1, out)
    assert torch.equal(got_k[[0, 2, 3]], keys[[0, 2, 3]]) and torch.equal(got_v[[0, 2, 3]], values[[0, 2, 3]])
    assert torch.equal(got_k[1, :, 6:], keys[1, :, 6:]) and not got_k[1, :, :6].any() and not got_v[1, :, :6].any()
    assert torch.equal(out[0], got_k[1]) and torch.equal(out[1], got_v[1])


def test_a_header_whose_rows_disagree_with_its_shape_is_refused():
    import io

    data = encode_chunk(make_codec("raw"), "k", "fp", torch.zeros(2, 1, 6, 4), torch.zeros(2, 1, 6, 4), [3, None])
    magic, version, length, _ = struct.unpack("<4sHII", data[:14])
    header = json.loads(data[14:14 + length])
    header["rows"] = [7, 6]  # more rows than the chunk has
    head = json.dumps(header, sort_keys=True).encode()
    bad = struct.pack("<4sHII", magic, version, len(head), crc32(head)) + head + data[14 + length:]
    with pytest.raises(CorruptChunkError, match="rows"):
        ChunkReader("k", io.BytesIO(bad), make_codec("raw"), "fp")


def test_stored_windowed_layers_hold_the_window_and_whole_layers_everything(setup, tmp_path: Path):
    lm, prefix, chunks, kv, suffix = setup
    kvstore, keys = _cut_store(tmp_path, lm, kv)
    for key, (k, v), n in zip(keys, kv, LENS):
        got_k, got_v = _read(kvstore, key)
        for layer, window in enumerate(lm.family.windows):
            kept = n if window is None else window
            assert torch.equal(got_k[layer, :, n - kept:], k[layer, :, n - kept:])
            assert torch.equal(got_v[layer, :, n - kept:], v[layer, :, n - kept:])
            assert not got_k[layer, :, : n - kept].any()
    windowed = sum(w is not None for w in lm.family.windows)
    assert 0 < windowed < lm.spec.n_layers  # both kinds of layer are exercised


@pytest.mark.parametrize("mode", ["reuse", "cacheblend", "probe"])
def test_fusion_over_cut_caches_is_what_it_is_over_whole_ones_where_that_is_exact(setup, tmp_path: Path, mode):
    lm, prefix, chunks, kv, suffix = setup
    kvstore, keys = _cut_store(tmp_path, lm, kv)
    cut = [_read(kvstore, key) for key in keys]
    config = FuseConfig(mode=mode, ratio=1.0)
    whole = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config).logits
    from_memory = fuse(lm, FusionInput(prefix, chunks, cut, suffix), config).logits
    with StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32) as feed:
        from_feed = fuse(lm, FusionInput(prefix, chunks, feed, suffix), config).logits
    assert (from_memory - whole).abs().max().item() <= 1e-5
    assert (from_feed - whole).abs().max().item() <= 1e-5
    if mode != "reuse":  # every token recomputed: the plain forward's logits
        ids = torch.cat([prefix.ids, *chunks, suffix])
        assert (whole - _reference_logits(lm, ids)).abs().max().item() <= 1e-4


def test_a_piece_shorter_than_its_cut_cache_is_computed_again(setup, tmp_path: Path):
    lm, prefix, chunks, kv, suffix = setup
    kvstore, keys = _cut_store(tmp_path, lm, kv)
    recovered: list[int] = []

    def recover(j: int):  # the feed's chunk j is the store's chunk 1
        recovered.append(j)
        return kv[1][0][:, :, :10], kv[1][1][:, :, :10]

    with StoreFeed(kvstore, keys[1:2], [10], lm.spec.n_layers, "cpu", torch.float32, recover=recover,
                   rows_prefix=True) as feed:
        layer = feed.layer(0)
    assert recovered == [0]
    assert torch.equal(layer[0], kv[1][0][0, :, :10])


def test_an_index_of_a_windowed_model_is_smaller_by_what_its_windows_do_not_store(tmp_path: Path, monkeypatch):
    docs = [f"Station {i} keeps {i * 3} lamps, {i} crates of salt and a ledger of every ship that called. " * 3
            for i in range(4)]
    lm = wrap_model(tiny_model("gpt_oss"), make_tokenizer(), "gpt_oss")

    def build(index: Path) -> tuple[int, list[list[int]], list[int]]:
        """The index's chunk bytes, each chunk's stored rows per layer, and its first answer token."""
        with KVRag.build(docs, index, model=lm, split=SplitConfig(mode="document"), codec="raw",
                         show_progress=False) as rag:
            rows = []
            for record in rag.index.records():
                with rag.kvstore.reader(record.key) as reader:
                    rows.append([reader.header.stored_rows(i) for i in range(lm.spec.n_layers)])
            token = rag.answer("How many lamps does station 2 keep?", k=3, mode="reuse", max_new_tokens=1).token_ids
        return sum(p.stat().st_size for p in (index / "chunks").rglob("*") if p.is_file()), rows, token

    windows = lm.family.windows
    cut, cut_rows, cut_token = build(tmp_path / "cut")
    monkeypatch.setattr(Family, "windows", property(lambda self: (None,) * len(self.kinds)))
    whole, whole_rows, whole_token = build(tmp_path / "whole")
    n_tokens = [max(r) for r in whole_rows]
    assert min(n_tokens) > 16 and all(r == [n] * lm.spec.n_layers for r, n in zip(whole_rows, n_tokens))
    assert cut_rows == [[16 if w else n for w in windows] for n in n_tokens]
    assert cut < 0.6 * whole  # half the layers keep 16 of their ~130 rows
    assert cut_token == whole_token  # the question sees only kept rows in a windowed layer
