"""Byte stores registered by name: the factory's names, aliases, URLs and paths, and registering a store."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

import pytest

from kvrag.config import StoreConfig
from kvrag.storage.stores import (
    BoundedDiskStore,
    ByteStore,
    DiskStore,
    MemoryStore,
    ThrottledStore,
    available_stores,
    make_store,
    register_store,
)
from kvrag.storage.stores import base as stores_base

KEY = "ab" * 20


def test_available_stores_lists_names_and_aliases():
    assert {"file", "disk", "memory", "throttled"} <= set(available_stores())
    assert available_stores() == sorted(available_stores())


@pytest.mark.parametrize("name", ["disk", "file", "DISK"])
def test_disk_store_by_name_and_alias(tmp_path: Path, name: str):
    store = make_store(name, tmp_path / "c", fsync=False)
    assert isinstance(store, DiskStore) and store.root == tmp_path / "c" and not store.fsync
    assert DiskStore.name == "file"
    store.put(KEY, b"xyz")
    assert (tmp_path / "c" / "ab" / f"{KEY}.kvc").read_bytes() == b"xyz"
    assert store.nbytes(KEY) == 3 and store.contains(KEY)


def test_store_config_fields_build_the_store(tmp_path: Path):
    config = StoreConfig()
    store = make_store(config.backend, tmp_path, fsync=config.fsync)
    assert isinstance(store, DiskStore) and store.fsync is True


def test_file_url_and_plain_paths_name_the_disk_store(tmp_path: Path):
    by_url = make_store((tmp_path / "a b").as_uri(), fsync=False)
    assert isinstance(by_url, DiskStore) and by_url.root == tmp_path / "a b"
    assert make_store(f"file://localhost{tmp_path}/u").root == tmp_path / "u"  # type: ignore[attr-defined]
    for path in (str(tmp_path / "p"), tmp_path / "q"):
        store = make_store(path, fsync=False)
        assert isinstance(store, DiskStore) and store.root == Path(path)


def test_memory_store_by_name_and_url():
    for backend in ("memory", "memory://"):
        store = make_store(backend)
        assert isinstance(store, MemoryStore)
        store.put(KEY, b"1")
        assert store.open(KEY).read() == b"1"  # type: ignore[union-attr]
    assert make_store("memory").contains(KEY) is False


@pytest.mark.parametrize(("backend", "root", "match"), [
    ("memroy", None, "unknown store backend"),
    ("s3://bucket/x", None, "unknown store URL scheme"),
    ("file://otherhost/x", None, "only local"),
    ("file:///x?y=1", None, "the 'file' store takes no option 'y' \\(it takes max_bytes\\)"),
    ("file:///x?max_bytes=lots", None, "max_bytes must be a size"),
    ("memory://?max_bytes=1GB", None, "the 'memory' store takes no option 'max_bytes' \\(it takes none\\)"),
    ("file:///x#part", None, "fragments"),
    ("file:///x", "/y", "already names its location"),
    ("disk", None, "needs a root"),
    ("throttled", "/tmp/never", "needs bytes_per_s"),
])
def test_make_store_refuses(backend: str, root: str | None, match: str):
    with pytest.raises(ValueError, match=match):
        make_store(backend, root)


def test_a_url_option_opens_a_bounded_store_and_a_keyword_overrides_it(tmp_path: Path):
    store = make_store(tmp_path.as_uri() + "?max_bytes=2MB", fsync=False)
    assert isinstance(store, BoundedDiskStore) and store.max_bytes == 2 * 10**6 and store.root == tmp_path
    assert make_store(tmp_path.as_uri() + "?max_bytes=2MB", max_bytes="1kB").max_bytes == 1000
    assert make_store(tmp_path.as_uri() + "?max_bytes=2MB", max_bytes=None).max_bytes == 2 * 10**6  # None: the URL's
    assert make_store("disk", tmp_path, max_bytes=5000).max_bytes == 5000  # a bound by keyword, the same kind
    assert type(make_store(tmp_path.as_uri())) is DiskStore
    with pytest.raises(ValueError, match="'memory' store has no bound in bytes"):
        make_store("memory", max_bytes=10)


def test_throttled_store_takes_its_options_from_its_url(tmp_path: Path):
    store = make_store(f"throttled://{tmp_path}?bytes_per_s=2e9&inner=file", fsync=False)
    assert isinstance(store, ThrottledStore) and store.bytes_per_s == 2e9 and isinstance(store.inner, DiskStore)


def test_a_redis_url_refuses_an_option_before_connecting():
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="takes no option 'bogus' \\(it takes max_bytes and its client's") as err:
        make_store("redis://:secret@127.0.0.1:1/0?bogus=1")
    assert "secret" not in str(err.value)


def test_throttled_store_by_name_wraps_an_inner_store(tmp_path: Path):
    store = make_store("throttled", tmp_path, fsync=False, bytes_per_s=1e9)
    assert isinstance(store, ThrottledStore) and isinstance(store.inner, DiskStore) and not store.inner.fsync
    in_memory = make_store("throttled", bytes_per_s=1e9, inner="memory")
    assert isinstance(in_memory, ThrottledStore) and isinstance(in_memory.inner, MemoryStore)
    in_memory.put(KEY, b"abc")
    fh = in_memory.open(KEY)
    assert fh is not None and fh.read() == b"abc"


def test_register_store_adds_a_name_and_refuses_a_taken_one(monkeypatch):
    monkeypatch.setattr(stores_base, "_REGISTRY", dict(stores_base._REGISTRY))

    @register_store("nulls", "void")
    class NullStore(ByteStore):
        def put(self, key: str, data: bytes) -> None:
            pass

        def open(self, key: str) -> BinaryIO | None:
            return io.BytesIO(b"\0")

        def contains(self, key: str) -> bool:
            return True

        def delete(self, key: str) -> None:
            pass

    assert NullStore.name == "nulls" and {"nulls", "void"} <= set(available_stores())
    assert isinstance(make_store("void"), NullStore) and isinstance(make_store("nulls://"), NullStore)
    assert make_store("nulls").nbytes(KEY) == 1
    with pytest.raises(ValueError, match="already registered"):
        register_store("memory")(NullStore)
    with pytest.raises(ValueError, match="URL scheme"):
        register_store("no_underscores")(NullStore)


def test_an_index_store_url_takes_the_same_options_and_refuses_others_before_the_index_exists(tmp_path: Path):
    from kvrag.storage.stores import open_index_store, store_record

    with pytest.raises(ValueError, match="the 'file' store takes no option 'bogus'"):
        store_record(StoreConfig(backend=(tmp_path / "c").as_uri() + "?bogus=1"), "f" * 16)
    record = store_record(StoreConfig(backend=(tmp_path / "c").as_uri() + "?max_bytes=1MB"), "f" * 16)
    store = open_index_store(tmp_path / "idx", {"store": record})
    assert isinstance(store, BoundedDiskStore) and store.max_bytes == 10**6 and store.root == tmp_path / "c"
