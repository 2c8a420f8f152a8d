"""The conversations' disk tier when its disk fails: a full disk and a damaged entry degrade (dropped, counted), and
a tier over a folder of the caller's finds the entries an earlier process left, never a half-written one.
"""

from __future__ import annotations

import errno

import pytest
import torch

from kvrag import SessionConfig
from kvrag.chat import tiers as tiers_module
from kvrag.chat.history import HistoryKV
from kvrag.chat.tiers import SessionTiers

CPU = torch.device("cpu")


def _entry(n: int, seed: int) -> HistoryKV:
    torch.manual_seed(seed)
    return HistoryKV(list(range(n)), [(0, n)], torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8))


def _key(i: int) -> str:
    return f"{i:032x}"


def _config(folder, one: int) -> SessionConfig:
    return SessionConfig(host_bytes=0, disk_bytes=8 * one, disk_dir=str(folder))


def test_a_new_tier_over_the_same_folder_finds_the_kept_entries(tmp_path):
    one = _entry(16, 0).nbytes
    first = SessionTiers(_config(tmp_path, one), CPU, scope="model-a")
    for i in range(3):
        first.put(_key(i), _entry(16, i))
    first.close()  # the caller's folder keeps its entries (a kill -9 keeps them too)
    folder = tmp_path / "model-a"
    (folder / f".{_key(7)}.safetensors.abc.tmp").write_bytes(b"half")  # a killed writer's leftover: not an entry
    again = SessionTiers(_config(tmp_path, one), CPU, scope="model-a")
    assert again.stats()["tiers"]["disk"]["entries"] == 3
    found = again.get(_key(1))
    assert found is not None and found[1] == "disk"
    assert torch.equal(found[0].keys, _entry(16, 1).keys) and found[0].ids == list(range(16))
    assert again.get(_key(7)) is None
    other = SessionTiers(_config(tmp_path, one), CPU, scope="model-b")  # another model never sees them
    assert other.stats()["tiers"]["disk"]["entries"] == 0 and other.get(_key(0)) is None


def test_a_damaged_entry_is_a_miss_counted_and_removed(tmp_path):
    one = _entry(16, 0).nbytes
    first = SessionTiers(_config(tmp_path, one), CPU, scope="m")
    first.put(_key(0), _entry(16, 0))
    first.close()
    path = tmp_path / "m" / f"{_key(0)}.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    again = SessionTiers(_config(tmp_path, one), CPU, scope="m")
    assert again.get(_key(0)) is None
    assert again.stats()["read_errors"] == 1 and not path.exists()


def test_a_full_disk_drops_the_entry_and_counts_it(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog):
    one = _entry(16, 0).nbytes

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiers_module, "atomic_write_bytes", full)
    tiers = SessionTiers(SessionConfig(host_bytes=one, disk_bytes=8 * one, disk_dir=str(tmp_path)), CPU)
    for i in range(4):  # each put pushes the previous entry down to the full disk
        tiers.put(_key(i), _entry(16, i))
    stats = tiers.stats()
    assert stats["write_errors"] == 3 and stats["tiers"]["disk"]["entries"] == 0
    assert tiers.get(_key(3)) is not None and tiers.get(_key(0)) is None
    assert sum("disk tier could not write" in r.getMessage() for r in caplog.records) == 1  # warned once
