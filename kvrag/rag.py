"""`KVRag`: build an index of chunk caches, open it, retrieve, fuse and answer.

This is the public entry point; it wires the pieces (split, embed, index, kvgen, codec, store,
fuse, generate) and owns the per-index state that is computed once: the loaded model, the prompt
layout and the prefix cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from kvrag.model import hf_compat
from kvrag.indexing.build import (
    Builder,
    BuildStats,
    cache_after_neighbours,
    check_neighbour_kv,
    nearest_chunks,
    split_documents,
)
from kvrag.codec.base import Codec, make_codec
from kvrag.config import DEFAULT_MODE, FuseConfig, GenerateConfig, SplitConfig
from kvrag.loading.control import LoadController, LoadPlan, prompt_shape
from kvrag.indexing.documents import Document, Loaded, load_documents
from kvrag.indexing.embed import Embedder
from kvrag.errors import CorruptChunkError, IndexMismatchError, InputError
from kvrag.loading.feed import StoreFeed
from kvrag.fusion.fuse import FusionInput, FusionResult, Selector, fuse
from kvrag.generation.decode import TextStreamer, decode_tokens, eos_ids
from kvrag.storage.chunk_index import ChunkIndex, ChunkRecord
from kvrag.indexing.kvgen import KV, PrefixCache, chunk_caches, lead_key, prefix_cache
from kvrag.model import LoadedModel, load_model
from kvrag.prompt import (
    DEFAULT_INSTRUCTION,
    PromptLayout,
    build_layout,
    chunk_token_ids,
    prompt_text,
    suffix_token_ids,
)
from kvrag.storage.store import KVStore, make_store

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk used for an answer: its key, text, retrieval score and origin."""

    key: str
    text: str
    score: float
    doc_id: str
    source: str
    seq: int

    @classmethod
    def from_record(cls, record: ChunkRecord, score: float = math.nan) -> RetrievedChunk:
        return cls(record.key, record.text, score, record.doc_id, record.source, record.seq)


@dataclass
class Answer:
    """An answer with the chunks it used and where the time to first token went."""

    text: str
    mode: str
    ratio: float
    ttft_s: float
    chunks: list[RetrievedChunk]
    timings: dict[str, float] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    n_prompt_tokens: int = 0
    recompute_fraction: float = 0.0
    score_nll: float = math.nan  # teacher-forced NLL of ``score_ids`` under this fusion, when asked
    token_logprobs: list[float] = field(default_factory=list)  # log-probability of each generated token
    load_plan: LoadPlan | None = None  # the loading controller's plan, for an adaptive fusion

    def to_json(self) -> dict[str, Any]:
        out = {
            "answer": self.text, "mode": self.mode, "ratio": self.ratio, "ttft_s": self.ttft_s,
            "timings": self.timings, "prompt_tokens": self.n_prompt_tokens,
            "recompute_fraction": self.recompute_fraction,
            "chunks": [{"key": c.key, "score": c.score, "doc_id": c.doc_id, "source": c.source}
                       for c in self.chunks],
        }
        if self.load_plan is not None:
            out["load_plan"] = self.load_plan.to_json()
        return out


