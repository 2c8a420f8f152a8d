"""Shared codec states that no index references any more are removed (`kvrag.storage.codec_state.collect`); the
ones an index still references, recently used ones, and ones written before users were recorded, are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvrag.storage import codec_state


class _FakeCodec:
    """What `codec_state.publish_in_folder` needs of a codec: a name and the files of a fitted state."""

    name = "cachegen"

    def __init__(self, content: bytes) -> None:
        self.content = content

    def save_state(self, folder: Path) -> None:
        (folder / "state.bin").write_bytes(self.content)


@pytest.fixture
def states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVRAG_CACHE_DIR", str(tmp_path / "user-cache"))
    return codec_state.states_root()


def _index_with(tmp_path: Path, folder: str, content: bytes) -> tuple[Path, str, str]:
    """An index codec folder referencing a newly published state; ``(codec folder, name, digest)``."""
    codec = _FakeCodec(content)
    digest = codec_state.publish_in_folder(codec, "f" * 16)
    name = codec_state.state_name(codec, "f" * 16)
    state_dir = tmp_path / folder / "codec"
    codec_state.write_ref(state_dir, name, digest)
    return state_dir, name, digest


def test_a_state_no_index_references_is_removed_and_the_others_are_kept(states: Path, tmp_path: Path):
    one, name, a = _index_with(tmp_path, "one", b"a")
    two, _, b = _index_with(tmp_path, "two", b"b")
    _, _, shared = _index_with(tmp_path, "three", b"b")  # the same fit as "two": one folder for both
    assert shared == b
    assert codec_state.collect(grace_s=0) == []  # every state referenced
    shutil.rmtree(one.parent)  # an index deleted
    assert codec_state.collect(grace_s=0) == [states / name / a]
    assert not (states / name / a).exists() and (states / name / b).is_dir()
    shutil.rmtree(two.parent)
    assert codec_state.collect(grace_s=0) == []  # "three" still references it
    codec_state.write_ref(tmp_path / "three" / "codec", name, a)  # refitted to another state: b is unused now
    assert codec_state.collect(grace_s=3600) == []  # but used within the grace period
    assert codec_state.collect(grace_s=0) == [states / name / b]


def test_a_state_used_recently_or_written_before_users_were_recorded_is_kept(states: Path, tmp_path: Path):
    old, name, digest = _index_with(tmp_path, "old", b"x")
    shutil.rmtree(old.parent)
    long_ago = 1_000_000_000
    os.utime(states / name / digest, (long_ago, long_ago))
    legacy = states / name / ("0" * 24)  # from before users were recorded: no record of who references it
    legacy.mkdir()
    os.utime(legacy, (long_ago, long_ago))
    assert codec_state.collect() == [states / name / digest]  # unused for longer than GRACE_S
    assert legacy.is_dir()


def test_an_index_moved_and_opened_again_is_recorded_again(states: Path, tmp_path: Path):
    first, name, digest = _index_with(tmp_path, "first", b"m")
    moved = tmp_path / "moved"
    shutil.move(first.parent, moved)
    codec_state.note_user(moved / "codec", *codec_state.read_ref(moved / "codec"))  # what opening it does
    assert codec_state.collect(grace_s=0) == [] and (states / name / digest).is_dir()


def test_opening_an_index_records_it_as_a_user(states: Path, tmp_path: Path, tiny_lm):
    from kvrag import KVRag, SplitConfig

    docs = {"a.txt": "The alpha reactor was designed by Ada Byron in 1843. " * 3}
    path = tmp_path / "idx"
    KVRag.build(docs, path, model=tiny_lm, split=SplitConfig(max_tokens=24, min_tokens=8), codec="cachegen",
                show_progress=False).close()
    name, digest = codec_state.read_ref(path / "codec")
    users = states / name / codec_state.USERS / digest
    shutil.rmtree(users)  # as an index built before users were recorded
    KVRag.open(path, model=tiny_lm).close()
    assert [p.read_text() for p in users.iterdir()] == [str((path / "codec").resolve())]
    assert codec_state.collect(grace_s=0) == []
