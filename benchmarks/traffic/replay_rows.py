"""What a segmented-LRU byte bound could keep of a traffic run's own passages: a replay without a model.

A traffic run (`run.py`) records, per question, the passages its retriever returned (``passage_ids`` in
``rows.jsonl``). This replays one arm's lists, in stream order, through the rule kvrag's bounded stores follow
(`kvrag.storage.stores.protected_blobs.eviction_order`, called here: a blob on probation until read again, then
protected up to 80 % of the bound; eviction down to 90 % of the bound, probation's least recently used first),
with each passage a blob of its token count times ``--bytes-per-token``. As the passage cache does, a prompt stores
each passage it did not find, and a prompt prefilled in full (fewer than ``--min-stale`` tokens found) also stores
an in-place copy of each passage it found elsewhere. A passage counts as found when any of its blobs is held: the
reach a store has when no entry that leads to a held blob is lost.

Prints, per bound, how many prompts after the first ``--skip`` found at least ``--min-stale`` tokens (what fusion
needs), and the share of their passage tokens found.

    python benchmarks/traffic/replay_rows.py benchmarks/traffic/report-llamaindex-240-bounded/rows.jsonl \\
        --arm fuse-passages --bounds 400MB,1070MB
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import traffic  # noqa: E402
from run import DEFAULT_CORPUS  # noqa: E402

from kvrag.storage.stores.bounded_disk import LOW_WATER  # noqa: E402
from kvrag.storage.stores.protected_blobs import eviction_order  # noqa: E402


def passage_tokens(corpus: str) -> dict[str, int]:
    """Each corpus passage's token count under SmolLM2's tokenizer (the model the runs use)."""
    from tokenizers import Tokenizer

    from kvrag.model.loading import resolve_source

    tokenizer = Tokenizer.from_file(str(Path(resolve_source("smollm2")) / "tokenizer.json"))
    passages = traffic.corpus_passages([Path(p) for p in corpus.split(",")])
    return {pid: len(tokenizer.encode(text, add_special_tokens=False).ids) for pid, text in passages}


class SegmentedLRU:
    """Blobs keyed ``(place, passage)``, evicted by the bounded stores' rule (module docstring)."""

    def __init__(self, max_bytes: float | None) -> None:
        self.max_bytes = max_bytes
        self.size: dict[tuple, int] = {}
        self.used: dict[tuple, int] = {}
        self.protected: set[tuple] = set()
        self.copies: dict[str, set[tuple]] = defaultdict(set)
        self.clock = 0

    def read(self, passage: str) -> None:
        key = max(self.copies[passage], key=self.used.__getitem__)
        self.used[key] = self.clock
        self.protected.add(key)

    def put(self, key: tuple, size: int) -> None:
        if self.max_bytes is not None and sum(self.size.values()) + size > self.max_bytes:
            self._make_room(size)
        self.size[key], self.used[key] = size, self.clock
        self.copies[key[1]].add(key)

    def _make_room(self, size: int) -> None:
        assert self.max_bytes is not None
        blobs = sorted(self.size.items(), key=lambda item: self.used[item[0]])  # least recently used first
        order, demoted = eviction_order(blobs, self.protected, int(self.max_bytes))
        for key in demoted:  # back on probation, as if just stored
            self.protected.discard(key)
            self.used[key] = self.clock
        total, target = sum(self.size.values()), LOW_WATER * self.max_bytes - size
        for key in order:
            if total <= target:
                break
            total -= self.size.pop(key)
            del self.used[key]
            self.protected.discard(key)
            self.copies[key[1]].discard(key)


def replay(stream: list[list[str]], tokens: dict[str, int], max_bytes: float | None, bytes_per_token: int,
           min_stale: int, skip: int) -> tuple[int, int, float]:
    """(prompts reaching ``min_stale`` found tokens, prompts counted, share of passage tokens found) after ``skip``."""
    store = SegmentedLRU(max_bytes)
    reached = counted = found_tokens = all_tokens = 0
    for i, passages in enumerate(stream):
        store.clock += 1
        found = [p for p in passages if store.copies[p]]
        stale = sum(tokens[p] for p in found)
        if i >= skip:
            counted += 1
            reached += stale >= min_stale
            found_tokens += stale
            all_tokens += sum(tokens[p] for p in passages)
        for p in found:
            store.read(p)
        for j, p in enumerate(passages):
            place = tuple(passages[:j])  # its in-place key: what stands before it in this prompt
            if (place, p) not in store.size and (not store.copies[p] or stale < min_stale):
                store.put((place, p), tokens[p] * bytes_per_token)
    return reached, counted, found_tokens / max(all_tokens, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", help="a traffic run's rows.jsonl")
    p.add_argument("--arm", default="fuse-passages", help="whose passage lists to replay (all arms retrieve alike)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--bounds", default="400MB,1070MB", help="comma list of byte bounds (kvrag sizes), besides none")
    p.add_argument("--bytes-per-token", type=int, default=12_240, help="int8: 30 layers x 3 heads x (2 x 64 + 8)")
    p.add_argument("--min-stale", type=int, default=512)
    p.add_argument("--skip", type=int, default=20, help="prompts not counted at the start (the cold window)")
    args = p.parse_args()
    from kvrag.sizes import parse_bytes

    rows = [json.loads(line) for line in open(args.rows)]
    stream = [r["passage_ids"] for r in sorted((r for r in rows if r["arm"] == args.arm), key=lambda r: r["position"])]
    tokens = passage_tokens(args.corpus)
    for bound in [None, *(parse_bytes(b) for b in args.bounds.split(",") if b.strip())]:
        reached, counted, share = replay(stream, tokens, bound, args.bytes_per_token, args.min_stale, args.skip)
        label = "unbounded" if bound is None else f"{bound / 1e6:,.0f} MB"
        print(f"{label}: {reached} of {counted} prompts found >= {args.min_stale} tokens; {share:.3f} of tokens found")


if __name__ == "__main__":
    main()
