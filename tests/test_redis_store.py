"""Chunk caches in a shared Redis, chosen by URL: a real ``redis-server`` (the ``redis_server`` fixture), the tiny
random model, the lossless ``raw`` codec where answers and bytes are compared.

An index built into Redis keeps no cache files and answers as the same index on disk; the URL is recorded and
can be overridden; the local cache is bounded in bytes and serves hits; two builders at once lose nothing; with
the server unreachable (killed, hung, a closed port, a wrong password) the answers still come, computed from
the chunks' text, with one warning and never the password, and the chunks are stored again once it is back; a
damaged blob is caught by its checksum and replaced. The registry builds the store from its URL; ``kvrag verify``,
``kvrag repair`` and ``kvrag info`` read the caches in Redis; an unreachable store is told apart from a missing chunk.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from kvrag import KVRag, SplitConfig, StoreConfig
from kvrag.cli import build_parser, main
from kvrag.cli.common import store_arg
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.decoded_tier import DecodedTier
from kvrag.storage.stores import CachedStore, DiskStore, RedisStore, StoreUnavailableError, open_index_store

SPLIT = SplitConfig(mode="fixed", max_tokens=32, min_tokens=4)
TOPICS = ["reactor", "station", "river", "forest", "bridge", "harbour", "tower", "canal"]
DOCS = [(f"d{i}", f"Ada {i} keeps the {t}; it has {i * 5} lamps.") for i, t in enumerate(TOPICS)]  # a chunk each
QUESTIONS = ["Who keeps the reactor?", "How many lamps does the canal hold?"]
MODES = ("reuse", "full")  # reuse: the stored caches as they are; full: everything from the text
SECRET = "s3cret-Pa55"


def _answers(rag: KVRag) -> dict[tuple[str, str], list[int]]:
    return {(q, m): rag.answer(q, k=2, mode=m, max_new_tokens=4).token_ids for q in QUESTIONS for m in MODES}


def _client(url: str):
    import redis

    return redis.Redis.from_url(url)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvrag")]


def _build(docs, path: Path, lm, store=None) -> KVRag:
    # one chunk per prefill, as a recompute does, so that a recomputed cache is the same bytes
    return KVRag.build(docs, path, model=lm, split=SPLIT, codec="raw", batch_tokens=1, show_progress=False,
                       store=store)


@pytest.fixture(scope="module")
def built(redis_server, tiny_lm, tmp_path_factory: pytest.TempPathFactory):
    """The same raw index in Redis (database 0) and on disk, with the answers of the one on disk, and the one in
    Redis opened.
    """
    tmp = tmp_path_factory.mktemp("redis-index")
    disk = _build(DOCS, tmp / "disk", tiny_lm)
    expected = _answers(disk)
    disk.close()
    rag = _build(DOCS, tmp / "redis", tiny_lm, store=redis_server.url())
    rag.kvstore.decoded = DecodedTier(0)  # every answer reads the store (no chunk fused from decoded memory)
    yield tmp / "redis", tmp / "disk", expected, rag
    rag.close()


def test_an_index_in_redis_keeps_no_cache_files_and_answers_as_on_disk(built, redis_server):
    path, disk, expected, rag = built
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith("chunks.sqlite")) == [
        "index.lock", "manifest.json", "vectors.faiss", "writer.lock"]
    assert not (path / "chunks").exists() and not list(path.rglob("*.kvc"))
    record = json.loads((path / "manifest.json").read_text())["store"]
    assert record["url"] == redis_server.url()
    assert record["namespace"].startswith(f"kvrag:{rag.lm.fingerprint[:16]}:")
    assert isinstance(rag.kvstore.store, CachedStore) and rag.kvstore.store.label == redis_server.url()
    client = _client(redis_server.url())
    keys = list(rag.index.keys())
    assert {k.decode() for k in client.scan_iter(match=record["namespace"] + "*")} == {
        record["namespace"] + k for k in keys}
    for key in keys:  # the same bytes as the disk store's files (raw codec)
        assert client.get(record["namespace"] + key) == (disk / "chunks" / key[:2] / f"{key}.kvc").read_bytes()
    rag.kvstore.store.clear()
    assert _answers(rag) == expected


def test_the_url_is_recorded_and_can_be_overridden(built, redis_server, tiny_lm, caplog):
    path, _, expected, rag = built
    other = f"redis://localhost:{redis_server.port}/0"  # another URL for the same caches
    caplog.set_level(logging.INFO)
    with KVRag.open(path, model=tiny_lm, store=other) as opened:
        store = opened.kvstore.store
        assert isinstance(store, CachedStore) and store.label == other
        assert _answers(opened) == expected
        assert store.misses > 0 and not store.pending
    assert not _warnings(caplog)  # every cache was found there: nothing computed from text
    recorded = open_index_store(path, rag.manifest, StoreConfig(cache_bytes=1 << 20))  # backend "disk": the index's own
    assert isinstance(recorded, CachedStore) and recorded.label == redis_server.url()
    assert recorded.max_bytes == 1 << 20
    recorded.close()
    elsewhere = open_index_store(path, rag.manifest, (path.parent / "copy").as_uri())  # a local store by URL
    assert isinstance(elsewhere, DiskStore) and elsewhere.root == path.parent / "copy"


def test_the_local_cache_is_bounded_in_bytes_and_serves_hits(redis_server, built):
    remote = RedisStore(redis_server.url(), namespace="kvrag:test-cache:")
    cache = CachedStore(remote, max_bytes=10_000, label="test")
    keys = [f"{i:040x}" for i in range(8)]
    for i, key in enumerate(keys):
        cache.put(key, bytes([i]) * 3000)
        assert cache.cached_bytes <= 10_000
    assert cache.cached_bytes == 9000  # the three most recent
    _client(redis_server.url()).delete("kvrag:test-cache:" + keys[-1])  # a hit needs no round trip
    assert cache.open(keys[-1]).read() == bytes([7]) * 3000 and (cache.hits, cache.misses) == (1, 0)
    assert cache.open(keys[0]).read() == bytes([0]) * 3000 and cache.misses == 1  # evicted: fetched again
    assert cache.open(keys[0]) is not None and cache.hits == 2  # and now held (the least recent went)
    assert keys[5] not in cache._hot and cache.cached_bytes == 9000
    cache.put("ff" * 20, b"x" * 20_000)  # larger than the bound: stored, never cached
    assert cache.cached_bytes <= 10_000 and remote.nbytes("ff" * 20) == 20_000
    cache.close()

    _, _, expected, rag = built
    store = rag.kvstore.store
    assert isinstance(store, CachedStore)
    store.clear()
    first = rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids
    misses, hits = store.misses, store.hits
    assert rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids == first
    assert store.misses == misses and store.hits == hits + 2 and 0 < store.cached_bytes <= store.max_bytes
    assert first == expected[(QUESTIONS[0], "reuse")]


def _writer(url: str, namespace: str, first: int, go) -> None:
    go.wait(60)
    store = RedisStore(url, namespace=namespace)
    for i in range(first, first + 300):  # keys 100..299 are written by both, with the same bytes
        store.put(f"{i:040x}", f"{i}".encode() * (1 + i % 50))


def _builder(path: Path, lm, url: str, docs, go) -> None:
    import torch

    import kvrag.indexing.build as b

    torch.set_num_threads(1)  # a forked child: no thread pool of the parent's to wait on
    b.GROUP_CHUNKS = 1  # many small groups, interleaved with the other builder's
    go.wait(60)
    KVRag.build(docs, path, model=lm, split=SPLIT, codec="raw", batch_tokens=1, show_progress=False, store=url).close()


def _at_once(target, jobs: list[tuple]) -> None:
    """``target(*job, go)`` in one forked process per job, all let go at once; each must succeed."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=target, args=(*job, go)) for job in jobs]
    for proc in procs:
        proc.start()
    go.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0


