"""`kvrag.byte_lru.ByteLRU`: the bound, the order of eviction, pinning through a victim, and what is returned."""

from __future__ import annotations

import pytest

from kvrag.byte_lru import ByteLRU


def test_entries_are_evicted_least_recently_used_first_within_the_bound():
    lru: ByteLRU[str, str] = ByteLRU(10)
    assert lru.put("a", "A", 4) == [] and lru.put("b", "B", 4) == []
    assert lru.get("a") == "A"  # now b is the least recently used
    assert lru.put("c", "C", 4) == [("b", "B")]
    assert list(lru) == ["a", "c"] and lru.nbytes == 8 and len(lru) == 2
    assert lru.peek("a") == "A" and list(lru) == ["a", "c"]  # peek does not mark it used
    assert lru.oldest() == ("a", "A")


def test_a_victim_spares_pinned_entries_and_evicts_until_the_new_one_fits():
    lru: ByteLRU[str, int] = ByteLRU(9)
    for i, key in enumerate("abc"):
        lru.put(key, i, 3)
    pinned = {"a"}
    evicted = lru.put("d", 3, 6, victim=lambda keys: next((k for k in keys if k not in pinned), keys[0]))
    assert evicted == [("b", 1), ("c", 2)] and list(lru) == ["a", "d"] and lru.nbytes == 9


def test_replacing_a_key_and_entries_larger_than_the_bound():
    lru: ByteLRU[str, str] = ByteLRU(5)
    lru.put("a", "old", 3)
    assert lru.put("a", "new", 2) == [] and lru.peek("a") == "new" and lru.nbytes == 2
    assert lru.put("big", "X", 6) == [] and "big" not in lru and lru.nbytes == 2
    assert lru.put("a", "too big", 9) == [] and "a" not in lru and lru.nbytes == 0  # replaced by nothing
    assert lru.pop("missing") is None
    lru.put("x", "X", 5)
    assert lru.make_room(1) == [("x", "X")] and lru.nbytes == 0
    lru.put("y", "Y", 1)
    assert lru.clear() == [("y", "Y")] and len(lru) == 0 and lru.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ByteLRU(-1)