def _library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("kvrag", "torch", "transformers", "faiss-cpu", "sentence-transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


class KVRag:
    """An opened kvrag index with its model: retrieve, fuse cached chunks, answer.

    Example:
        >>> rag = KVRag.build(["Paris is the capital of France."], "./idx", model="smollm2")  # doctest: +SKIP
        >>> rag.answer("What is the capital of France?", k=1, mode="cacheblend").text  # doctest: +SKIP
        'Paris'
    """

    def __init__(self, path: Path, index: ChunkIndex, lm: LoadedModel, embedder: Embedder,
                 codec: Codec, layout: PromptLayout, batch_tokens: int = 4096, neighbour_context: int = 0,
                 neighbour_kv: str = "stored") -> None:
        self.path, self.index, self.lm, self.embedder = path, index, lm, embedder
        self.layout = layout
        self.kvstore = KVStore(make_store("disk", path / "chunks"), codec, lm.fingerprint)
        self.batch_tokens = batch_tokens
        self.neighbour_context, self.neighbour_kv = neighbour_context, neighbour_kv
        self._prefix: PrefixCache | None = None
        self.last_answer: Answer | None = None
        self.controller = LoadController()  # throughputs of this index's fusions (`FuseConfig.adaptive`)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def build(
        cls, documents: Document | Iterable[Document], path: str | Path, model: str | LoadedModel = "smollm2",
        embedder: str | None = None, *, split: SplitConfig | None = None, codec: str = "raw",
        codec_level: int | None = None, index_kind: str = "flat", dtype: str | None = None,
        device: str | None = None, batch_tokens: int = 4096, instruction: str = DEFAULT_INSTRUCTION,
        question_tail: str = "", neighbour_context: int | None = None,
        neighbour_kv: str | None = None, show_progress: bool = True, caches: bool = True,
    ) -> KVRag:
        """Build (or extend) an index at ``path`` over ``documents``.

        On an existing index the stored model, embedder, codec and split settings are used and only
        chunks not yet in it are computed (arguments that contradict the manifest raise
        `IndexMismatchError`).

        Args:
            documents: text strings, ``(id, text)`` pairs, `pathlib.Path` files/folders, or a mix.
            path: the index directory.
            model: a Hugging Face id or folder, a ``.gguf`` file, ``"smollm2"``, or a `LoadedModel`.
            embedder: sentence-transformers model (default: all-MiniLM-L6-v2, bundled offline).
            split: chunking settings (`SplitConfig`).
            codec: chunk-cache codec name (``raw`` is lossless).
            index_kind: ``flat`` or ``hnsw``.
            instruction: the system instruction, before the passages (the chunk caches depend on it).
            question_tail: a line put right after the question (default none), e.g. how to answer.
                It changes no cache; the index keeps it for every later question. Repeating the
                short-answer request there made SmolLM2-135M's answers shorter and closer to `full`'s
                on MuSiQue but further from them on HotpotQA (benchmarks/README.md, "A line after the
                question").
            neighbour_context: compute each chunk's cache after this many of its nearest chunks (by
                embedding) instead of after the prompt prefix alone (default 0; an existing index keeps
                its own). Chunks retrieved together are often each other's neighbours, so their stored
                caches then already saw much of the context they are fused with. Each chunk's plain
                cache is stored too (twice the storage), for when it comes first in a prompt, where the
                plain cache is exact.
            neighbour_kv: how the neighbours are put before a chunk with ``neighbour_context``:
                ``"stored"`` (the default for a new index) places their stored plain caches, so a chunk
                costs about its plain prefill again; ``"prefill"`` prefills their tokens with the chunk,
                exact for that context but up to ``neighbour_context + 1`` times the cost. An existing
                index keeps its own (indexes that predate the setting used ``"prefill"``).
            caches: False indexes the chunks for retrieval only (`add`): each chunk's cache is computed
                the first time a prompt uses it.

        Raises:
            InputError: no usable documents.
        """
        path = Path(path)
        loaded = load_documents(documents)
        if not loaded.docs:
            raise InputError("no documents to index" + (
                f" (skipped: {', '.join(s for s, _ in loaded.skipped)})" if loaded.skipped else ""))
        if ChunkIndex.exists(path):
            rag = cls.open(path, model=model if isinstance(model, LoadedModel) else None, device=device)
            rag._check_build_args(model, embedder, codec, neighbour_context, neighbour_kv, instruction, question_tail)
        else:
            if neighbour_context is not None and neighbour_context < 0:
                raise ValueError(f"neighbour_context must be >= 0, got {neighbour_context}")
            rag = cls._create(path, model, embedder, split or SplitConfig(), codec, codec_level, index_kind, dtype,
                              device, batch_tokens, instruction, question_tail, neighbour_context or 0,
                              check_neighbour_kv(neighbour_kv or "stored"))
        rag.add(loaded, show_progress=show_progress, caches=caches)
        return rag

    @classmethod
    def _create(cls, path: Path, model: str | LoadedModel, embedder_name: str | None, split: SplitConfig,
                codec_name: str, codec_level: int | None, index_kind: str, dtype: str | None,
                device: str | None, batch_tokens: int, instruction: str, question_tail: str,
                neighbour_context: int, neighbour_kv: str) -> KVRag:
        codec = make_codec(codec_name, codec_level)
        lm = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
        embedder = Embedder(embedder_name, device=device)
        layout = build_layout(lm.tokenizer, instruction, question_tail)
        manifest = {
            "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "library_versions": _library_versions(),
            "model": {"source": lm.source, "fingerprint": lm.fingerprint, "spec": asdict(lm.spec)},
            "embedder": embedder.name,
            "codec": codec.params(),
            "split": asdict(split),
            "prompt": layout.to_json(),
            "batch_tokens": batch_tokens,
            "neighbour_context": neighbour_context,
            "neighbour_kv": neighbour_kv,
        }
        index = ChunkIndex.create(path, manifest, embedder.dim, index_kind)
        return cls(path, index, lm, embedder, codec, layout, batch_tokens, neighbour_context, neighbour_kv)

    @classmethod
    def open(cls, path: str | Path, *, model: str | LoadedModel | None = None,
             device: str | None = None, dtype: str | None = None) -> KVRag:
        """Open an index; the model is loaded from the manifest unless ``model`` is given.

        Raises:
            IndexNotFoundError: no index at ``path``.
            IndexMismatchError: ``model`` is not the model the index was built with.
        """
        path = Path(path)
        index = ChunkIndex.open(path)
        manifest = index.manifest
        if manifest.get("format_version") != FORMAT_VERSION:
            raise IndexMismatchError(
                f"index format {manifest.get('format_version')!r} at {path}; this kvrag reads {FORMAT_VERSION}")
        stored = manifest["model"]
        if isinstance(model, LoadedModel):
            lm = model
        else:
            dtype = dtype or stored["spec"]["dtype"]
            lm = load_model(model or stored["source"], dtype=dtype, device=device)
        if lm.fingerprint != stored["fingerprint"]:
            raise IndexMismatchError(
                f"index {path} was built with model {stored['source']!r} (fingerprint "
                f"{stored['fingerprint']}), but the model given is {lm.source!r} (fingerprint {lm.fingerprint})")
        codec = make_codec(manifest["codec"]["name"], manifest["codec"].get("level"))
        if codec.needs_fit:
            codec.load_state(path / "codec")
        prompt = manifest["prompt"]
        layout = build_layout(lm.tokenizer, prompt["instruction"], prompt.get("question_tail", ""))
        if layout.digest() != prompt["digest"]:
            raise IndexMismatchError(f"the tokenizer's prompt layout differs from the one index {path} was built with")
        return cls(path, index, lm, Embedder(manifest["embedder"], device=device), codec, layout,
                   manifest.get("batch_tokens", 4096), manifest.get("neighbour_context", 0),
                   manifest.get("neighbour_kv", "prefill"))

    def _check_build_args(self, model: Any, embedder: str | None, codec: str, neighbour_context: int | None,
                          neighbour_kv: str | None, instruction: str, question_tail: str) -> None:
        manifest = self.index.manifest
        if isinstance(model, str) and model != manifest["model"]["source"]:
            log.info("index was built from %r; extending it with the model given (%r)",
                     manifest["model"]["source"], model)
        if embedder is not None and Embedder(embedder).name != manifest["embedder"]:
            raise IndexMismatchError(f"index uses embedder {manifest['embedder']!r}, not {embedder!r}")
        if codec != manifest["codec"]["name"]:
            raise IndexMismatchError(f"index uses codec {manifest['codec']['name']!r}, not {codec!r}")
        if neighbour_context is not None and neighbour_context != self.neighbour_context:
            raise IndexMismatchError(
                f"index computes caches with neighbour_context={self.neighbour_context}, not {neighbour_context}")
        if neighbour_kv is not None and self.neighbour_context and neighbour_kv != self.neighbour_kv:
            raise IndexMismatchError(
                f"index puts neighbours before a chunk as {self.neighbour_kv!r}, not {neighbour_kv!r}")
        if (instruction not in (DEFAULT_INSTRUCTION, self.layout.instruction)
                or question_tail.strip() not in ("", self.layout.question_tail)):
            log.warning("index %s keeps the prompt it was built with (instruction %r, question tail %r)",
                        self.path, self.layout.instruction, self.layout.question_tail)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.index.manifest

    @property
    def prefix(self) -> PrefixCache:
        """The prompt prefix's KV, computed once per opened index."""
        if self._prefix is None:
            self._prefix = prefix_cache(self.lm, self.layout.prefix_ids)
        return self._prefix

    def add(self, documents: Document | Iterable[Document] | Loaded, show_progress: bool = True,
            caches: bool = True) -> BuildStats:
        """Index new documents; chunks already present are skipped (content-hash keys).

        ``caches=False`` embeds and indexes the new chunks without computing their caches (a large
        corpus of which few chunks are ever retrieved, or candidates for neighbour context): a chunk's
        cache is then computed the first time a prompt uses it, and stored. A later ``add`` of the same
        documents with ``caches=True`` computes the caches still missing.
        """
        t0 = time.perf_counter()
        loaded = documents if isinstance(documents, Loaded) else load_documents(documents)
        stats = BuildStats(documents=len(loaded.docs), skipped=list(loaded.skipped))
        split = SplitConfig(**self.manifest["split"])
        candidates = split_documents(loaded, self.lm, self.layout, split, self.embedder.encode)
        builder = Builder(self.lm, self.index, self.kvstore, self.embedder, self.prefix,
                          self.path / "codec", self.batch_tokens, self.neighbour_context, self.neighbour_kv)
        builder.run(candidates, stats, show_progress, caches)
        stats.total_s = time.perf_counter() - t0
        log.info("indexed %d new chunks (%d prefilled, %.0f tok/s)", stats.new_chunks,
                 stats.prefilled_chunks, stats.prefill_tokens_per_s)
        return stats

    # -- query ------------------------------------------------------------------------------

    def retrieve(self, question: str, k: int = 4) -> list[RetrievedChunk]:
        """The ``k`` chunks most similar to ``question``, best first (all of them if fewer)."""
        _check_question(question)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if k > len(self.index):
            log.info("k=%d is larger than the index (%d chunks); using all of them", k, len(self.index))
        hits = self.index.search(self.embedder.encode_query(question), k)
        return [RetrievedChunk.from_record(rec, float(score)) for rec, score in hits]

    def resolve_chunks(self, chunks: Sequence[str | RetrievedChunk]) -> list[RetrievedChunk]:
        """Chunk keys (or chunks) to `RetrievedChunk`s; unknown keys raise KeyError naming the key."""
        return [c if isinstance(c, RetrievedChunk) else RetrievedChunk.from_record(self.index.get(c))
                for c in chunks]

    def prompt_text(self, question: str, chunks: Sequence[str | RetrievedChunk]) -> str:
        """The flat prompt string that `answer` feeds the model for these chunks."""
        return prompt_text(self.layout, [c.text for c in self.resolve_chunks(chunks)], question)

    def load_chunk(self, chunk: RetrievedChunk) -> KV:
        """A chunk's stored cache; a missing or corrupt one is recomputed from its text and re-stored."""
        try:
            return self.kvstore.load(chunk.key)
        except CorruptChunkError as exc:
            log.warning("%s; recomputing it from its text", exc)
            return self._recompute_chunk(chunk)

    def _recompute_chunk(self, chunk: RetrievedChunk, lead: bool = False) -> KV:
        """Recompute and re-store a chunk's cache (``lead``: its plain cache under `lead_key`)."""
        ids = chunk_token_ids(self.lm.tokenizer, chunk.text)
        key = lead_key(chunk.key) if lead and self.neighbour_context else chunk.key
        if self.neighbour_context and not lead:  # after its nearest chunks in the index as it is now
            neighbours = nearest_chunks(self.lm, self.index, self.prefix.length, self.neighbour_context,
                                        chunk.key, len(ids), self.embedder.encode([chunk.text])[0])
            kv = cache_after_neighbours(self.lm, self.prefix, self.kvstore, neighbours, ids, self.neighbour_kv)
        else:
            _, kv = next(chunk_caches(self.lm, self.prefix, [ids], self.batch_tokens))
        self.kvstore.put(key, kv[0].cpu(), kv[1].cpu())
        return kv

    def _prompt_ids(self, question: str, chunks: list[RetrievedChunk]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The chunks' and the question suffix's token ids, checked against the context window."""
        suffix = suffix_token_ids(self.lm.tokenizer, self.layout, question)
        chunk_ids = [torch.tensor(chunk_token_ids(self.lm.tokenizer, c.text)) for c in chunks]
        total = self.prefix.length + sum(int(c.numel()) for c in chunk_ids) + len(suffix)
        if total >= self.lm.spec.max_position:
            raise InputError(
                f"the prompt has {total} tokens but the model's context window is "
                f"{self.lm.spec.max_position}; use fewer or smaller chunks (k) or a shorter question")
        return chunk_ids, torch.tensor(suffix)

    def _fusion_input(self, chunks: list[RetrievedChunk], chunk_ids: list[torch.Tensor], suffix: torch.Tensor,
                      mode: str, caches: Sequence[KV | None] | None = None,
                      from_text: Sequence[int] = (), first_exact: bool = True) -> FusionInput:
        """The fusion input: ``caches`` when given, else the stored caches through a `StoreFeed`
        (chunks in ``from_text`` recomputed from their text instead).
        """
        if mode == "full":
            return FusionInput(self.prefix, chunk_ids, [None] * len(chunks), suffix)
        if caches is not None:
            return FusionInput(self.prefix, chunk_ids, list(caches), suffix, first_exact)
        # with neighbour context the first chunk reads its plain cache, which is exact where it stands
        keys: list[str | None] = [
            None if j in from_text else lead_key(c.key) if j == 0 and self.neighbour_context else c.key
            for j, c in enumerate(chunks)]
        feed = StoreFeed(self.kvstore, keys, [int(c.numel()) for c in chunk_ids],
                         self.lm.spec.n_layers, self.lm.device, self.prefix.kv[0][0].dtype,
                         recover=lambda j: self._recompute_chunk(chunks[j], lead=j == 0))
        return FusionInput(self.prefix, chunk_ids, feed, suffix)

    def _prepare(self, question: str, k: int, chunks: Sequence[str | RetrievedChunk] | None,
                 fuse_config: FuseConfig, caches: Sequence[KV | None] | None = None,
                 selector: Selector | None = None, first_exact: bool = True,
                 ) -> tuple[list[RetrievedChunk], FusionInput, FusionResult, dict[str, float], LoadPlan | None]:
        _check_question(question)
        if caches is not None and chunks is None:
            raise ValueError("caches= needs chunks= (one cache per chunk, in the same order)")
        if not first_exact and caches is None:
            raise ValueError("first_exact=False describes caches= given by the caller; the index's own caches "
                             "know where they were computed")
        t0 = time.perf_counter()
        used = self.retrieve(question, k) if chunks is None else self.resolve_chunks(chunks)
        if caches is not None and len(caches) != len(used):
            raise ValueError(f"caches has {len(caches)} entries but chunks has {len(used)}; give one per chunk")
        t1 = time.perf_counter()
        chunk_ids, suffix = self._prompt_ids(question, used)
        shape = prompt_shape(self.lm, [int(c.numel()) for c in chunk_ids], int(suffix.numel()), self.prefix.length)
        plan = None
        if caches is None and fuse_config.mode != "full":  # loads from the store: the controller may plan
            fuse_config, plan = self.controller.adapt(fuse_config, shape)
        from_text = plan.from_text if plan is not None else ()
        inp = self._fusion_input(used, chunk_ids, suffix, fuse_config.mode, caches, from_text, first_exact)
        t2 = time.perf_counter()
        fused = fuse(self.lm, inp, fuse_config, selector)
        if isinstance(inp.chunk_kv, StoreFeed) and selector is None:
            if self.lm.device.type == "cuda":  # the fusion's kernels, finished, for its measured time
                torch.cuda.synchronize(self.lm.device)
            self.controller.observe(fuse_config, shape, from_text, fused.n_selected,
                                    time.perf_counter() - t2 - fused.load_wait_s, inp.chunk_kv.decode_s)
        # Layers load while fusion runs: load_s is opening the chunk files plus the time fusion waited
        # for a layer (loading that recompute did not hide); fuse_s is the rest.
        timings = {"retrieve_s": t1 - t0, "load_s": t2 - t1 + fused.load_wait_s,
                   "fuse_s": fused.fuse_s - fused.load_wait_s}
        return used, inp, fused, timings, plan

    def stream(self, question: str, k: int = 4, mode: str = DEFAULT_MODE, ratio: float = 0.15, *,
               chunks: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None, fuse_config: FuseConfig | None = None,
               score_ids: Sequence[int] | None = None,
               caches: Sequence[KV | None] | None = None, first_exact: bool = True,
               selector: Selector | None = None) -> Iterator[str]:
        """Yield the answer's text as it is generated; `last_answer` holds the full `Answer` after.

        Args mirror `answer`.
        """
        fcfg = fuse_config or FuseConfig(mode=mode, ratio=ratio)
        gcfg = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        t0 = time.perf_counter()
        used, inp, fused, timings, plan = self._prepare(question, k, chunks, fcfg, caches, selector, first_exact)
        answer = Answer("", fcfg.mode, fcfg.ratio if plan is None else plan.ratio, math.nan, used, timings,
                        n_prompt_tokens=fused.n_tokens, recompute_fraction=fused.recompute_fraction,
                        load_plan=plan)
        self.last_answer = answer
        yield from stream_into(answer, self.lm, fused.cache, fused.logits, fused.n_tokens, gcfg, t0)
        if score_ids:
            hf_compat.crop_cache(fused.cache, fused.n_tokens)  # back to the fused prompt alone
            answer.score_nll = _mean_nll(self._teacher_logprobs(fused, score_ids), score_ids)

    def answer(self, question: str, k: int = 4, mode: str = DEFAULT_MODE, ratio: float = 0.15, *,
               chunks: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None, fuse_config: FuseConfig | None = None,
               score_ids: Sequence[int] | None = None,
               caches: Sequence[KV | None] | None = None, first_exact: bool = True,
               selector: Selector | None = None) -> Answer:
        """Retrieve ``k`` chunks (or use ``chunks``), fuse their caches and generate an answer.

        Args:
            question: the question (non-empty).
            k: chunks to retrieve; more than the index holds uses all of them.
            mode: ``full``, ``prefix``, ``reuse``, ``cacheblend``, ``probe`` (the default) or ``attnlink``.
            ratio: ``cacheblend``'s or ``probe``'s recompute ratio in (0, 1].
            chunks: chunk keys to use instead of retrieving (the direct path).
            max_new_tokens, temperature, top_p, stop, seed: decoding (greedy by default).
            fuse_config: full control over fusion (overrides ``mode`` and ``ratio``).
            score_ids: token ids whose teacher-forced NLL under this same fusion is measured after
                decoding (``Answer.score_nll``; equals `nll` without fusing a second time).
            caches: one entry per chunk of ``chunks``: pre-RoPE ``(keys, values)``, each ``[L, H, n, D]``,
                fused instead of the stored cache (e.g. caches round-tripped through a codec, or produced
                elsewhere), or None to recompute that chunk; ``full`` recomputes every chunk anyway.
            first_exact: whether ``caches``' first entry was computed right after the index's prompt
                prefix, where the prompt places it: then it is exact and no selector recomputes it. Pass
                False for caches computed any other way (e.g. each chunk on its own from position 0).
            selector: a `kvrag.fusion.fuse.Selector` that chooses the recomputed positions instead of the one
                ``mode`` names (e.g. `kvrag.fusion.fuse.FixedSelector`); ``mode`` still decides which caches load.

        Returns:
            `Answer` with the text, TTFT and its breakdown, and the chunks used.

        Raises:
            ValueError: ``caches`` without ``chunks``, or not one entry per chunk; ``first_exact=False``
                without ``caches``.
        """
        for _ in self.stream(question, k, mode, ratio, chunks=chunks, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                             fuse_config=fuse_config, score_ids=score_ids, caches=caches,
                             first_exact=first_exact, selector=selector):
            pass
        assert self.last_answer is not None
        return self.last_answer

    def nll(self, question: str, target_ids: Sequence[int], chunks: Sequence[str | RetrievedChunk],
            mode: str = "full", ratio: float = 0.15, fuse_config: FuseConfig | None = None) -> float:
        """Mean teacher-forced negative log-likelihood of ``target_ids`` after the fused prompt."""
        logprobs = self.teacher_logprobs(question, target_ids, chunks, mode, ratio, fuse_config)
        return _mean_nll(logprobs, target_ids)

    def teacher_logprobs(self, question: str, target_ids: Sequence[int], chunks: Sequence[str | RetrievedChunk],
                         mode: str = "full", ratio: float = 0.15, fuse_config: FuseConfig | None = None
                         ) -> torch.Tensor:
        """Log-probabilities over the vocabulary at each step of ``target_ids`` fed after the fused
        prompt: ``[len(target_ids), vocab]`` float32, row ``i`` predicting ``target_ids[i]``.

        E.g. where a mode's greedy answer departs from ``full``'s, the two models' margins between the
        tokens they chose.
        """
        if not target_ids:
            raise ValueError("target_ids is empty")
        fcfg = fuse_config or FuseConfig(mode=mode, ratio=ratio)
        _, _, fused, _, _ = self._prepare(question, len(chunks), chunks, fcfg)
        return self._teacher_logprobs(fused, target_ids)

    def _teacher_logprobs(self, fused: FusionResult, target_ids: Sequence[int]) -> torch.Tensor:
        """Log-softmax rows for ``target_ids`` fed after the fused prompt (the cache must hold just the prompt)."""
        device = fused.logits.device
        target = torch.tensor(list(target_ids), device=device)
        logits = [fused.logits[None]]
        if len(target) > 1:
            pos = torch.arange(fused.n_tokens, fused.n_tokens + len(target) - 1, device=device)
            with torch.no_grad():
                out = self.lm.model(input_ids=target[None, :-1], position_ids=pos[None],
                                    past_key_values=fused.cache, use_cache=True)
            logits.append(out.logits[0].float())
        return torch.log_softmax(torch.cat(logits), dim=-1)

    def close(self) -> None:
        self.index.close()
        self.kvstore.store.close()

    def __enter__(self) -> KVRag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stream_into(answer: Answer, lm: LoadedModel, cache: Any, logits: torch.Tensor, n_tokens: int,
                gcfg: GenerateConfig, t0: float) -> Iterator[str]:
    """Decode from a fused cache into ``answer`` (token ids, TTFT since ``t0``, text), yielding text."""
    streamer = TextStreamer(lm.tokenizer, gcfg.stop)
    stop_ids = eos_ids(lm.model, lm.tokenizer)
    for token in decode_tokens(lm.model, cache, logits, n_tokens, gcfg, stop_ids, answer.token_logprobs):
        if not answer.token_ids:
            answer.ttft_s = time.perf_counter() - t0
        answer.token_ids.append(token)
        delta = streamer.push(token)
        if delta:
            yield delta
        if streamer.stopped:
            break
    if math.isnan(answer.ttft_s):
        answer.ttft_s = time.perf_counter() - t0
    tail = streamer.flush()
    if tail:
        yield tail
    answer.text = streamer.emitted.strip()
    answer.timings["total_s"] = time.perf_counter() - t0


def _mean_nll(logprobs: torch.Tensor, target_ids: Sequence[int]) -> float:
    """Mean negative log-probability of ``target_ids`` under `KVRag.teacher_logprobs` rows."""
    target = torch.tensor(list(target_ids), device=logprobs.device)
    return float(-logprobs.gather(1, target[:, None]).mean())


def _check_question(question: str) -> None:
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    if not question.strip():
        raise InputError("question is empty")