def test_two_writers_at_once_lose_nothing(redis_server, built, tiny_lm, tmp_path):
    url = redis_server.url(db=2)
    _at_once(_writer, [(url, "kvrag:shared:", 0), (url, "kvrag:shared:", 100)])
    client = _client(url)
    for i in range(400):
        assert client.get(f"kvrag:shared:{i:040x}") == f"{i}".encode() * (1 + i % 50)

    # two builders of two indexes in one database at once: every chunk of each stored whole, in its namespace
    _at_once(_builder, [(tmp_path / "a", tiny_lm, url, DOCS[:6]), (tmp_path / "b", tiny_lm, url, DOCS[2:])])
    disk = built[1]
    namespaces = set()
    for w in "ab":
        with ChunkIndex.open(tmp_path / w) as index:
            namespace = index.manifest["store"]["namespace"]
            keys = list(index.keys())
        namespaces.add(namespace)
        assert len(keys) == 6
        assert {k.decode() for k in client.scan_iter(match=namespace + "*")} == {namespace + k for k in keys}
        for key in keys:  # whole, and the very bytes of an undisturbed build
            assert client.get(namespace + key) == (disk / "chunks" / key[:2] / f"{key}.kvc").read_bytes()
    assert len(namespaces) == 2


def test_an_unreachable_store_answers_from_text_with_one_warning(built, tiny_lm, caplog):
    path, _, expected, _ = built
    url = f"redis://:{SECRET}@127.0.0.1:{_closed_port()}/0"
    caplog.set_level(logging.INFO)
    t0 = time.perf_counter()
    with KVRag.open(path, model=tiny_lm, store=url) as rag:
        assert _answers(rag) == expected
        pending = rag.kvstore.store.pending
        used = {c.key for q in QUESTIONS for c in rag.retrieve(q, k=2)}
    assert time.perf_counter() - t0 < 30
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "is unreachable" in warned[0] and "redis://:***@127.0.0.1:" in warned[0]
    assert SECRET not in caplog.text
    assert set(pending) == used  # the chunks of both questions, computed from text, waiting for the store
    with pytest.raises(StoreUnavailableError) as exc:
        RedisStore(url, retries=1).ping()
    assert SECRET not in str(exc.value) and "redis://:***@127.0.0.1" in str(exc.value)


