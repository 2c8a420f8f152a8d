"""Stores bounded in bytes (`BoundedDiskStore`, `BoundedRedisStore` on a real ``redis-server``): the bound holds under a
stream of distinct blobs, blobs read again outlive a stream of blobs stored once (segmented LRU) up to the protected
share, several processes share one store without a half-written read, and racing writers of a codec state agree on
one.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import time

import pytest

from kvrag.passages.cache_url import open_cache_store, parse_bytes
from kvrag.storage.stores import BoundedDiskStore, BoundedRedisStore


def _blob(i: int, size: int) -> tuple[str, bytes]:
    """A blob whose first 32 bytes are the sha256 of the rest: a reader tells a whole one from a torn one."""
    body = random.Random(i).randbytes(size)
    return hashlib.sha256(str(i).encode()).hexdigest()[:40], hashlib.sha256(body).digest() + body


def _whole(data: bytes) -> bool:
    return hashlib.sha256(data[32:]).digest() == data[:32]


def _disk_bytes(store: BoundedDiskStore) -> int:
    return sum(p.stat().st_size for p in store.root.glob("*/*.kvc"))


def test_sizes_and_urls_are_parsed_or_refused_in_one_line(tmp_path):
    assert parse_bytes("5GB") == 5 * 10**9 and parse_bytes("1.5 GiB") == 3 * 2**29 and parse_bytes(7) == 7
    for bad in ("5XB", "0", "-1", "many"):
        with pytest.raises(ValueError, match="max_bytes"):
            parse_bytes(bad)
    store = open_cache_store(f"file://{tmp_path}/c?max_bytes=2MB")
    assert isinstance(store, BoundedDiskStore) and store.max_bytes == 2 * 10**6 and store.root == tmp_path / "c"
    assert open_cache_store(str(tmp_path / "d"), max_bytes="1kB").max_bytes == 1000
    with pytest.raises(ValueError, match="cache must be") as err:
        open_cache_store("s3://bucket/x")
    assert "\n" not in str(err.value)
    plain = open_cache_store(f"{tmp_path}/e?max_bytes=3kB&decoded_bytes=0&codec=raw")  # the cache's options aside
    assert plain.max_bytes == 3000 and plain.root == tmp_path / "e"
    with pytest.raises(ValueError, match="the 'file' store takes no option 'max_byte'") as err:
        open_cache_store(f"{tmp_path}/f?max_byte=3kB")  # a misspelt option is refused, not ignored
    assert "\n" not in str(err.value) and not (tmp_path / "f").exists()


def test_the_disk_bound_holds_over_a_thousand_blobs_and_recent_reads_survive(tmp_path):
    store = BoundedDiskStore(tmp_path, max_bytes=200_000, fsync=False)
    hot = [_blob(i, 2000) for i in range(5)]
    for key, data in hot:
        store.put(key, data)
    for i in range(5, 1005):
        key, data = _blob(i, random.Random(-i).randint(500, 8000))
        store.put(key, data)
        assert _disk_bytes(store) <= store.max_bytes
        for hot_key, _ in hot:  # read often: never the least recently used
            fh = store.open(hot_key)
            assert fh is not None, "a blob read after every write was evicted"
            fh.close()
    assert store.evicted > 500 and store.held() == _disk_bytes(store)
    with pytest.raises(ValueError, match="max_bytes"):
        BoundedDiskStore(tmp_path / "x", max_bytes=0)


@pytest.fixture(params=["disk", "redis"])
def bounded(request, tmp_path):
    """A factory of bounded stores sharing one place: a folder, or a flushed Redis database."""
    if request.param == "disk":
        yield lambda max_bytes: BoundedDiskStore(tmp_path, max_bytes=max_bytes, fsync=False)
        return
    import redis

    url = request.getfixturevalue("redis_server").url(db=6)
    redis.Redis.from_url(url).flushdb()
    yield lambda max_bytes: BoundedRedisStore(url, max_bytes=max_bytes, namespace="b:")
    redis.Redis.from_url(url).flushdb()


def _read(store, key: str) -> bool:
    fh = store.open(key)
    if fh is not None:
        fh.close()
    return fh is not None


def test_a_passage_read_again_outlives_a_stream_of_passages_stored_once(bounded):
    store, other = bounded(100_000), bounded(100_000)  # two handles, as two processes would have
    hot = [_blob(i, 2000)[0] for i in range(5)]
    for key in hot:
        store.put(key, bytes(2000))
        store.nbytes(key)  # not a read
        assert store.contains(key)  # nor this
    cold = _blob(99, 2000)[0]
    store.put(cold, bytes(2000))
    for key in hot:
        assert _read(other, key)  # read once, by the other handle
    for i in range(100, 400):  # 600 kB of blobs nobody reads again: an LRU bound keeps none of the hot ones
        store.put(_blob(i, 2000)[0], bytes(2000))
        assert store.held() <= store.max_bytes
    assert all(store.contains(key) for key in hot) and not store.contains(cold)
    segments = store.popularity()
    assert segments["protected_blobs"] == 5 and segments["protected_bytes"] == 5 * 2000
    assert 0 < segments["probation_bytes"] + segments["protected_bytes"] <= store.held()  # disk: at its last scan


def test_blobs_read_again_hold_at_most_the_protected_share_and_the_least_recent_go_back(bounded):
    store = bounded(100_000)
    hot = [_blob(i, 2000)[0] for i in range(45)]  # 90 kB read again: over the protected 80 kB
    for key in hot:
        store.put(key, bytes(2000))
    for key in hot:
        assert _read(store, key)
        time.sleep(0.01)  # distinct last uses, beyond the file system's clock tick
    for i in range(100, 400):
        store.put(_blob(i, 2000)[0], bytes(2000))
    kept = [store.contains(key) for key in hot]
    assert kept == [False] * 5 + [True] * 40  # the five read longest ago went back on probation, then out
    assert store.popularity()["protected_bytes"] == 40 * 2000



def test_a_peek_reads_a_blob_without_counting_a_use(bounded):
    store = bounded(100_000)
    peeked, read = [_blob(i, 2000)[0] for i in range(5)], [_blob(i, 2000)[0] for i in range(5, 10)]
    for key in peeked + read:
        store.put(key, bytes(2000))
    for key in peeked:  # as a blob just stored is read back to be held decoded in memory
        fh = store.peek(key)
        assert fh is not None and fh.read() == bytes(2000)
        fh.close()
    for key in read:
        assert _read(store, key)
    for i in range(100, 400):
        store.put(_blob(i, 2000)[0], bytes(2000))
    assert not any(store.contains(key) for key in peeked)  # never asked for again: out with the stream
    assert all(store.contains(key) for key in read)

def test_a_disk_store_whose_read_record_cannot_be_opened_evicts_least_recently_used(tmp_path, caplog):
    (tmp_path / "protected.sqlite").mkdir()  # not a database
    store = BoundedDiskStore(tmp_path, max_bytes=20_000, fsync=False)
    keys = [_blob(i, 2000)[0] for i in range(30)]
    for key in keys:
        store.put(key, bytes(2000))
        assert _read(store, key) and store.held() <= store.max_bytes
    assert store.contains(keys[-1]) and not store.contains(keys[0])
    assert "not recorded" in caplog.text


def test_a_redis_namespace_kept_in_last_use_order_is_taken_over_by_the_first_put(redis_server):
    import redis

    url = redis_server.url(db=7)
    client = redis.Redis.from_url(url)
    client.flushdb()
    old = [_blob(i, 1000)[0] for i in range(10)]
    for n, key in enumerate(old):  # as an earlier kvrag left it: the blobs, one last-use order, their bytes
        client.set("o:" + key, bytes(1000))
        client.zadd("o:lru", {key: 1000.0 + n})
    client.set("o:bytes", 10_000)
    store = BoundedRedisStore(url, max_bytes=12_000, namespace="o:")
    assert sorted(store.keys()) == sorted(old)
    store.put(_blob(50, 3000)[0], bytes(3000))  # passes the bound: the oldest go first
    assert not client.exists("o:lru") and store.held() <= 12_000
    assert [store.contains(key) for key in old] == [False] * 3 + [True] * 7
    client.flushdb()


def test_a_blob_over_the_bound_is_not_stored(tmp_path):
    store = BoundedDiskStore(tmp_path, max_bytes=1000, fsync=False)
    key, data = _blob(1, 2000)
    store.put(key, data)
    assert not store.contains(key) and _disk_bytes(store) == 0


def _disk_worker(root: str, seed: int, out: multiprocessing.Queue) -> None:
    store = BoundedDiskStore(root, max_bytes=300_000, fsync=False)
    torn = 0
    for n in range(400):
        i = random.Random(seed * 1000 + n).randrange(600)  # both processes write and read the same keys
        key, data = _blob(i, 1000 + (i % 7) * 500)
        store.put(key, data)
        fh = store.open(_blob(random.Random(n).randrange(600), 10)[0])
        if fh is not None:
            with fh:
                torn += not _whole(fh.read())
    out.put(torn)


def test_two_processes_share_a_disk_store_without_a_torn_read(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_disk_worker, args=(str(tmp_path), seed, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    torn = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert torn == [0, 0]
    store = BoundedDiskStore(tmp_path, max_bytes=300_000)
    assert _disk_bytes(store) <= store.max_bytes + 2 * 4000  # at most a blob over per concurrent writer
    assert all(_whole(store.open(k).read()) for k in store.keys())  # type: ignore[union-attr]


def _state_race(root: str, seed: int, out: multiprocessing.Queue) -> None:
    out.put(BoundedDiskStore(root, max_bytes=10_000).put_state("codec-m", f"state {seed}".encode()))


def test_racing_writers_of_a_state_agree_on_one(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_state_race, args=(str(tmp_path), seed, out)) for seed in range(3)]
    for p in procs:
        p.start()
    got = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(30)
    assert len(got) == 1 and BoundedDiskStore(tmp_path, max_bytes=10).get_state("codec-m") in got
    assert not list((tmp_path / "state").glob(".*")), "a temporary file was left behind"


def _redis_worker(url: str, seed: int, out: multiprocessing.Queue) -> None:
    store = BoundedRedisStore(url, max_bytes=200_000, namespace="t:")
    for n in range(300):
        key, data = _blob(seed * 10_000 + n, 1000 + n % 9 * 400)
        store.put(key, data)
    out.put(store.evicted)


def test_the_redis_bound_holds_across_processes(redis_server):
    import redis

    url = redis_server.url(db=3)
    client = redis.Redis.from_url(url)
    client.flushdb()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_redis_worker, args=(url, seed, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    evicted = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    store = BoundedRedisStore(url, max_bytes=200_000, namespace="t:")
    blobs = list(store.keys())
    held = sum(store.sizes(blobs))
    assert held == store.held() <= store.max_bytes and sum(evicted) > 0 and len(blobs) < 600
    assert all(_whole(store.open(k).read()) for k in blobs)  # type: ignore[union-attr]
    assert store.put_state("codec-m", b"first") == b"first" and store.put_state("codec-m", b"second") == b"first"
    key, data = blobs[0], store.open(blobs[0]).read()  # type: ignore[union-attr]
    store.delete(key)
    assert store.held() == held - len(data) and not store.contains(key)
    client.flushdb()


def test_a_redis_cache_url_carries_its_bound_and_redis_py_options(redis_server):
    store = open_cache_store(redis_server.url(db=4) + "?max_bytes=1MB&socket_keepalive=true&decoded_bytes=0")
    assert isinstance(store, BoundedRedisStore) and store.max_bytes == 10**6
    store.ping()


def test_a_bounded_redis_index_store_reports_its_bytes_through_its_local_cache(redis_server, tmp_path):
    from kvrag.codec import make_codec
    from kvrag.storage.kvstore import KVStore
    from kvrag.storage.stores.index_store import open_index_store

    url = redis_server.url(db=5)
    store = open_index_store(tmp_path, {"store": {"url": url, "max_bytes": 300_000}, "fingerprint": "f" * 16})
    assert store.max_bytes != 300_000  # the local cache's own bound is not the store's
    store.put("a", b"x" * 1000)
    stats = KVStore(store, make_codec("raw"), "f" * 16).stats()
    assert stats["held_bytes"] == 1000 and stats["max_bytes"] == 300_000
    store.close()
