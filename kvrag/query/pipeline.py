"""The question-time stages: a first stage lays a prompt out, then plan -> load -> fuse give a `FusedPrompt`.

Two first stages give the same `LaidOut`: `retrieve` + `lay_out` (a question, kvrag's own prompt layout) and
`kvrag.query.locate.lay_out_prompt` (the passages found in a framework's flat prompt). `run` fuses a laid-out
prompt once under one `FuseConfig`; `kvrag.query.answer_plan` plans which runs an answer makes and executes them.
Each stage is a function of the previous stage's value and of `QueryContext`, the per-index state that the
facade (`kvrag.rag.KVRag`) computes once: the model, the chunk index and store, the prompt layout, the
prefix's KV and the kept heads of framework prompts. A `FusedPrompt` is the fused cache of one prompt; it
generates the answer (`stream`, `generate`) and scores given tokens on the same cache (`teacher_logprobs`,
`nll`), which is how benchmarks compare a mode's cache with a full prefill's answer without fusing twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag.byte_lru import ByteLRU
from kvrag.config import FuseConfig, GenerateConfig
from kvrag.embedder import Embedder
from kvrag.errors import InputError
from kvrag.fusion.inputs import FusionInput, FusionResult
from kvrag.fusion.loop import fuse
from kvrag.fusion.selectors.base import Selector
from kvrag.loading.feed import StoreFeed, TieredFeed, open_tiered
from kvrag.model import LoadedModel, hf_compat
from kvrag.model.prefix import KV, PrefixCache
from kvrag.prompt import PromptLayout, chunk_token_ids, suffix_token_ids
from kvrag.query.answer import Answer, RetrievedChunk, decode_into
from kvrag.query.attempt import Attempt
from kvrag.query.head_cache import HeadCache
from kvrag.query.load_plan import LoadPlan
from kvrag.query.plan import LoadController
from kvrag.query.shape import prompt_shape
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.keys import plain_cache_key
from kvrag.storage.kvstore import KVStore

log = logging.getLogger(__name__)

TOKENIZED_BYTES = 8 << 20  # about the bytes of chunk texts and their token ids a `QueryContext` keeps


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
    tokenized: ByteLRU[str, list[int]] = field(default_factory=lambda: ByteLRU(TOKENIZED_BYTES))  # `chunk_ids`
    heads: HeadCache = field(default_factory=HeadCache)  # framework prompts' heads (`kvrag.query.locate`)
    all_chunks: tuple[int, list[RetrievedChunk]] | None = None  # (index size, its chunks): `locate.index_chunks`

    def chunk_ids(self, text: str) -> list[int]:
        """`chunk_token_ids` of ``text`` under this model's tokenizer, remembered for recent texts (about
        `TOKENIZED_BYTES`): the gate counts a prompt's tokens before the pipeline lays it out.
        """
        ids = self.tokenized.get(text)
        if ids is None:
            ids = chunk_token_ids(self.lm.tokenizer, text)
            self.tokenized.put(text, ids, len(text) + 8 * len(ids))
        return ids

    def stored_ids(self, chunk: RetrievedChunk) -> list[int]:
        """The token ids ``chunk``'s cache was computed for: its own ``ids`` (a passage as a prompt had it), else
        its text's `chunk_ids`.
        """
        return list(chunk.ids) if chunk.ids is not None else self.chunk_ids(chunk.text)


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
    check_length(ctx, ctx.prefix.length + sum(int(c.numel()) for c in chunk_ids) + len(suffix))
    return chunk_ids, torch.tensor(suffix)


def check_length(ctx: QueryContext, total: int) -> None:
    """Refuse a prompt of ``total`` tokens that does not fit the model's context window."""
    if total >= ctx.lm.spec.max_position:
        raise InputError(
            f"the prompt has {total} tokens but the model's context window is "
            f"{ctx.lm.spec.max_position}; use fewer or smaller chunks (k) or a shorter question")