def test_a_server_killed_or_hung_midway_then_back(redis_server, tiny_lm, tmp_path, caplog):
    server = type(redis_server)().start()
    try:
        rag = _build(DOCS[:4], tmp_path / "idx", tiny_lm, store=server.url())
        expected = {q: rag.answer(q, k=2, mode="reuse", max_new_tokens=4).token_ids for q in QUESTIONS}
        rag.close()
        config = StoreConfig(cache_bytes=0, retry_after_s=0.2, timeout_s=0.5, connect_timeout_s=0.5, decoded_bytes=0)
        caplog.set_level(logging.INFO)
        with KVRag.open(tmp_path / "idx", model=tiny_lm, store=config) as rag:
            store = rag.kvstore.store
            assert isinstance(store, CachedStore)

            def ask(q: str) -> list[int]:
                return rag.answer(q, k=2, mode="reuse", max_new_tokens=4).token_ids

            assert ask(QUESTIONS[0]) == expected[QUESTIONS[0]] and not _warnings(caplog)
            server.stop()  # killed: its data is gone with it
            assert ask(QUESTIONS[0]) == expected[QUESTIONS[0]]
            assert ask(QUESTIONS[1]) == expected[QUESTIONS[1]]
            assert len(_warnings(caplog)) == 1  # one outage, one warning, however many chunks
            pending = store.pending
            assert len(pending) >= 2
            server.start()  # back, empty, on the same port
            time.sleep(0.3)
            assert not store.contains("0" * 40)  # the first command that reaches it stores what waited
            assert not store.pending
            client = _client(server.url())
            namespace = rag.manifest["store"]["namespace"]
            assert all(client.exists(namespace + k) for k in pending)
            assert all(rag.kvstore.is_valid(k) for k in pending)

            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)  # hung: connections are accepted, nothing answers
            try:
                t0 = time.perf_counter()
                assert ask(QUESTIONS[0]) == expected[QUESTIONS[0]]
                assert time.perf_counter() - t0 < 10
            finally:
                server.proc.send_signal(signal.SIGCONT)
            warned = _warnings(caplog)
            assert len(warned) == 2 and "TimeoutError" in warned[1], warned
    finally:
        server.stop()


