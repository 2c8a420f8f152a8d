"""A speed benchmark's workload at one context length: random token chunks whose caches are stored
(and optionally held in host or GPU memory), and the timing of one fusion over them or of a plain
transformers prefill of the same prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvrag.bench import common
from kvrag.fusion import FusionInput, fuse
from kvrag.indexing.kvgen import chunk_caches, chunk_key, prefix_cache
from kvrag.loading.feed import StoreFeed, TensorFeed
from kvrag.query.attempt import Attempt
from kvrag.query.plan import LoadController
from kvrag.query.shape import prompt_shape

PREFIX_TOKENS = 32  # stands in for the chat-template head + instruction

SUFFIX_TOKENS = 32  # stands in for the question and the generation prompt

TIERS = ("disk", "ram", "gpu")


class Workload:
    """One context length: random chunks whose caches are stored on disk, plus prefix and suffix."""

    def __init__(self, lm: Any, kvstore: Any, length: int, chunk_tokens: int, seed: int,
                 tiers: Sequence[str] = ("disk",)) -> None:
        gen = torch.Generator().manual_seed(seed + length)
        rand = lambda n: torch.randint(3, lm.spec.vocab_size, (n,), generator=gen)  # noqa: E731
        self.prefix = prefix_cache(lm, rand(PREFIX_TOKENS).tolist())
        sizes = [chunk_tokens] * (length // chunk_tokens) + ([length % chunk_tokens] if length % chunk_tokens else [])
        self.chunk_ids = [rand(n) for n in sizes]
        self.suffix_ids = rand(SUFFIX_TOKENS)
        self.keys = [chunk_key(lm.fingerprint, self.prefix.ids.tolist(), c.tolist()) for c in self.chunk_ids]
        self.stored_bytes = 0
        self.resident: dict[str, list[Any]] = {}
        cuda = lm.device.type == "cuda"
        caches = dict(chunk_caches(lm, self.prefix, [c.tolist() for c in self.chunk_ids], 4 * chunk_tokens))
        codec = kvstore.codec
        if codec.needs_fit and not getattr(codec, "fitted", False):  # fitted once, on the first length's chunks
            codec.fit([(k.cpu().float(), v.cpu().float()) for k, v in list(caches.values())[:16]], lm.spec.n_layers)
        for i in range(len(self.chunk_ids)):
            k, v = caches.pop(i)
            self.stored_bytes += kvstore.put(self.keys[i], k.cpu(), v.cpu())
            if "ram" in tiers:  # host memory, pinned for asynchronous copies when there is a GPU
                host = [t.cpu().pin_memory() if cuda else t.cpu() for t in (k, v)]
                self.resident.setdefault("ram", []).append(tuple(host))
            if "gpu" in tiers:
                self.resident.setdefault("gpu", []).append((k.to(lm.device), v.to(lm.device)))
        self.kvstore = kvstore
        self.controller = LoadController()  # measured by every fusion from disk; plans the +adaptive modes
        self.store_feed_options: dict[str, Any] = {}  # more `StoreFeed` settings for the disk tier (experiments)

    def feed(self, lm: Any, tier: str, from_text: Sequence[int] = ()) -> Any:
        """A feed over this workload's chunk caches from ``tier`` (``from_text``: chunks left out, recomputed)."""
        lengths = [int(c.numel()) for c in self.chunk_ids]
        dtype = self.prefix.kv[0][0].dtype
        if tier == "disk":
            keys = [None if j in from_text else key for j, key in enumerate(self.keys)]
            return StoreFeed(self.kvstore, keys, lengths, lm.spec.n_layers, lm.device, dtype,
                             **self.store_feed_options)
        return TensorFeed(self.resident[tier], lengths, lm.spec.n_layers, lm.device, dtype)

    def time_mode(self, lm: Any, config: Any, tier: str = "disk") -> dict[str, float]:
        """Load the stored chunks from ``tier`` while fusing (layer-wise pipeline); seconds, GPU synchronised.

        ``load_s`` is opening the chunks plus the time fusion waited for a layer (loading that
        recompute did not hide); ``fuse_s`` is the rest.
        """
        device = lm.device
        common.cuda_sync(device)
        t0 = time.perf_counter()
        from_disk = tier == "disk" and config.mode != "full"
        shape = prompt_shape(lm, [int(c.numel()) for c in self.chunk_ids], int(self.suffix_ids.numel()),
                             self.prefix.length)
        plan = None
        attempt = Attempt.of(config)
        if from_disk:
            attempt, plan = self.controller.adapt(attempt, shape)
            config = attempt.config
        from_text = plan.from_text if plan is not None else ()
        kv = [None] * len(self.keys) if config.mode == "full" else self.feed(lm, tier, from_text)
        t1 = time.perf_counter()
        result = fuse(lm, FusionInput(self.prefix, self.chunk_ids, kv, self.suffix_ids), config)
        busy = getattr(kv, "decode_s", 0.0)
        int(torch.argmax(result.logits))  # the first token; also waits for the GPU
        common.cuda_sync(device)
        t2 = time.perf_counter()
        if from_disk:
            self.controller.observe(attempt, shape, from_text, result.n_selected, t2 - t1 - result.load_wait_s, busy)
        return {
            "ratio": config.ratio,
            "text_chunks": len(from_text),
            "ttft_s": t2 - t0,
            "load_s": t1 - t0 + result.load_wait_s,
            "fuse_s": t2 - t1 - result.load_wait_s,
            "decode_s": busy,
            "recompute_fraction": result.recompute_fraction,
            "tokens": result.n_tokens,
            # what the plan predicted, to set against the loader's busy time and the recompute (fuse_s)
            **({"plan_load_s": plan.load_s, "plan_recompute_s": plan.recompute_s} if plan is not None else {}),
        }

    def time_plain_prefill(self, lm: Any) -> dict[str, float]:
        """The model's own forward over the same prompt (no kvrag code): checks that ``full`` is fair."""
        ids = torch.cat([self.prefix.ids.cpu()] + self.chunk_ids + [self.suffix_ids]).to(lm.device)
        common.cuda_sync(lm.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = lm.model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
        int(torch.argmax(out.logits[0, -1]))
        common.cuda_sync(lm.device)
        elapsed = time.perf_counter() - t0
        return {"ttft_s": elapsed, "load_s": 0.0, "fuse_s": elapsed, "decode_s": 0.0,
                "recompute_fraction": 1.0, "tokens": int(ids.numel())}
