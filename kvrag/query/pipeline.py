"""The question-time pipeline: retrieve -> plan -> load -> fuse, handing a `FusedPrompt` to generation.

Each stage is a function of the previous stage's value and of `QueryContext`, the per-index state
that the facade (`kvrag.rag.KVRag`) computes once: the model, the chunk index and store, the prompt
layout and the prefix's KV. A `FusedPrompt` is the fused cache of one prompt; it generates the answer
(`stream`, `generate`) and scores given tokens on the same cache (`teacher_logprobs`, `nll`), which is
how benchmarks compare a mode's cache with a full prefill's answer without fusing twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag.config import FuseConfig, GenerateConfig
from kvrag.errors import InputError
from kvrag.fusion import FusionInput, FusionResult, Selector, fuse
from kvrag.indexing.embed import Embedder
from kvrag.indexing.kvgen import KV, PrefixCache, lead_key
from kvrag.loading.feed import StoreFeed
from kvrag.model import LoadedModel, hf_compat
from kvrag.prompt import PromptLayout, chunk_token_ids, suffix_token_ids
from kvrag.query.answer import Answer, RetrievedChunk, decode_into
from kvrag.query.plan import LoadController, LoadPlan
from kvrag.query.shape import prompt_shape
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.kvstore import KVStore

log = logging.getLogger(__name__)

TOKENIZED_TEXTS = 256  # chunk texts whose token ids a `QueryContext` keeps


@dataclass
class QueryContext:
    """What every question of one opened index reads: computed once by the facade."""

    lm: LoadedModel
    index: ChunkIndex
    embedder: Embedder
    kvstore: KVStore
    layout: PromptLayout
    prefix: PrefixCache
    neighbour_context: int
    controller: LoadController
    recover: Callable[[RetrievedChunk, bool], KV]  # recompute a chunk's cache (bool: its plain cache)
    prefix_exact: bool = True  # the chunk caches were computed after this very prefix (False in a conversation)
    reuse_prefix: bool = False  # the prefix is a conversation's kept KV: no mode recomputes it
    tokenized: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)  # `chunk_ids`' last texts

    def chunk_ids(self, text: str) -> list[int]:
        """`chunk_token_ids` of ``text`` under this model's tokenizer, remembered for the last
        `TOKENIZED_TEXTS` texts: the gate counts a prompt's tokens before the pipeline lays it out.
        """
        ids = self.tokenized.get(text)
        if ids is None:
            ids = self.tokenized[text] = chunk_token_ids(self.lm.tokenizer, text)
            while len(self.tokenized) > TOKENIZED_TEXTS:
                self.tokenized.popitem(last=False)
        else:
            self.tokenized.move_to_end(text)
        return ids


def check_question(question: str) -> None:
    """Refuse a question that is not a non-empty string."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    if not question.strip():
        raise InputError("question is empty")


def retrieve(ctx: QueryContext, question: str, k: int) -> list[RetrievedChunk]:
    """The ``k`` chunks most similar to ``question``, best first (all of them if fewer)."""
    check_question(question)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > len(ctx.index):
        log.info("k=%d is larger than the index (%d chunks); using all of them", k, len(ctx.index))
    hits = ctx.index.search(ctx.embedder.encode_query(question), k)
    return [RetrievedChunk.from_record(rec, float(score)) for rec, score in hits]


def resolve_chunks(index: ChunkIndex, chunks: Sequence[str | RetrievedChunk]) -> list[RetrievedChunk]:
    """Chunk keys (or chunks) to `RetrievedChunk`s; unknown keys raise KeyError naming the key."""
    return [c if isinstance(c, RetrievedChunk) else RetrievedChunk.from_record(index.get(c)) for c in chunks]