def test_a_damaged_blob_is_caught_by_its_checksum_and_replaced(built, redis_server, caplog):
    _, _, expected, rag = built
    key = rag.retrieve(QUESTIONS[0], k=2)[1].key
    name = rag.manifest["store"]["namespace"] + key
    client = _client(redis_server.url())
    good = client.get(name)
    assert good is not None
    bad = bytearray(good)
    bad[-5] ^= 0xFF  # a bit flip in the last layer
    client.set(name, bytes(bad))
    rag.kvstore.store.clear()
    caplog.set_level(logging.WARNING)
    assert rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids == expected[(QUESTIONS[0], "reuse")]
    warned = _warnings(caplog)
    assert len(warned) == 1 and "checksum mismatch" in warned[0] and key in warned[0], warned
    assert client.get(name) == good  # computed again from the text and stored again: the same bytes


def test_a_password_is_used_but_never_recorded_or_shown(redis_server, tiny_lm, tmp_path, caplog, monkeypatch,
                                                        capsys):
    server = type(redis_server)("--requirepass", SECRET).start()
    monkeypatch.delenv("KVRAG_REDIS_PASSWORD", raising=False)
    try:
        rag = _build(DOCS[:3], tmp_path / "idx", tiny_lm, store=server.url(password=SECRET))
        expected = rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids
        assert rag.manifest["store"]["url"] == server.url()
        rag.close()
        assert SECRET not in (tmp_path / "idx" / "manifest.json").read_text()
        assert SECRET.encode() not in (tmp_path / "idx" / "chunks.sqlite").read_bytes()

        caplog.set_level(logging.INFO)
        with KVRag.open(tmp_path / "idx", model=tiny_lm) as rag:  # no password: refused, answered from text
            assert rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids == expected
            warned = _warnings(caplog)
            assert len(warned) == 1 and server.url() in warned[0], warned
            caplog.clear()
            monkeypatch.setenv("KVRAG_REDIS_PASSWORD", SECRET)  # the recorded URL, the password from here
            rag.kvstore.store.close()
            rag.kvstore.store = open_index_store(tmp_path / "idx", rag.manifest, StoreConfig(cache_bytes=0))
            assert rag.answer(QUESTIONS[0], k=2, mode="reuse", max_new_tokens=4).token_ids == expected
            assert not _warnings(caplog) and rag.kvstore.store.misses > 0
        with pytest.raises(StoreUnavailableError) as exc:
            RedisStore(server.url(password="wrong-" + SECRET)).ping()
        assert "redis://:***@127.0.0.1" in str(exc.value) and SECRET not in str(exc.value)
        assert SECRET not in caplog.text

        docs = tmp_path / "docs"
        docs.mkdir()
        (docs / "a.txt").write_text("A document.")
        closed = f"redis://:{SECRET}@127.0.0.1:{_closed_port()}/0"
        assert main(["index", str(docs), "--index", str(tmp_path / "cli"), "--store", closed, "-q"]) == 2
        err = capsys.readouterr().err
        assert "is unreachable" in err and SECRET not in err and not (tmp_path / "cli").exists()
    finally:
        server.stop()


