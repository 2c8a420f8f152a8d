"""Layer-wise chunk-cache feeds: what they deliver, recovery from bad chunks, and fusion through them."""

from __future__ import annotations

import pytest
import torch
from test_fuse import _setup

from kvrag.codec.base import make_codec
from kvrag.config import FuseConfig
from kvrag.errors import CorruptChunkError
from kvrag.fusion import FusionInput, fuse
from kvrag.loading import extents
from kvrag.loading.feed import StoreFeed, TensorFeed
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import make_store

LENS = (9, 14, 6)


@pytest.fixture(scope="module")
def setup():
    return _setup("llama", seed=3, lens=LENS)


def _store(tmp_path, lm, kv, codec: str = "raw") -> tuple[KVStore, list[str]]:
    chosen = make_codec(codec)
    if chosen.needs_fit:
        chosen.fit(list(kv), lm.spec.n_layers)
    kvstore = KVStore(make_store("disk", tmp_path / "chunks", fsync=False), chosen, lm.fingerprint)
    keys = [f"{i:02x}" * 20 for i in range(len(kv))]
    for key, (k, v) in zip(keys, kv):
        kvstore.put(key, k, v)
    return kvstore, keys


def _expected(kv, layer: int, available=(True, True, True)):
    ks = [k[layer] if ok else torch.zeros_like(k[layer]) for (k, _), ok in zip(kv, available)]
    vs = [v[layer] if ok else torch.zeros_like(v[layer]) for (_, v), ok in zip(kv, available)]
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def test_tensor_feed_delivers_each_layer_side_by_side_with_zeros_for_missing(setup):
    lm, _, _, kv, _ = setup
    masked = [kv[0], None, kv[2]]
    with TensorFeed(masked, LENS, lm.spec.n_layers, "cpu", torch.float32) as feed:
        assert feed.available == [True, False, True] and feed.total == sum(LENS)
        for layer in range(lm.spec.n_layers):
            k, v = feed.layer(layer)
            ek, ev = _expected(kv, layer, (True, False, True))
            assert torch.equal(k, ek) and torch.equal(v, ev)


def test_tensor_feed_rejects_a_cache_of_the_wrong_length(setup):
    lm, _, _, kv, _ = setup
    with pytest.raises(ValueError, match="does not fit"):
        TensorFeed(kv, (9, 15, 6), lm.spec.n_layers, "cpu", torch.float32)


@pytest.mark.parametrize("workers", [1, 3])
def test_store_feed_equals_the_stored_caches(tmp_path, setup, workers):
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    with StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32, workers=workers) as feed:
        for layer in range(lm.spec.n_layers):
            k, v = feed.layer(layer)
            ek, ev = _expected(kv, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev)
        assert feed.decode_s > 0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_store_feed_decodes_planes_of_every_chunk_at_once_like_each_chunk(monkeypatch, tmp_path, setup, codec, packed):
    """Encoded rows staged side by side (or packed per chunk and unpacked, the CUDA path) and decoded
    together, a chunk without cache zeroed and a corrupt one recomputed: what decoding each chunk's
    layer alone gives."""
    import kvrag.loading.store_feed as feed_mod

    monkeypatch.setattr(feed_mod, "PACKED_STAGING_DEVICES", {"cuda", "cpu"} if packed else set())
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv, codec)
    decoded = [kvstore.load(key) for key in keys]
    path = kvstore.store._path(keys[2])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last layer
    path.write_bytes(bytes(data))
    asked = []
    recover = lambda j: asked.append(j) or decoded[j]  # noqa: E731
    with StoreFeed(kvstore, [None, keys[1], keys[2]], LENS, lm.spec.n_layers, "cpu", torch.float32,
                   recover=recover) as feed:
        assert feed._planar is not None and feed._planar.packed == packed
        assert (feed._extents is not None) == packed  # packed slots of files: batched extent reads
        got = [feed.layer(layer) for layer in range(lm.spec.n_layers)]
    assert asked == [2]
    for layer, (k, v) in enumerate(got):
        ek, ev = _expected(decoded, layer, (False, True, True))
        assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("lens", [(6, 6, 6, 6), (5, 7, 5, 7, 7)])
