"""Reuse under a byte bound: the share of passage reads a bounded store serves, on a Zipf stream of RAG prompts.

What a passage cache asks of its store, without a model: each prompt retrieves ``k`` distinct passages of a corpus,
drawn with probability ``1 / rank ** s`` (ranks a seeded shuffle), and reads each passage's cache (a hit when the
store holds it, else the cache is computed and stored). After the answer, each passage's rows in that prompt are
stored too, under a key of their own: a new question puts new tokens before them, so that entry is read again only
if the same prompt comes back, which this stream never does (a one-off, as kvrag's in-place entries are under
distinct questions). Blob sizes are each passage's token count (drawn once, 60-250) times ``--bytes-per-token``.

The bound is ``--fraction`` of the corpus's caches (every passage once). Arms, the same stream each:

- ``unbounded``: everything kept; the ceiling;
- ``lru``: least recently used evicted down to 90 % of the bound before a write would pass it (the rule kvrag's
  bounded stores followed before they counted reads), simulated in memory;
- ``bounded-file``: kvrag's `BoundedDiskStore` in a temporary folder (real files and use counts);
- ``bounded-redis``: kvrag's `BoundedRedisStore` on ``--redis URL`` (its database is flushed first), when given.

Prints, per arm, the share of reads served (all, and over the second half: the warm steady state), the same in
bytes, and the warm share over the unbounded one's; ``--out`` writes them as JSON with the share per window.

    python benchmarks/traffic/eviction.py --zipf 1.0 --seed 1 [--redis redis://127.0.0.1:6379/9]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from kvrag.storage.stores import BoundedDiskStore, BoundedRedisStore, ByteStore


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40]


def prompts(n_passages: int, n_prompts: int, k: int, s: float, seed: int) -> Iterator[list[int]]:
    """``n_prompts`` lists of ``k`` distinct passages, each drawn with weight ``1 / rank ** s``."""
    rng = random.Random(seed)
    ranked = list(range(n_passages))
    rng.shuffle(ranked)
    weights = [1 / (rank + 1) ** s for rank in range(n_passages)]
    for _ in range(n_prompts):
        chosen: set[int] = set()
        while len(chosen) < k:
            chosen.update(rng.choices(ranked, weights, k=k - len(chosen)))
        yield sorted(chosen)


class LRU:
    """Least recently used by bytes, evicting down to 90 % of the bound before a write would pass it."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes, self.held, self.blobs = max_bytes, 0, OrderedDict[str, int]()

    def read(self, key: str) -> bool:
        if key in self.blobs:
            self.blobs.move_to_end(key)
            return True
        return False

    def put(self, key: str, size: int) -> None:
        if self.max_bytes is not None and self.held + size > self.max_bytes:
            while self.blobs and self.held + size > 0.9 * self.max_bytes:
                self.held -= self.blobs.popitem(last=False)[1]
        self.blobs[key] = size
        self.held += size


class StoreArm:
    """A kvrag store under the stream: a read opens the blob, a miss or a one-off writes one."""

    def __init__(self, store: ByteStore) -> None:
        self.store = store

    def read(self, key: str) -> bool:
        fh = self.store.open(key)
        if fh is None:
            return False
        fh.close()
        return True

    def put(self, key: str, size: int) -> None:
        self.store.put(key, bytes(size))


def run_arm(arm: Any, stream: list[list[int]], sizes: list[int], window: int) -> dict[str, Any]:
    """Reads served over the stream, and per window of ``window`` prompts."""
    reads = hits = read_bytes = hit_bytes = 0
    warm = [0, 0, 0, 0]  # reads, hits, bytes, hit bytes over the second half
    per_window: list[float] = []
    w_reads = w_hits = 0
    for n, passages in enumerate(stream):
        for p in passages:
            hit = arm.read(_key(f"passage {p}"))
            reads, hits = reads + 1, hits + hit
            read_bytes, hit_bytes = read_bytes + sizes[p], hit_bytes + hit * sizes[p]
            w_reads, w_hits = w_reads + 1, w_hits + hit
            if n >= len(stream) // 2:
                warm = [warm[0] + 1, warm[1] + hit, warm[2] + sizes[p], warm[3] + hit * sizes[p]]
            if not hit:
                arm.put(_key(f"passage {p}"), sizes[p])
        for p in passages:  # the prompt's own rows of each passage, after the answer
            arm.put(_key(f"prompt {n} passage {p}"), sizes[p])
        if (n + 1) % window == 0:
            per_window.append(round(w_hits / w_reads, 4))
            w_reads = w_hits = 0
    return {"served": hits / reads, "served_bytes": hit_bytes / read_bytes, "warm_served": warm[1] / warm[0],
            "warm_served_bytes": warm[3] / warm[2], "per_window": per_window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=2000, help="passages in the corpus")
    parser.add_argument("--prompts", type=int, default=3000, help="prompts in the stream")
    parser.add_argument("--k", type=int, default=8, help="passages a prompt retrieves")
    parser.add_argument("--zipf", type=float, default=1.0, help="the popularity exponent s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fraction", type=float, default=0.25, help="the bound over the corpus's caches")
    parser.add_argument("--bytes-per-token", type=int, default=64, help="blob bytes per passage token")
    parser.add_argument("--window", type=int, default=250, help="prompts per reported window")
    parser.add_argument("--redis", default=None, help="a Redis URL whose database this run may flush")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    sizes_rng = random.Random(f"sizes {args.seed}")
    sizes = [sizes_rng.randint(60, 250) * args.bytes_per_token for _ in range(args.passages)]
    bound = int(args.fraction * sum(sizes))
    stream = list(prompts(args.passages, args.prompts, args.k, args.zipf, args.seed))
    arms: dict[str, Callable[[], Any]] = {"unbounded": lambda: LRU(None), "lru": lambda: LRU(bound)}
    folder = tempfile.TemporaryDirectory(prefix="kvrag-eviction-")
    arms["bounded-file"] = lambda: StoreArm(BoundedDiskStore(folder.name, bound, fsync=False))
    if args.redis:
        def redis_arm() -> StoreArm:
            store = BoundedRedisStore(args.redis, bound, namespace="kvrag-eviction:")
            store._client.flushdb()
            return StoreArm(store)
        arms["bounded-redis"] = redis_arm
    results: dict[str, Any] = {"settings": {**vars(args), "bound_bytes": bound, "corpus_bytes": sum(sizes)}}
    for name, make in arms.items():
        start = time.perf_counter()
        results[name] = run_arm(make(), stream, sizes, args.window)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    folder.cleanup()
    ceiling = results["unbounded"]["warm_served"]
    print(f"{args.passages} passages, {args.prompts} prompts of {args.k}, Zipf s={args.zipf}, seed {args.seed}, "
          f"bound {args.fraction:.0%} of the corpus's caches")
    print(f"{'arm':<14} {'served':>7} {'bytes':>7} {'warm':>7} {'warm bytes':>10} {'warm/unbounded':>15}")
    for name in arms:
        r = results[name]
        r["warm_over_unbounded"] = r["warm_served"] / ceiling
        print(f"{name:<14} {r['served']:>7.3f} {r['served_bytes']:>7.3f} {r['warm_served']:>7.3f} "
              f"{r['warm_served_bytes']:>10.3f} {r['warm_over_unbounded']:>15.3f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
