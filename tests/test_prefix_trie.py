"""`kvrag.query.prefix_trie`: the trie finds what a scan of every kept key finds, and its work does not grow with
the number of keys kept; `kvrag.query.head_cache.HeadCache` finds what its former scan found.

The reference is the scan the trie replaces: every key of a `kvrag.byte_lru.ByteLRU`, least recently used first,
keeping each key that shares strictly more leading tokens than the best so far.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
import torch

from kvrag.byte_lru import ByteLRU
from kvrag.model.prefix import PrefixCache
from kvrag.query.head_cache import HeadCache
from kvrag.query.prefix_trie import BLOCK, PrefixLRU, PrefixTrie

Key = tuple[int, ...]


def _common_length(a: Key, b: Key) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _scan(tiers: Iterable[ByteLRU[Key, object]], ids: Key) -> tuple[int, Key | None, int]:
    """The former lookup: (which tier, key, shared) of the first key sharing strictly the most with ``ids``."""
    found: tuple[int, Key | None, int] = (0, None, 0)
    for tier, lru in enumerate(tiers):
        for key in lru:
            n = _common_length(key, ids)
            if n > found[2]:
                found = (tier, key, n)
    return found


def _random_key(rng: random.Random, stems: list[Key]) -> Key:
    """A key with many shared prefixes: a stem cut anywhere, then a few tokens of a small vocabulary."""
    stem = rng.choice(stems)
    return stem[: rng.randrange(len(stem) + 1)] + tuple(rng.randrange(4) for _ in range(rng.randrange(5)))


def _stems(rng: random.Random) -> list[Key]:
    return [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 3 * BLOCK + 7))) for _ in range(6)]


def _assert_compact(trie: PrefixTrie) -> None:
    """Every node but the root holds keys and is needed (a key ends there or keys part there), and lists its keys
    in the trie's least-recently-used order.
    """
    order = {key: i for i, key in enumerate(trie)}
    stack = list(trie._root.children.values())
    while stack:
        node = stack.pop()
        assert node.keys and (node.ends or len(node.children) > 1) and node.run
        assert [order[key] for key in node.keys] == sorted(order[key] for key in node.keys)
        stack.extend(node.children.values())


@pytest.mark.parametrize("seed", range(4))
def test_longest_equals_the_scan_through_puts_uses_and_evictions(seed: int):
    rng = random.Random(seed)
    stems = _stems(rng)
    kept: PrefixLRU[int] = PrefixLRU(300)
    reference: ByteLRU[Key, int] = ByteLRU(300)
    for step in range(1500):
        key = _random_key(rng, stems) or (1,)
        if rng.random() < 0.4:  # keep, sized by its length (some larger than the bound), evicting the oldest
            size = len(key) * rng.choice((1, 2, 3, 20))
            kept.put(key, step, size)
            reference.put(key, step, size)
        else:
            _, expected, shared = _scan([reference], key)
            assert kept.longest(key) == (expected, shared)
            if expected is not None:
                assert kept.get(expected) == reference.get(expected)
        assert list(kept) == list(reference) == list(kept.trie) and kept.nbytes == reference.nbytes
    _assert_compact(kept.trie)
    kept.clear()
    assert len(kept) == 0 and kept.longest(stems[0]) == (None, 0)


def test_removing_every_key_leaves_an_empty_trie_and_ties_go_to_the_least_recently_used():
    trie = PrefixTrie()
    keys = [(1, 2, 3), (1, 2, 4), (1, 2), (1, 2, 3, 5), (7,)]
    for key in keys:
        trie.add(key)
    assert trie.longest((1, 2, 9)) == ((1, 2, 3), 2)
    trie.touch((1, 2, 3))
    assert trie.longest((1, 2, 9)) == ((1, 2, 4), 2) and trie.longest((1, 2, 3, 9)) == ((1, 2, 3, 5), 3)
    assert trie.longest((8, 1)) == (None, 0) and trie.longest(()) == (None, 0)
    for key in keys:
        trie.remove(key)
    assert len(trie) == 0 and trie.longest((1, 2, 3)) == (None, 0)
    with pytest.raises(ValueError, match="at least one token"):
        trie.add(())


def _kept_prompts(n_kept: int) -> PrefixTrie:
    """``n_kept`` prompts of 2,000 tokens sharing a 1,000-token head, and one parting from them inside the head."""
    head = tuple(range(1000, 2000))
    trie = PrefixTrie()
    for i in range(n_kept):  # each prompt parts from the others at its first token after the head
        trie.add(head + (10_000 + i,) + tuple(range(20_000 + i, 20_999 + i)))
    trie.add(head[:990] + (7,))
    return trie


def _lookup_steps(trie: PrefixTrie, ids: Key) -> int:
    before = trie.steps
    trie.longest(ids)
    return trie.steps - before


def test_lookup_work_does_not_grow_with_the_number_of_kept_prompts():
    head = tuple(range(1000, 2000))
    queries = [head + (5,) + tuple(range(999)),  # the head, then tokens no kept prompt has
               head + (10_003,) + tuple(range(20_003, 20_500)) + (1,),  # most of kept prompt 3
               head[:995] + (3,)]  # parts inside the head
    tries = [_kept_prompts(n) for n in (10, 100, 1000)]
    for ids in queries:
        steps = [_lookup_steps(trie, ids) for trie in tries]
        assert steps[0] == steps[1] == steps[2] and steps[0] <= len(ids) // BLOCK + BLOCK + 8, steps


def _layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))]  # 8 bytes a row


class _FormerHeads:
    """The former `HeadCache` lookups and insertions over two scanned `ByteLRU`s (heads first on a tie)."""

    def __init__(self, max_bytes: int, prompt_bytes: int) -> None:
        self.heads: ByteLRU[Key, object] = ByteLRU(max_bytes)
        self.prompts: ByteLRU[Key, object] = ByteLRU(prompt_bytes)

    def longest(self, ids: Key, prompts: bool) -> tuple[int, Key | None, int]:
        tier, key, shared = _scan([self.heads, self.prompts] if prompts else [self.heads], ids)
        if key is not None:
            (self.heads, self.prompts)[tier].get(key)
        return tier, key, shared

    def keep_prompt(self, ids: Key, size: int, prompt_bytes: int) -> None:
        if size <= prompt_bytes and len(ids) > self.longest(ids, True)[2]:
            self.prompts.put(ids, None, size)

    def keep_head(self, ids: Key, size: int, max_bytes: int) -> None:
        if size <= max_bytes and self.heads.get(ids) is None:
            self.heads.put(ids, None, size)


@pytest.mark.parametrize("seed", range(3))
def test_head_cache_finds_what_its_former_scan_found(seed: int):
    rng = random.Random(seed)
    stems = _stems(rng)
    cache, former = HeadCache(max_bytes=8 * 120, prompt_bytes=8 * 150), _FormerHeads(8 * 120, 8 * 150)
    for _ in range(600):
        ids, action = _random_key(rng, stems) or (2,), rng.random()
        if action < 0.2:
            cache.keep_prompt(ids, _layers(len(ids) + 3))
            former.keep_prompt(ids, 8 * len(ids), cache.prompt_bytes)
        elif action < 0.4:
            prefix = PrefixCache(torch.tensor(ids), _layers(len(ids)))
            cache._keep(ids, prefix)
            former.keep_head(ids, 8 * len(ids), cache.max_bytes)
        else:
            prompts = rng.random() < 0.7
            found, shared = cache._longest(ids, prompts)
            tier, key, expected = former.longest(ids, prompts)
            assert shared == expected
            if key is not None:  # the same entry: the same tier and key
                tiers = (cache._entries, cache._prompts)
                assert found is tiers[tier]._lru.peek(key) and tuple(found.ids.tolist()) == key
        assert list(cache._entries) == list(former.heads) and list(cache._prompts) == list(former.prompts)
