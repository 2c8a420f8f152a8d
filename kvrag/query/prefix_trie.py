"""`PrefixLRU`: token-id keys kept under a byte bound, and the kept key sharing the most leading tokens with a query.

Contract: `PrefixLRU.longest` gives the kept key that shares the most leading tokens with ``ids`` and how many it
shares, exactly what a scan of every key, least recently used first, keeping each key that shares strictly more than
the best so far, gives: on a tie, the least recently used key; ``(None, 0)`` when no key shares a token. It changes
nothing (`PrefixLRU.get` marks a key used). Entries are kept and evicted as `kvrag.byte_lru.ByteLRU` keeps them.

The keys are indexed in a compressed token trie (`PrefixTrie`, a radix tree): an edge carries a run of tokens, a
node stands where kept keys part or end, and each node lists the keys at or below it least recently used first. A
lookup follows ``ids`` down the trie, comparing each edge's run in one slice, and, on the edge where they differ, in
blocks of `BLOCK` tokens and then token by token inside the first differing block. Its cost follows ``len(ids)`` and
the nodes on its path, never the number of keys kept. Keeping, using or evicting a key updates the nodes on its path
(a new key that parts inside an edge copies the order of the keys below it once). Not thread-safe: callers hold
their own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

from kvrag.byte_lru import ByteLRU

BLOCK = 16  # tokens compared in one slice where an edge's run and a query part

Key = tuple[int, ...]
V = TypeVar("V")


class _Node:
    """A point of the trie where kept keys part or end."""

    __slots__ = ("children", "ends", "keys", "run")

    def __init__(self, run: Key) -> None:
        self.run = run  # the tokens on the edge from the parent
        self.children: dict[int, _Node] = {}  # by the first token of their run
        self.keys: OrderedDict[Key, None] = OrderedDict()  # kept keys at or below, least recently used first
        self.ends = False  # a kept key ends here


def _shared(run: Key, ids: Key, start: int) -> tuple[int, int]:
    """How many leading tokens ``run`` and ``ids[start:]`` share, and the comparisons made (slices and tokens)."""
    n = min(len(run), len(ids) - start)
    if run[:n] == ids[start : start + n]:
        return n, 1
    done, work = 0, 1
    while True:  # a token differs before n: find its block, then the token
        end = min(done + BLOCK, n)
        work += 1
        if run[done:end] != ids[start + done : start + end]:
            break
        done = end
    while run[done] == ids[start + done]:
        work += 1
        done += 1
    return done, work + 1


class PrefixTrie:
    """The kept keys in a compressed token trie, each node's keys in least-recently-used order (see the module)."""

    def __init__(self) -> None:
        self._root = _Node(())
        self.steps = 0  # the work of lookups over this trie's life: child probes and comparisons, not time

    def __len__(self) -> int:
        return len(self._root.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._root.keys

    def __iter__(self) -> Iterator[Key]:
        """The keys, least recently used first."""
        return iter(list(self._root.keys))

    def longest(self, ids: Key) -> tuple[Key | None, int]:
        """The key sharing the most leading tokens with ``ids`` (the least recently used on a tie) and how many it
        shares; ``(None, 0)`` when none shares one.
        """
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            self.steps += 1
            if child is None:
                break
            n, work = _shared(child.run, ids, pos)
            self.steps += work
            node, pos = child, pos + n
            if n < len(child.run):
                break
        if pos == 0:
            return None, 0
        return next(iter(node.keys)), pos  # every key below `node` shares exactly `pos` tokens

    def add(self, key: Key) -> None:
        """Index ``key`` as the most recently used (one already indexed is marked used)."""
        if not key:
            raise ValueError("a kept key needs at least one token, got ()")
        if key in self._root.keys:
            self.touch(key)
            return
        node, pos = self._root, 0
        node.keys[key] = None
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                child = node.children[key[pos]] = _Node(key[pos:])
            else:
                n = _shared(child.run, key, pos)[0]
                if n < len(child.run):
                    child = _split(node, child, n)
            child.keys[key] = None
            node, pos = child, pos + len(child.run)
        node.ends = True

    def touch(self, key: Key) -> None:
        """Mark ``key`` (indexed) as the most recently used."""
        self._root.keys.move_to_end(key)
        for _, node in self._path(key):
            node.keys.move_to_end(key)

    def remove(self, key: Key) -> None:
        """Forget ``key`` (nothing when it is not indexed); emptied nodes go, a node left on one path joins it."""
        if key not in self._root.keys:
            return
        path = self._path(key)
        del self._root.keys[key]
        for _, node in path:
            del node.keys[key]
        path[-1][1].ends = False
        for parent, node in reversed(path):
            if not node.keys:
                del parent.children[node.run[0]]
            elif not node.ends and len(node.children) == 1:
                _join(node)

    def clear(self) -> None:
        """Forget every key."""
        self._root = _Node(())

    def _path(self, key: Key) -> list[tuple[_Node, _Node]]:
        """(parent, node) from the root's child down to the node where the indexed ``key`` ends."""
        path, node, pos = [], self._root, 0
        while pos < len(key):
            child = node.children[key[pos]]
            path.append((node, child))
            node, pos = child, pos + len(child.run)
        return path


def _split(parent: _Node, child: _Node, n: int) -> _Node:
    """A node after the first ``n`` tokens of ``child``'s run, between ``parent`` and ``child``."""
    middle = _Node(child.run[:n])
    middle.keys = OrderedDict(child.keys)
    child.run = child.run[n:]
    middle.children[child.run[0]] = child
    parent.children[middle.run[0]] = middle
    return middle


def _join(node: _Node) -> None:
    """Fold the only child of ``node`` (where no key ends) into it; both hold the same keys in the same order."""
    (child,) = node.children.values()
    node.run += child.run
    node.children, node.ends = child.children, child.ends


class PrefixLRU(Generic[V]):
    """Values under token-id keys, least recently used first within ``max_bytes``, found by longest shared prefix.

    Args:
        max_bytes: the bound on the kept values' sizes (as `kvrag.byte_lru.ByteLRU`).

    Example:
        >>> kept: PrefixLRU[str] = PrefixLRU(100)
        >>> kept.put((1, 2, 3), "abc", 10)
        >>> kept.longest((1, 2, 9))
        ((1, 2, 3), 2)
    """

    def __init__(self, max_bytes: int) -> None:
        self._lru: ByteLRU[Key, V] = ByteLRU(max_bytes)
        self.trie = PrefixTrie()

    @property
    def nbytes(self) -> int:
        """The sum of the kept values' sizes."""
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __iter__(self) -> Iterator[Key]:
        """The keys, least recently used first."""
        return iter(self._lru)

    def longest(self, ids: Key) -> tuple[Key | None, int]:
        """The kept key sharing the most leading tokens with ``ids`` and how many (`PrefixTrie.longest`)."""
        return self.trie.longest(ids)

    def get(self, key: Key) -> V | None:
        """The value under ``key``, marked as the most recently used (None if absent)."""
        if key in self._lru:
            self.trie.touch(key)
        return self._lru.get(key)

    def put(self, key: Key, value: V, size: int) -> None:
        """Keep ``value`` under ``key`` as the most recent entry, evicting what no longer fits
        (`kvrag.byte_lru.ByteLRU.put`); a value larger than the bound is not kept.
        """
        self.trie.remove(key)
        for old, _ in self._lru.put(key, value, size):
            self.trie.remove(old)
        if key in self._lru:
            self.trie.add(key)

    def clear(self) -> None:
        """Forget every entry."""
        self._lru.clear()
        self.trie.clear()