@dataclass
class LaidOut:
    """A prompt laid out for fusion: ``[prefix][piece 1]…[piece k][suffix]`` in token ids.

    Both first stages give one: `lay_out` (retrieved chunks in kvrag's own layout) and
    `kvrag.query.locate.lay_out_prompt` (the passages found in a framework's flat prompt). Piece ``j`` reads
    ``chunks[j]``'s stored cache; a None chunk marks text without a cache, always recomputed.

    Attributes:
        prefix: the exact KV of the prompt's head.
        first_exact: piece 0 is a chunk whose stored cache was computed right after this very prefix.
        reuse_prefix: the prefix's rows are kept as they are, even by a mode that recomputes everything.
        rows_prefix: a chunk piece may be shorter than its stored cache and read its first rows (a passage
            that a framework's template cut from kvrag's separator), or read them from ``row_starts[j]`` on.
        t0: when the question or prompt arrived; ``timings``: the first stage's seconds.
        found: the passages found in a flat prompt laid out as one text (nothing read), for `used` to report.
        kept: the passages of a flat prompt read from a kept prompt's exact rows, inside the prefix
            (`kvrag.query.head_cache`); the answer reports them before `used`.
    """

    prefix: PrefixCache
    chunks: list[RetrievedChunk | None]
    piece_ids: list[torch.Tensor]  # each [n_j]
    suffix_ids: torch.Tensor  # [S]
    first_exact: bool
    reuse_prefix: bool
    t0: float
    timings: dict[str, float] = field(default_factory=dict)
    rows_prefix: bool = False
    found: list[RetrievedChunk] | None = None
    row_starts: list[int] | None = None  # per piece: the first stored row it reads (None: 0 for every piece)
    kept: list[RetrievedChunk] = field(default_factory=list)

    @property
    def used(self) -> list[RetrievedChunk]:
        """The chunks whose caches the prompt may read, in prompt order (`found` when laid out as one text)."""
        return list(self.found) if self.found is not None else [c for c in self.chunks if c is not None]

    @property
    def stale_tokens(self) -> int:
        """Chunk tokens whose stored caches are approximate where they stand: every chunk piece's, but the
        first piece's when its cache is exact. Text pieces are recomputed anyway and do not count.
        """
        return sum(int(ids.numel()) for j, (c, ids) in enumerate(zip(self.chunks, self.piece_ids))
                   if c is not None and not (j == 0 and self.first_exact))

    @property
    def in_place(self) -> bool:
        """Every chunk piece reads its whole stored cache, computed after exactly the tokens before it here
        (`RetrievedChunk.in_place`): recomputing the text pieces and the suffix alone gives a full prefill's rows,
        up to the codec's rounding.
        """
        chunks = [c for c in self.chunks if c is not None]
        return bool(chunks) and all(c.in_place for c in chunks) and not self.rows_prefix

    @property
    def text_before(self) -> int:
        """Tokens of text without a stored cache before the first chunk piece (after the prefix): what a template
        puts before the passages that no kept head holds, such as a question asked before the context.
        """
        n = 0
        for chunk, ids in zip(self.chunks, self.piece_ids):
            if chunk is not None:
                return n
            n += int(ids.numel())
        return 0

    @property
    def text_share(self) -> float:
        """The share of the tokens after the prefix that have no stored cache: text pieces and the suffix."""
        cached = sum(int(ids.numel()) for c, ids in zip(self.chunks, self.piece_ids) if c is not None)
        text = sum(int(ids.numel()) for c, ids in zip(self.chunks, self.piece_ids) if c is None)
        text += int(self.suffix_ids.numel())
        return text / max(cached + text, 1)


def lay_out(ctx: QueryContext, question: str, chunks: list[RetrievedChunk], t0: float,
            timings: dict[str, float] | None = None) -> LaidOut:
    """Retrieved ``chunks`` and ``question`` in kvrag's own layout, after the index's prompt prefix."""
    chunk_ids, suffix = prompt_ids(ctx, question, chunks)
    return LaidOut(ctx.prefix, list(chunks), chunk_ids, suffix, ctx.prefix_exact, ctx.reuse_prefix, t0,
                   dict(timings or {}))


def load(ctx: QueryContext, laid: LaidOut, reads_none: bool, caches: Sequence[KV | None] | None = None,
         from_text: Sequence[int] = (), first_exact: bool = True,
         levels: Sequence[int | None] | None = None) -> FusionInput:
    """The fusion input: ``caches`` when given, else the stored caches through a `StoreFeed` that
    reads them layer by layer while fusion runs (pieces in ``from_text`` recomputed from their text;
    ``levels``: each chunk's stored level, as a streaming plan chose). ``reads_none``: a mode that recomputes
    every position, which reads none.
    """
    first_exact = first_exact and laid.first_exact
    ids = laid.piece_ids
    if reads_none:
        return FusionInput(laid.prefix, ids, [None] * len(ids), laid.suffix_ids, reuse_prefix=laid.reuse_prefix)
    if caches is not None:
        return FusionInput(laid.prefix, ids, list(caches), laid.suffix_ids, first_exact, laid.reuse_prefix)
    # with neighbour context the first chunk reads its plain cache, which is exact where it stands
    lead = bool(ctx.neighbour_context and laid.first_exact)
    chunks = laid.chunks
    keys: list[str | None] = [
        None if c is None or j in from_text else plain_cache_key(c.key) if j == 0 and lead else c.key
        for j, c in enumerate(chunks)]

    def recover(j: int) -> KV:
        chunk = chunks[j]
        assert chunk is not None  # only pieces with a key are read
        return ctx.recover(chunk, bool(j == 0 and lead))

    lengths, dtype = [int(c.numel()) for c in ids], laid.prefix.kv[0][0].dtype
    read_levels = [None if levels is None or (j == 0 and lead) else levels[j] for j in range(len(ids))]
    row_starts = laid.row_starts if laid.row_starts is not None else [0] * len(ids)

    def open_store(read: list[str | None]) -> StoreFeed:
        return StoreFeed(ctx.kvstore, read, lengths, ctx.lm.spec.n_layers, ctx.lm.device, dtype, recover=recover,
                         rows_prefix=laid.rows_prefix, row_starts=row_starts, levels=read_levels)

    feed = open_tiered(ctx.kvstore.decoded, keys, read_levels, row_starts, lengths, ctx.lm.spec.n_layers,
                       ctx.lm.device, dtype, open_store, ctx.kvstore.touch)
    return FusionInput(laid.prefix, ids, feed, laid.suffix_ids, laid.first_exact, laid.reuse_prefix)


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
    prompt_ids: list[int] | None = field(default=None, init=False)  # a flat prompt's tokens, one per cache row
    exact_rows: bool = field(default=False, init=False)  # no stored chunk cache read: every row a full prefill's

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


