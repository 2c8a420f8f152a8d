"""The decoded tier (`kvrag.storage.decoded_tier`, `kvrag.loading.tiered_feed`): hot chunk caches kept decoded in
memory give exactly what reading and decoding them gives, are neither read nor decoded again, stay within their
bound, keep their blobs recently used in a store that evicts by use, and a passage stored after an answer is fused
from memory on the next call with the answer a cold read gives.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from test_feed import LENS, _store
from test_fuse import _setup
from test_passage_cache import PASSAGES

from kvrag.config import StoreConfig
from kvrag.loading.feed import StoreFeed, TieredFeed, open_tiered
from kvrag.passages import PassageCache, find_passages
from kvrag.passages.cache_url import memory_bound, open_cache_store
from kvrag.query.head_cache import DEFAULT_PROMPT_BYTES
from kvrag.query.locate import chat_prompt
from kvrag.storage.decoded_tier import DEFAULT_DECODED_BYTES, DecodedTier
from kvrag.storage.stores import BoundedDiskStore, BoundedRedisStore


@pytest.fixture(scope="module")
def setup():
    return _setup("llama", seed=5, lens=LENS)


def _kv(n: int, fill: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, 1, n, 4), fill), torch.full((2, 1, n, 4), -fill)


def test_the_tier_keeps_the_most_recent_entries_within_its_bound():
    tier = DecodedTier(max_bytes=3 * 2 * 2 * 10 * 4 * 4)  # three 10-row entries of float32 [2, 1, 10, 4] K and V
    keys = [tier.key(f"k{i}", None, 0, 10, torch.float32) for i in range(4)]
    for key in keys[:3]:
        tier.put(key, _kv(10))
    assert tier.get(keys[0]) is not None  # used: no longer the least recent
    tier.put(keys[3], _kv(10))
    assert tier.get(keys[1]) is None and all(tier.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    assert tier.nbytes <= tier.max_bytes and len(tier) == 3
    assert tier.stats() == {"decoded_hits": 4, "decoded_misses": 1, "decoded_entries": 3,
                            "decoded_bytes": 3 * 640, "decoded_max_bytes": 1920}
    assert tier.key("k", None, 0, 10, torch.float32) != tier.key("k", None, 2, 10, torch.float32)  # other rows
    with pytest.raises(ValueError, match="decoded tier entry"):
        tier.put(keys[0], _kv(9))
    off = DecodedTier(0)
    off.put(keys[0], _kv(10))
    assert off.get(keys[0]) is None and off.nbytes == 0


def test_a_cache_url_bounds_the_tier_and_keeps_the_option_from_redis(tmp_path):
    assert memory_bound(None, "decoded_bytes") == DEFAULT_DECODED_BYTES
    assert memory_bound(f"file://{tmp_path}/c", "decoded_bytes") == DEFAULT_DECODED_BYTES
    assert memory_bound(f"file://{tmp_path}/c?max_bytes=1GB&decoded_bytes=2MiB", "decoded_bytes") == 2 << 20
    assert memory_bound(f"file://{tmp_path}/c?decoded_bytes=0", "decoded_bytes") == 0
    with pytest.raises(ValueError, match="decoded_bytes must be a size"):
        memory_bound(f"file://{tmp_path}/c?decoded_bytes=lots", "decoded_bytes")
    assert memory_bound(f"file://{tmp_path}/c?decoded_bytes=1MB", "prompt_bytes") == DEFAULT_PROMPT_BYTES
    assert memory_bound("redis://h:1/0?prompt_bytes=1kB&prompt_bytes=2kB", "prompt_bytes") == 2000
    with pytest.raises(ValueError, match="prompt_bytes must be a size"):
        memory_bound(f"file://{tmp_path}/c?prompt_bytes=-1", "prompt_bytes")
    assert open_cache_store(f"file://{tmp_path}/c?decoded_bytes=1MB").root == tmp_path / "c"
    assert StoreConfig.decoded_bytes_of(None) == StoreConfig.decoded_bytes_of("disk") == DEFAULT_DECODED_BYTES
    assert StoreConfig.decoded_bytes_of(StoreConfig(decoded_bytes=0)) == 0  # an index's tier, off
    assert StoreConfig.decoded_bytes_of(StoreConfig(decoded_bytes="64MiB")) == 64 << 20
    with pytest.raises(ValueError, match="StoreConfig.decoded_bytes must be >= 0"):
        StoreConfig(decoded_bytes=-1)
    with pytest.raises(ValueError, match="StoreConfig.cache_bytes must be a size such as"):
        StoreConfig(cache_bytes="lots")
    with pytest.warns(DeprecationWarning, match="decoded_mb is deprecated; give decoded_bytes"):  # MiB, as before
        assert StoreConfig(decoded_mb=2, cache_mb=0.5) == StoreConfig(decoded_bytes="2MiB", cache_bytes=1 << 19)


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
def test_a_tiered_feed_gives_what_the_store_gives_and_reads_held_chunks_from_memory(tmp_path, setup, codec):
    lm, _, _, kv, _ = setup
    kvstore, keys = _store(tmp_path, lm, kv, codec)
    keys = [keys[0], None, keys[2]]  # a chunk without a cache between two stored ones
    n_layers, dtype = lm.spec.n_layers, torch.float32
    opened: list[list[str | None]] = []

    def open_store(read: list[str | None]) -> StoreFeed:
        opened.append(read)
        return StoreFeed(kvstore, read, LENS, n_layers, "cpu", dtype)

    def feed() -> TieredFeed:
        made = open_tiered(kvstore.decoded, keys, [None] * 3, [0] * 3, LENS, n_layers, torch.device("cpu"), dtype,
                           open_store, kvstore.touch)
        assert isinstance(made, TieredFeed)
        return made

    with StoreFeed(kvstore, keys, LENS, n_layers, "cpu", dtype) as plain:
        expected = [plain.layer(i) for i in range(n_layers)]
    for round_ in range(2):  # the first reads the store and fills the tier; the second reads memory alone
        with feed() as tiered:
            assert tiered.available == [True, False, True] and tiered.from_memory == 2 * round_
            for i, (k, v) in enumerate(expected):
                got = tiered.layer(i)
                assert torch.equal(got[0], k) and torch.equal(got[1], v), (round_, i)
    assert opened == [keys] and len(kvstore.decoded) == 2 and kvstore.decoded.hits == 2
    kvstore.decoded.clear()
    kvstore.decoded.put(kvstore.decoded.key(keys[0], None, 0, LENS[0], dtype),
                        (torch.stack([k[:, : LENS[0]] for k, _ in expected]),
                         torch.stack([v[:, : LENS[0]] for _, v in expected])))
    with feed() as tiered:  # one held, one read: side by side as the store gives them
        for i, (k, v) in enumerate(expected):
            got = tiered.layer(i)
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert opened[-1] == [None, None, keys[2]]
    off = DecodedTier(0)
    assert isinstance(open_tiered(off, keys, [None] * 3, [0] * 3, LENS, n_layers, torch.device("cpu"), dtype,
                                  open_store), StoreFeed)


@pytest.mark.parametrize("backend", ["disk", "redis"])
def test_a_read_from_memory_keeps_its_blob_recently_used_in_the_store(request, tmp_path, backend):
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        store = BoundedRedisStore(server.url(db=5), max_bytes=10_000, namespace="touch:")
        store._client.flushdb()
    else:
        store = BoundedDiskStore(tmp_path, max_bytes=10_000, fsync=False)
    for i in range(3):
        store.put(f"{i:040x}", bytes(3000))
        time.sleep(0.01)  # distinct times of use
    store.touch(f"{0:040x}")  # as a tier hit does: the oldest blob becomes the newest
    store.touch("f" * 40)  # absent: nothing
    store.put(f"{3:040x}", bytes(3000))
    assert store.contains(f"{0:040x}") and not store.contains(f"{1:040x}")
    assert not store.contains("f" * 40)


def _answers(cache: PassageCache, prompt: str, passages: list[str]) -> list[int]:
    return cache.answer_prompt(prompt, "probe", passages=passages, max_new_tokens=8).token_ids


def test_a_passage_stored_after_an_answer_is_fused_from_memory_as_from_its_blob(tiny_lm, tmp_path: Path):
    url = f"file://{tmp_path}/cache?max_bytes=50MB"
    raw = "Question: Who designed the alpha reactor?\nContext: " + "\n\n".join(PASSAGES) + "\nAnswer:"
    prompt, passages = chat_prompt(tiny_lm.tokenizer, raw), find_passages(raw)
    with PassageCache(tiny_lm, open_cache_store(url)) as warm:
        warm.answer_prompt(prompt, passages=passages, max_new_tokens=1)  # a full prefill; the caches stored after
        assert warm.flush(60) and len(warm.kvstore.decoded) == 3  # and kept decoded
        read = warm.kvstore.found
        hot = _answers(warm, prompt, passages)
        assert warm.kvstore.found == read and warm.kvstore.decoded.hits == 3  # no blob read
        assert warm.info()["decoded_bytes"] > 0
    with PassageCache(tiny_lm, open_cache_store(url), decoded_bytes=0) as cold:
        assert _answers(cold, prompt, passages) == hot and cold.kvstore.found == 3 and len(cold.kvstore.decoded) == 0