def test_the_commands_take_the_store_url(redis_server, tiny_model_dir, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(" ".join(text for _, text in DOCS[:4]))
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "--codec", "raw",
                 "--store", redis_server.url(db=3), "--split", "fixed", "--max-tokens", "32", "--min-tokens", "4",
                 "-q"]) == 0
    out = capsys.readouterr().out
    assert f"the caches are in {redis_server.url(db=3)}" in out and not (idx / "chunks").exists()
    assert main(["ask", str(idx), QUESTIONS[0], "--mode", "reuse", "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["answer"] is not None
    assert "missing" not in captured.err and "unreachable" not in captured.err  # found through the manifest
    other = f"redis://localhost:{redis_server.port}/3"
    args = build_parser().parse_args(["ask", str(idx), "q", "--store", other, "--store-cache-bytes", "8MiB"])
    assert store_arg(args) == StoreConfig(backend=other, cache_bytes=8 << 20)
    args = build_parser().parse_args(["ask", str(idx), "q", "--store", other, "--store-cache-mb", "8"])  # as before
    assert store_arg(args) == StoreConfig(backend=other, cache_bytes=8 << 20)
    assert store_arg(build_parser().parse_args(["ask", str(idx), "q", "--store", other])) == other
    assert store_arg(build_parser().parse_args(["ask", str(idx), "q", "--decoded-bytes", "0"])) == StoreConfig(
        decoded_bytes=0)


def test_without_redis_py_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install kvrag\[redis\]"):
        open_index_store(tmp_path, {}, "redis://127.0.0.1:6379/0")


def test_the_registry_builds_a_network_store_from_its_url(redis_server):
    from kvrag.storage.stores import make_store, network_class, store_class

    assert store_class("redis") is RedisStore and store_class("REDISS") is RedisStore
    assert network_class(redis_server.url()) is RedisStore and network_class("file:///x") is None
    with pytest.raises(ValueError, match="unknown store"):
        store_class("nope")
    store = make_store(redis_server.url(db=5), namespace="kvrag:by-url:")
    assert isinstance(store, RedisStore) and store.namespace == "kvrag:by-url:"
    store.put("ab" * 20, b"xyz")
    assert store.sizes(["ab" * 20, "cd" * 20]) == [3, 0] and list(store.keys()) == ["ab" * 20]
    store.close()
    assert isinstance(make_store("redis://cache-host:6379/0"), RedisStore)  # no connection until a command
    with pytest.raises(ValueError, match="located by its URL"):
        make_store(redis_server.url(), "/tmp/x")


def test_verify_info_and_repair_read_the_caches_in_redis(redis_server, tiny_lm, tmp_path, capsys):
    from kvrag.cli.info import describe
    from kvrag.repair import repair_index

    url = redis_server.url(db=4)
    rag = _build(DOCS[:4], tmp_path / "idx", tiny_lm, store=url)
    keys, namespace = list(rag.index.keys()), rag.manifest["store"]["namespace"]
    rag.close()
    client = _client(url)
    report = KVRag.verify(tmp_path / "idx")
    assert report.ok and report.caches_checked == len(keys) == 4 and report.caches_missing == 0
    info = describe(tmp_path / "idx")
    stored = sum(client.strlen(namespace + k) for k in keys)
    assert info["bytes"]["caches"] == stored > 0 and info["store"] == url

    good = client.get(namespace + keys[1])
    client.set(namespace + keys[1], good[:-7])  # truncated
    client.delete(namespace + keys[2])  # missing: computed on first use, no damage
    assert main(["verify", str(tmp_path / "idx")]) == 1
    assert "1 of 3 chunk caches are damaged" in capsys.readouterr().out
    fixed = repair_index(tmp_path / "idx", model=tiny_lm)
    assert fixed.ok and client.get(namespace + keys[1]) == good
    assert any(line.startswith(url) for line in fixed.rebuilt)

    closed = f"redis://127.0.0.1:{_closed_port()}/0"
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    manifest["store"]["url"] = closed
    from kvrag.storage.integrity import write_manifest

    write_manifest(tmp_path / "idx" / "manifest.json", {k: v for k, v in manifest.items() if k != "checksum"})
    away = KVRag.verify(tmp_path / "idx")
    assert not away.ok and "cannot be checked" in away.problems[0].what and away.problems[0].file == closed


def test_an_unreachable_store_is_told_apart_from_a_missing_chunk(tiny_lm, built, caplog):
    from kvrag.errors import ChunkUnavailableError, CorruptChunkError

    path, _, _, rag = built
    key = next(iter(rag.index.keys()))
    with pytest.raises(CorruptChunkError) as missing:
        rag.kvstore.load("0" * 40)
    assert not isinstance(missing.value, ChunkUnavailableError)
    caplog.set_level(logging.DEBUG)
    with KVRag.open(path, model=tiny_lm, store=f"redis://127.0.0.1:{_closed_port()}/0") as away:
        with pytest.raises(ChunkUnavailableError, match="unreachable"):
            away.kvstore.load(key)
        away.load_chunk(away.resolve_chunks([key])[0])
    warned = _warnings(caplog)
    assert len(warned) == 1 and "is unreachable" in warned[0], warned
    assert any(r.levelno == logging.DEBUG and "recomputing it from its text" in r.getMessage()
               for r in caplog.records)