def test_packed_staging_puts_runs_of_equally_long_chunks_side_by_side(monkeypatch, tmp_path, codec, lens, batched):
    """Equally long chunks next to each other (one strided copy) or apart (an indexed copy), read in
    batches without the GIL (`kvrag.loading.extents`) or chunk by chunk where those cannot run."""
    import kvrag.loading.store_feed as feed_mod

    monkeypatch.setattr(feed_mod, "PACKED_STAGING_DEVICES", {"cuda", "cpu"})
    if not batched:
        monkeypatch.setattr(extents, "available", lambda: False)
    lm, _, _, kv, _ = _setup("llama", seed=4, lens=lens)
    kvstore, keys = _store(tmp_path, lm, kv, codec)
    decoded = [kvstore.load(key) for key in keys]
    with StoreFeed(kvstore, keys, lens, lm.spec.n_layers, "cpu", torch.float32, workers=2) as feed:
        assert feed._planar is not None and len(feed._planar.runs) == len(set(lens))
        assert (feed._extents is not None) == batched
        for layer in range(lm.spec.n_layers):
            k, v = feed.layer(layer)
            ek, ev = _expected(decoded, layer, [True] * len(lens))
            assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize(("group", "calls", "asked"), [(1, [2, 2, 1, 1], [1, 2]), (3, [6, 1], [2, 1])])
def test_store_feed_decodes_cachegen_layers_of_every_chunk_together(monkeypatch, tmp_path, setup, group, calls,
                                                                     asked):
    """The device path (Triton rANS decoder, interpreted here; ``group`` layers of every chunk per
    launch), with a chunk without cache, one whose file is corrupt in its last layer and one whose
    stream the decoder rejects in the second launch: each recovered, the rest what the host path gives
    chunk by chunk."""
    from kvrag.codec import cachegen_region

    lm, _, _, kv, _ = setup
    n = lm.spec.n_layers
    kvstore, keys = _store(tmp_path, lm, kv, "cachegen")
    decoded = [kvstore.load(key) for key in keys]
    with StoreFeed(kvstore, keys, LENS, n, "cpu", torch.float32) as host:
        assert host._region_codec is None  # the default off CUDA
        want = [host.layer(layer) for layer in range(n)]
    for layer, (k, v) in enumerate(want):
        assert torch.equal(k, _expected(decoded, layer)[0]) and torch.equal(v, _expected(decoded, layer)[1])
    path = kvstore.store._path(keys[2])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last layer: fails its checksum
    path.write_bytes(bytes(data))
    real, launched = cachegen_region.kernel_codes, []

    def reject_once(codec, batch, device):  # the second launch rejects its first blob (chunk 1's)
        launched.append(batch.meta.shape[0])
        if len(launched) == 2:
            raise cachegen_region.RegionDecodeError(0, "test")
        return real(codec, batch, device)

    monkeypatch.setattr(cachegen_region, "kernel_codes", reject_once)
    recovered = []
    recover = lambda j: recovered.append(j) or decoded[j]  # noqa: E731
    device = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA: Triton's interpreter (conftest)
    with StoreFeed(kvstore, [None, keys[1], keys[2]], LENS, n, device, torch.float32, recover=recover,
                   device_decode=True, workers=2, region_layers=group) as feed:
        assert feed._region_codec is not None
        got = [tuple(t.cpu() for t in feed.layer(layer)) for layer in range(n)]
    assert recovered == asked and launched == calls
    for layer, (k, v) in enumerate(got):
        ek, ev = _expected(decoded, layer, (False, True, True))
        torch.testing.assert_close(k, ek, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-5)


def test_store_feed_wants_layers_in_order(tmp_path, setup):
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    with StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32, depth=1) as feed:
        with pytest.raises(RuntimeError, match="in order"):
            feed.layer(2)


def test_store_feed_recovers_a_missing_chunk_or_raises_without_recovery(tmp_path, setup):
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    kvstore.store.delete(keys[1])
    with pytest.raises(CorruptChunkError, match="missing"):
        StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32)
    asked = []
    recover = lambda j: asked.append(j) or kv[j]  # noqa: E731
    with StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32, recover=recover) as feed:
        k, v = feed.layer(0)
    assert asked == [1]
    assert torch.equal(k, _expected(kv, 0)[0]) and torch.equal(v, _expected(kv, 0)[1])


def test_store_feed_recovers_a_chunk_whose_later_layer_is_corrupt(tmp_path, setup):
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    reader = kvstore.reader(keys[2])
    offset, length, _ = reader.header.layers[2]
    start = reader.header.data_start
    reader.close()
    path = kvstore.store._path(keys[2])
    data = bytearray(path.read_bytes())
    data[start + offset + length // 2] ^= 0x40  # one bit flipped inside layer 2
    path.write_bytes(bytes(data))
    asked = []
    recover = lambda j: asked.append(j) or kv[j]  # noqa: E731
    with StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32, recover=recover) as feed:
        got = [feed.layer(layer) for layer in range(lm.spec.n_layers)]
    assert asked == [2]
    for layer, (k, v) in enumerate(got):
        ek, ev = _expected(kv, layer)
        assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize(("mode", "options"), [("cacheblend", {}), ("probe", {}), ("probe", {"probe_to": 0.5}),
                                               ("attnlink", {"link_tokens": 3}), ("reuse", {})])