def run(ctx: QueryContext, laid: LaidOut, attempt: Attempt, caches: Sequence[KV | None] | None = None,
        selector: Selector | None = None, first_exact: bool = True) -> FusedPrompt:
    """Fuse one laid-out prompt as ``attempt`` asks: plan the loading, load and fuse. ``caches`` (one per piece)
    replace the stored ones; ``first_exact`` says whether their first was computed right after the prefix;
    ``selector`` replaces the attempt's.
    """
    t1 = time.perf_counter()
    recomputes_all = attempt.kind.recomputes_all
    lengths = [int(c.numel()) for c in laid.piece_ids]
    shape = prompt_shape(ctx.lm, lengths, int(laid.suffix_ids.numel()), laid.prefix.length)
    plan = None
    if caches is None and not recomputes_all:  # loads from the store: the controller may plan
        attempt, plan = ctx.controller.adapt(attempt, shape, ctx.kvstore,
                                             [c.key if c else None for c in laid.chunks])
    config = attempt.config
    from_text = plan.from_text if plan is not None else ()
    if attempt.kind.reads_first_chunk_only:  # the later pieces are recomputed: none is read
        from_text = tuple(sorted({*from_text, *range(1, len(lengths))}))
    inp = load(ctx, laid, recomputes_all, caches, from_text, first_exact, plan.levels if plan is not None else None)
    t2 = time.perf_counter()
    fused = fuse(ctx.lm, inp, config, attempt.selector(selector))
    # what loading from the store costs: a fusion that read every chunk from it (none from the decoded tier)
    feed = inp.chunk_kv
    stored = isinstance(feed, StoreFeed) or (isinstance(feed, TieredFeed) and feed.from_memory == 0)
    measured = selector is None and (stored or (recomputes_all and caches is None))
    if measured and ctx.lm.device.type == "cuda":  # the fusion's kernels, finished, for its measured time
        torch.cuda.synchronize(ctx.lm.device)
    if measured and isinstance(feed, StoreFeed | TieredFeed):
        ctx.controller.observe(attempt, shape, from_text, fused.n_selected,
                               time.perf_counter() - t2 - fused.load_wait_s, feed.decode_s)
    elif measured:  # a plain prefill: what recomputing every chunk from its text costs (`LoadController.stream`)
        ctx.controller.observe_prefill(shape, time.perf_counter() - t2)
    # Layers load while fusion runs: load_s is opening the chunk files plus the time fusion waited
    # for a layer (loading that recompute did not hide); fuse_s is the rest.
    timings = {**laid.timings, "load_s": t2 - t1 + fused.load_wait_s, "fuse_s": fused.fuse_s - fused.load_wait_s}
    return FusedPrompt(ctx.lm, laid.kept + laid.used, fused, config.mode, config.ratio if plan is None else plan.ratio,
                       timings, plan, laid.t0)


def prepare(ctx: QueryContext, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
            config: FuseConfig, caches: Sequence[KV | None] | None = None, selector: Selector | None = None,
            first_exact: bool = True) -> FusedPrompt:
    """Retrieve (or resolve ``chunks``), lay out, and fuse once under ``config``: no gate (the mode resolved here,
    `Attempt.of`).
    """
    t0 = time.perf_counter()
    check_question(question)
    used = retrieve(ctx, question, k) if chunks is None else resolve_chunks(ctx.index, chunks)
    laid = lay_out(ctx, question, used, t0, {"retrieve_s": time.perf_counter() - t0})
    return run(ctx, laid, Attempt.of(config), caches, selector, first_exact)