def prompt_ids(ctx: QueryContext, question: str, chunks: list[RetrievedChunk],
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The chunks' and the question suffix's token ids, checked against the context window."""
    suffix = suffix_token_ids(ctx.lm.tokenizer, ctx.layout, question)
    chunk_ids = [torch.tensor(ctx.chunk_ids(c.text)) for c in chunks]
    total = ctx.prefix.length + sum(int(c.numel()) for c in chunk_ids) + len(suffix)
    if total >= ctx.lm.spec.max_position:
        raise InputError(
            f"the prompt has {total} tokens but the model's context window is "
            f"{ctx.lm.spec.max_position}; use fewer or smaller chunks (k) or a shorter question")
    return chunk_ids, torch.tensor(suffix)


def load(ctx: QueryContext, chunks: list[RetrievedChunk], chunk_ids: list[torch.Tensor], suffix: torch.Tensor,
         mode: str, caches: Sequence[KV | None] | None = None, from_text: Sequence[int] = (),
         first_exact: bool = True, levels: Sequence[int | None] | None = None) -> FusionInput:
    """The fusion input: ``caches`` when given, else the stored caches through a `StoreFeed` that
    reads them layer by layer while fusion runs (chunks in ``from_text`` recomputed from their text;
    ``levels``: each chunk's stored level, as a streaming plan chose).
    """
    first_exact = first_exact and ctx.prefix_exact
    if mode == "full":
        return FusionInput(ctx.prefix, chunk_ids, [None] * len(chunks), suffix, reuse_prefix=ctx.reuse_prefix)
    if caches is not None:
        return FusionInput(ctx.prefix, chunk_ids, list(caches), suffix, first_exact, ctx.reuse_prefix)
    # with neighbour context the first chunk reads its plain cache, which is exact where it stands
    lead = ctx.neighbour_context and ctx.prefix_exact
    keys: list[str | None] = [
        None if j in from_text else lead_key(c.key) if j == 0 and lead else c.key
        for j, c in enumerate(chunks)]
    feed = StoreFeed(ctx.kvstore, keys, [int(c.numel()) for c in chunk_ids],
                     ctx.lm.spec.n_layers, ctx.lm.device, ctx.prefix.kv[0][0].dtype,
                     recover=lambda j: ctx.recover(chunks[j], bool(j == 0 and lead)),
                     levels=[None if levels is None or (j == 0 and lead) else levels[j] for j in range(len(chunks))])
    return FusionInput(ctx.prefix, chunk_ids, feed, suffix, ctx.prefix_exact, ctx.reuse_prefix)


@dataclass
class FusedPrompt:
    """One prompt's fused cache: generate its answer, or score given tokens on the same cache.

    ``t0`` is when the question arrived, so the answer's TTFT counts retrieval, loading and fusion.
    """

    lm: LoadedModel
    chunks: list[RetrievedChunk]
    fused: FusionResult
    mode: str
    ratio: float
    timings: dict[str, float]
    plan: LoadPlan | None
    t0: float
    answer: Answer | None = field(default=None, init=False)
    gate: Any = field(default=None, init=False)  # the `kvrag.query.gate.GateReport`, when the gate ran

    def stream(self, config: GenerateConfig | None = None) -> Iterator[str]:
        """Yield the answer's text as it is generated; `answer` holds the whole `Answer` after."""
        self._rewind()
        fused = self.fused
        self.answer = Answer("", self.mode, self.ratio, math.nan, self.chunks, dict(self.timings),
                             n_prompt_tokens=fused.n_tokens, recompute_fraction=fused.recompute_fraction,
                             load_plan=self.plan, gate=self.gate)
        yield from decode_into(self.answer, self.lm, fused.cache, fused.logits, fused.n_tokens,
                               config or GenerateConfig(), self.t0)

    def generate(self, config: GenerateConfig | None = None) -> Answer:
        """Decode the whole answer."""
        for _ in self.stream(config):
            pass
        assert self.answer is not None
        return self.answer

    def teacher_logprobs(self, target_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities over the vocabulary at each step of ``target_ids`` fed after the fused
        prompt: ``[len(target_ids), vocab]`` float32, row ``i`` predicting ``target_ids[i]``.
        """
        if not target_ids:
            raise ValueError("target_ids is empty")
        self._rewind()
        fused = self.fused
        target = torch.tensor(list(target_ids), device=fused.logits.device)
        logits = [fused.logits[None]]
        if len(target) > 1:
            pos = torch.arange(fused.n_tokens, fused.n_tokens + len(target) - 1, device=target.device)
            with torch.no_grad():
                out = self.lm.model(input_ids=target[None, :-1], position_ids=pos[None],
                                    **hf_compat.with_cache(self.lm.model, fused.cache), use_cache=True)
            logits.append(out.logits[0].float())
        return torch.log_softmax(torch.cat(logits), dim=-1)

    def nll(self, target_ids: Sequence[int]) -> float:
        """Mean teacher-forced negative log-likelihood of ``target_ids`` after the fused prompt."""
        logprobs = self.teacher_logprobs(target_ids)
        target = torch.tensor(list(target_ids), device=logprobs.device)
        return float(-logprobs.gather(1, target[:, None]).mean())

    def _rewind(self) -> None:
        """Back to the fused prompt alone: generation and scoring both extend the cache."""
        hf_compat.crop_cache(self.fused.cache, self.fused.n_tokens)


def prepare(ctx: QueryContext, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
            config: FuseConfig, caches: Sequence[KV | None] | None = None, selector: Selector | None = None,
            first_exact: bool = True) -> FusedPrompt:
    """Retrieve (or resolve ``chunks``), plan the loading, load and fuse: the stages before generation."""
    check_question(question)
    if caches is not None and chunks is None:
        raise ValueError("caches= needs chunks= (one cache per chunk, in the same order)")
    if not first_exact and caches is None:
        raise ValueError("first_exact=False describes caches= given by the caller; the index's own caches "
                         "know where they were computed")
    t0 = time.perf_counter()
    used = retrieve(ctx, question, k) if chunks is None else resolve_chunks(ctx.index, chunks)
    if caches is not None and len(caches) != len(used):
        raise ValueError(f"caches has {len(caches)} entries but chunks has {len(used)}; give one per chunk")
    t1 = time.perf_counter()
    chunk_ids, suffix = prompt_ids(ctx, question, used)
    shape = prompt_shape(ctx.lm, [int(c.numel()) for c in chunk_ids], int(suffix.numel()), ctx.prefix.length)
    plan = None
    if caches is None and config.mode != "full":  # loads from the store: the controller may plan
        config, plan = ctx.controller.adapt(config, shape, ctx.kvstore, [c.key for c in used])
    from_text = plan.from_text if plan is not None else ()
    inp = load(ctx, used, chunk_ids, suffix, config.mode, caches, from_text, first_exact,
               plan.levels if plan is not None else None)
    t2 = time.perf_counter()
    fused = fuse(ctx.lm, inp, config, selector)
    measured = selector is None and (isinstance(inp.chunk_kv, StoreFeed) or (config.mode == "full" and caches is None))
    if measured and ctx.lm.device.type == "cuda":  # the fusion's kernels, finished, for its measured time
        torch.cuda.synchronize(ctx.lm.device)
    if measured and isinstance(inp.chunk_kv, StoreFeed):
        ctx.controller.observe(config, shape, from_text, fused.n_selected,
                               time.perf_counter() - t2 - fused.load_wait_s, inp.chunk_kv.decode_s)
    elif measured:  # a plain prefill: what recomputing every chunk from its text costs (`LoadController.stream`)
        ctx.controller.observe_prefill(shape, time.perf_counter() - t2)
    # Layers load while fusion runs: load_s is opening the chunk files plus the time fusion waited
    # for a layer (loading that recompute did not hide); fuse_s is the rest.
    timings = {"retrieve_s": t1 - t0, "load_s": t2 - t1 + fused.load_wait_s,
               "fuse_s": fused.fuse_s - fused.load_wait_s}
    return FusedPrompt(ctx.lm, used, fused, config.mode, config.ratio if plan is None else plan.ratio,
                       timings, plan, t0)