def test_fusion_through_a_store_feed_equals_fusion_over_tensors(tmp_path, setup, mode, options):
    """Every stored layer is placed before its layer runs, also those a probe pass stopped short of."""
    lm, prefix, chunks, kv, suffix = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    config = FuseConfig(mode=mode, ratio=0.3, options=options)
    direct = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    feed = StoreFeed(kvstore, keys, LENS, lm.spec.n_layers, "cpu", torch.float32)
    piped = fuse(lm, FusionInput(prefix, chunks, feed, suffix), config)
    assert torch.equal(direct.logits, piped.logits)
    assert direct.n_selected == piped.n_selected and piped.load_wait_s >= 0


def test_fusion_with_a_chunk_without_cache_through_a_feed(tmp_path, setup):
    lm, prefix, chunks, kv, suffix = setup
    kvstore, keys = _store(tmp_path, lm, kv)
    config = FuseConfig(mode="reuse")
    direct = fuse(lm, FusionInput(prefix, chunks, [kv[0], None, kv[2]], suffix), config)
    feed = StoreFeed(kvstore, [keys[0], None, keys[2]], LENS, lm.spec.n_layers, "cpu", torch.float32)
    piped = fuse(lm, FusionInput(prefix, chunks, feed, suffix), config)
    assert torch.equal(direct.logits, piped.logits)
    assert piped.n_selected[0] == LENS[1] + suffix.numel()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_gpu(lm, prefix):
    from kvrag.indexing.kvgen import PrefixCache
    from kvrag.model.loading import wrap_model

    gpu_lm = wrap_model(lm.model.to("cuda"), None, "tiny-gpu")
    return gpu_lm, PrefixCache(prefix.ids.cuda(), [(k.cuda(), v.cuda()) for k, v in prefix.kv])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["disk", "disk-int8", "disk-cachegen", "ram", "gpu"])
def test_gpu_fusion_from_every_tier_matches_cpu_fusion(tmp_path, setup, tier):
    lm, prefix, chunks, kv, suffix = setup
    config = FuseConfig(mode="cacheblend", ratio=0.3)
    n = lm.spec.n_layers
    ref = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    if tier.startswith("disk"):
        codec = tier.partition("-")[2] or "raw"
        kvstore, keys = _store(tmp_path, lm, kv, codec)
        if codec != "raw":  # the reference reads the same lossy caches on the CPU
            ref = fuse(lm, FusionInput(prefix, chunks, StoreFeed(kvstore, keys, LENS, n, "cpu", torch.float32),
                                       suffix), config)
    gpu_lm, gpu_prefix = _on_gpu(lm, prefix)
    try:
        if tier.startswith("disk"):
            source = StoreFeed(kvstore, keys, LENS, n, "cuda", torch.float32, workers=2)
            assert source._planar is not None or source._region_codec is not None
        elif tier == "ram":
            source = TensorFeed([(k.pin_memory(), v.pin_memory()) for k, v in kv], LENS, n, "cuda", torch.float32)
        else:
            source = TensorFeed([(k.cuda(), v.cuda()) for k, v in kv], LENS, n, "cuda", torch.float32)
        got = fuse(gpu_lm, FusionInput(gpu_prefix, chunks, source, suffix), config)
        assert (got.logits.cpu() - ref.logits).abs().max().item() <= 1e-3
    finally:
        lm.model.to("cpu")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reuse", "cacheblend@0.3", "probe@0.3", "probe@1.0", "attnlink@4", "prefix"])
def test_gpu_fusion_of_every_mode_matches_cpu_fusion(setup, mode):
    from kvrag.bench.common import parse_mode

    lm, prefix, chunks, kv, suffix = setup
    config = parse_mode(mode).config
    ref = fuse(lm, FusionInput(prefix, chunks, kv, suffix), config)
    gpu_lm, gpu_prefix = _on_gpu(lm, prefix)
    try:
        source = TensorFeed([(k.cuda(), v.cuda()) for k, v in kv], LENS, gpu_lm.spec.n_layers, "cuda", torch.float32)
        got = fuse(gpu_lm, FusionInput(gpu_prefix, chunks, source, suffix), config)
        assert got.n_selected == ref.n_selected
        assert (got.logits.cpu() - ref.logits).abs().max().item() <= 1e-3
        if mode == "probe@1.0":  # recomputing every token reproduces the full prefill on the GPU too
            exact = fuse(gpu_lm, FusionInput(gpu_prefix, chunks, [None] * len(chunks), suffix), FuseConfig(mode="full"))
            assert (got.logits - exact.logits).abs().max().item() <= 1e-3
    finally:
        lm.model.to("cpu")
