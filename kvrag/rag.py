"""`KVRag`: the facade over kvrag's pipeline. Build an index of chunk caches, open it, answer.

Index time (`build`, `add`) runs `kvrag.indexing`. Question time runs `kvrag.query`: a question
(`answer`, `stream`, `prepare`) is retrieved and laid out, a framework's flat prompt (`answer_prompt`,
`stream_prompt`, `prepare_prompt`) has its passages located; both are then planned, loaded and fused under
the correctness gate (`kvrag.query.gate`) and generated. A conversation's turn (`chat`) runs `kvrag.chat`.
The facade owns the per-index state computed once (model, prompt layout, prefix KV, loading controller, tiers)
and hands it down; no stage reaches back into it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.chat.sessions import ChatSessions
from kvrag.chat.turn import TurnSettings, conversation_for, stream_turn
from kvrag.codec.base import Codec, make_codec
from kvrag.config import CodecConfig, FuseConfig, GateConfig, GenerateConfig, SessionConfig, SplitConfig, StoreConfig
from kvrag.embedder import Embedder
from kvrag.errors import CorruptChunkError, IndexCorruptError, IndexMismatchError, InputError
from kvrag.fusion.selectors.base import Selector
from kvrag.indexing.build import Builder, BuildStats, check_neighbour_kv, split_documents
from kvrag.indexing.documents import Document, Loaded, load_documents
from kvrag.indexing.kvgen import KV, PrefixCache, prefix_cache
from kvrag.indexing.manifest import check_build_args, check_model, check_opened, new_manifest
from kvrag.indexing.ray_build import add_on_ray
from kvrag.indexing.recompute import recompute_chunk
from kvrag.model import LoadedModel, load_model
from kvrag.prompt import DEFAULT_INSTRUCTION, PromptLayout, build_layout, prompt_text
from kvrag.prompt_answers import PromptAnswers
from kvrag.query import pipeline
from kvrag.query.answer import Answer, RetrievedChunk, finish
from kvrag.query.pipeline import FusedPrompt, QueryContext
from kvrag.query.plan import LoadController
from kvrag.query.prepare import prepare_answer
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.codec_state import load_codec_state
from kvrag.storage.integrity import is_chunk_key
from kvrag.storage.kvstore import KVStore, log_recovery
from kvrag.storage.stores import open_index_store
from kvrag.storage.verify import VerifyReport, verify_index

log = logging.getLogger(__name__)

__all__ = ["Answer", "FusedPrompt", "KVRag", "RetrievedChunk"]


class KVRag(PromptAnswers):
    """An opened kvrag index with its model: retrieve, fuse cached chunks, answer.

    Example:
        >>> rag = KVRag.build(["Paris is the capital of France."], "./idx", model="smollm2")  # doctest: +SKIP
        >>> rag.answer("What is the capital of France?", k=1, mode="cacheblend").text  # doctest: +SKIP
        'Paris'
    """

    def __init__(self, path: Path, index: ChunkIndex, lm: LoadedModel, embedder: Embedder,
                 codec: Codec, layout: PromptLayout, batch_tokens: int = 4096, neighbour_context: int = 0,
                 neighbour_kv: str = "stored", store: str | StoreConfig | None = None) -> None:
        self.path, self.index, self.lm, self.embedder, self.layout = path, index, lm, embedder, layout
        self.kvstore = KVStore(open_index_store(path, index.manifest, store), codec, lm.fingerprint,
                               lm.family.windows, StoreConfig.decoded_bytes_of(store))
        self.batch_tokens, self.neighbour_context, self.neighbour_kv = batch_tokens, neighbour_context, neighbour_kv
        self._prefix: PrefixCache | None = None
        self._context: QueryContext | None = None
        self.last_answer: Answer | None = None  # the last answer made through this object (a convenience)
        self._lock = threading.RLock()  # one fusion and decoding at a time (answers, prompts)
        self.controller = LoadController()  # throughputs of this index's fusions (`FuseConfig.adaptive`)
        self._sessions: ChatSessions | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def build(
        cls, documents: Document | Iterable[Document], path: str | Path, model: str | LoadedModel = "smollm2",
        embedder: str | None = None, *, split: SplitConfig | None = None, codec: str | None = None,
        codec_level: int | None = None, index_kind: str = "flat", dtype: str | None = None, device: str | None = None,
        batch_tokens: int = 4096, instruction: str = DEFAULT_INSTRUCTION, question_tail: str = "",
        neighbour_context: int | None = None, store: str | StoreConfig | None = None, neighbour_kv: str | None = None,
        show_progress: bool = True, caches: bool = True, engine: str = "local", address: str | None = None,
        workers: int | None = None, stream_levels: Sequence[int] = (), codec_state: str = "shared") -> KVRag:
        """Build (or extend) an index at ``path`` over ``documents``, its caches in ``store`` (default ``path/chunks``).

        On an existing index the stored model, embedder, codec and split settings are used and only chunks not yet
        in it are computed (arguments that contradict the manifest raise `IndexMismatchError`).

        Args:
            documents: text strings, ``(id, text)`` pairs, `pathlib.Path` files/folders, or a mix.
            path: the index directory.
            model: a Hugging Face id or folder, a ``.gguf`` file, ``"smollm2"``, or a `LoadedModel`.
            embedder: sentence-transformers model (default: all-MiniLM-L6-v2, bundled offline).
            split: chunking settings (`SplitConfig`).
            codec: chunk-cache codec name (default ``cachegen``, `CodecConfig`; ``raw`` is lossless).
            codec_level: the codec's quality level (default: the codec's own; ``cachegen``: 2).
            codec_state: ``"shared"``: the fitted codec state in the user's cache folder (`kvrag.user_cache`).
            index_kind: ``flat`` or ``hnsw``.
            instruction: the system instruction, before the passages (the chunk caches depend on it).
            question_tail: a line put right after the question (default none), e.g. how to answer. It changes no
                cache; the index keeps it for every later question (benchmarks/README.md, "A line after the question").
            neighbour_context: compute each chunk's cache after this many of its nearest chunks (by
                embedding) instead of after the prompt prefix alone (default 0; an existing index keeps its
                own); each chunk's plain cache is stored too (README.md, benchmarks/README.md).
            neighbour_kv: how the neighbours are put before a chunk: ``"stored"`` (the default) places their
                stored plain caches; ``"prefill"`` prefills their tokens with the chunk (exact, costlier).
            caches: False indexes the chunks for retrieval only (`add`); each cache is computed on first use.
            stream_levels: more levels of the codec each cache is stored at, for streaming (`FuseConfig.ttft_slo`).
            engine: ``"ray"``: on ``workers`` Ray actors at ``address`` (`kvrag.indexing.ray_build.add_on_ray`).

        Raises:
            InputError: no usable documents, a document path that does not exist, an index path that is a file,
                ``batch_tokens < 1``, or (``engine="ray"``) an index with neighbour context or bad ``workers``.
            IndexCorruptError: the existing index at ``path`` is damaged (`verify`, `repair`).
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise InputError(f"index path {path} is a file, not a folder; name a new or existing index folder")
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
            raise InputError(f"batch_tokens must be a positive int, got {batch_tokens!r}")
        loaded = load_documents(documents)
        if not loaded.docs:
            raise InputError("no documents to index" + (
                f" (skipped: {', '.join(s for s, _ in loaded.skipped)})" if loaded.skipped else ""))
        if ChunkIndex.exists(path):
            rag = cls.open(path, model=model if isinstance(model, LoadedModel) else None, device=device, store=store,
                           embedder=embedder)
            check_build_args(rag.manifest, path, model, embedder, codec, neighbour_context, neighbour_kv, instruction,
                             question_tail, stream_levels)
        else:
            if neighbour_context is not None and neighbour_context < 0:
                raise ValueError(f"neighbour_context must be >= 0, got {neighbour_context}")
            rag = cls._create(path, model, embedder, split or SplitConfig(), codec, codec_level, index_kind, dtype,
                              device, batch_tokens, instruction, question_tail, neighbour_context or 0,
                              check_neighbour_kv(neighbour_kv or "stored"), store, stream_levels, codec_state)
        rag.add(loaded, show_progress=show_progress, caches=caches, engine=engine, address=address, workers=workers)
        return rag

    @classmethod
    def _create(cls, path: Path, model: str | LoadedModel, embedder_name: str | None, split: SplitConfig,
                codec_name: str | None, codec_level: int | None, index_kind: str, dtype: str | None, device: str | None,
                batch_tokens: int, instruction: str, question_tail: str, neighbour_context: int, neighbour_kv: str,
                store: str | StoreConfig | None, stream_levels: Sequence[int], codec_state: str) -> KVRag:
        codec = make_codec(codec_name or CodecConfig().name, codec_level)
        lm = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device)
        embedder = Embedder(embedder_name, device=device)
        layout = build_layout(lm.tokenizer, instruction, question_tail)
        manifest = new_manifest(lm, embedder.name, codec, split, layout, batch_tokens, neighbour_context,
                                neighbour_kv, store, stream_levels, codec_state)
        index = ChunkIndex.create(path, manifest, embedder.dim, index_kind)
        return cls(path, index, lm, embedder, codec, layout, batch_tokens, neighbour_context, neighbour_kv, store)

    @classmethod
    def open(cls, path: str | Path, *, model: str | LoadedModel | None = None, device: str | None = None,
             dtype: str | None = None, store: str | StoreConfig | None = None, embedder: str | None = None) -> KVRag:
        """Open an index; its manifest names the model, embedder and caches' store unless ``model`` / ``embedder`` /
        ``store`` is given (a manifest's embedder path outside the index only if ``embedder`` names it: `check_opened`).

        Raises:
            IndexNotFoundError, IndexMismatchError: no index at ``path``, another model; more: `check_opened`.
        """
        path = Path(path)
        index = ChunkIndex.open(path)
        manifest = index.manifest
        codec = check_opened(manifest, path, embedder, model)  # before the model loads
        stored = manifest["model"]
        lm = model if isinstance(model, LoadedModel) else load_model(model or stored["source"], device=device,
                                                                       dtype=dtype or stored["spec"]["dtype"])
        check_model(manifest, lm, path)
        bad = next((key for key in index.keys() if not is_chunk_key(key)), None)
        if bad is not None:
            raise IndexCorruptError(index.files.db, f"holds chunk key {bad[:60]!r}, which kvrag never writes",
                                    fix=f"rebuild the index from its documents (kvrag index DOCS --index {path})")
        if codec.needs_fit:
            load_codec_state(codec, path)
        prompt = manifest["prompt"]
        layout = build_layout(lm.tokenizer, prompt["instruction"], prompt.get("question_tail", ""))
        if layout.digest() != prompt["digest"]:
            raise IndexMismatchError(f"the tokenizer's prompt layout differs from the one index {path} was built with")
        return cls(path, index, lm, Embedder(manifest["embedder"], device=device), codec, layout,
                   manifest.get("batch_tokens", 4096), manifest.get("neighbour_context", 0),
                   manifest.get("neighbour_kv", "prefill"), store)

    @property
    def manifest(self) -> dict[str, Any]:
        """The index's manifest: what it was built with."""
        return self.index.manifest

    @property
    def prefix(self) -> PrefixCache:
        """The prompt prefix's KV, computed once per opened index."""
        if self._prefix is None:
            self._prefix = prefix_cache(self.lm, self.layout.prefix_ids)
        return self._prefix

    def add(self, documents: Document | Iterable[Document] | Loaded, show_progress: bool = True, caches: bool = True,
            engine: str = "local", address: str | None = None, workers: int | None = None) -> BuildStats:
        """Index new documents; chunks already present are skipped (content-hash keys).

        ``caches=False`` embeds and indexes the new chunks without computing their caches (a large
        corpus of which few chunks are ever retrieved, or candidates for neighbour context): a chunk's
        cache is then computed the first time a prompt uses it, and stored. A later ``add`` of the same
        documents with ``caches=True`` computes the caches still missing. ``engine``: as in `build`.
        """
        t0 = time.perf_counter()
        loaded = documents if isinstance(documents, Loaded) else load_documents(documents)
        stats = BuildStats(documents=len(loaded.docs), skipped=list(loaded.skipped))
        if engine != "local":  # split, embed and compute the caches on a Ray cluster
            return add_on_ray(self, loaded, stats, show_progress, caches, engine, address, workers)
        split = SplitConfig(**self.manifest["split"])
        candidates = split_documents(loaded, self.lm, self.layout, split, self.embedder.encode)
        builder = Builder(self.lm, self.index, self.kvstore, self.embedder, self.prefix, self.index.files.codec_state,
                          self.batch_tokens, self.neighbour_context, self.neighbour_kv)
        with self.index.files.writer_lock():  # one writer at a time; a second one waits here
            builder.run(candidates, stats, show_progress, caches)
        stats.total_s = time.perf_counter() - t0
        log.info("indexed %d new chunks (%d prefilled, %.0f tok/s)", stats.new_chunks,
                 stats.prefilled_chunks, stats.prefill_tokens_per_s)
        return stats

    @staticmethod
    def verify(path: str | Path, caches: bool = True) -> VerifyReport:
        """Check every file of the index at ``path``, loading no model: a `VerifyReport` (`kvrag.storage.verify`)."""
        return verify_index(path, caches=caches)

    @property
    def context(self) -> QueryContext:
        """What the question-time stages read, built once per opened index."""
        if self._context is None:
            self._context = QueryContext(self.lm, self.index, self.embedder, self.kvstore, self.layout, self.prefix,
                                         self.neighbour_context, self.controller, self._recompute_chunk)
        return self._context

    def retrieve(self, question: str, k: int = 4) -> list[RetrievedChunk]:
        """The ``k`` chunks most similar to ``question``, best first (all of them if fewer)."""
        return pipeline.retrieve(self.context, question, k)

    def resolve_chunks(self, chunks: Sequence[str | RetrievedChunk]) -> list[RetrievedChunk]:
        """Chunk keys (or chunks) to `RetrievedChunk`s; an unknown key raises `ChunkNotFoundError` (a `KeyError`)."""
        return pipeline.resolve_chunks(self.index, chunks)

    def prompt_text(self, question: str, chunks: Sequence[str | RetrievedChunk]) -> str:
        """The flat prompt string that `answer` feeds the model for these chunks."""
        return prompt_text(self.layout, [c.text for c in self.resolve_chunks(chunks)], question)

    def load_chunk(self, chunk: RetrievedChunk) -> KV:
        """A chunk's stored cache; a missing or corrupt one is recomputed from its text and re-stored."""
        try:
            return self.kvstore.load(chunk.key)
        except CorruptChunkError as exc:
            log_recovery(log, exc)
            return self._recompute_chunk(chunk)

    def _recompute_chunk(self, chunk: RetrievedChunk, lead: bool = False) -> KV:
        """Recompute and re-store a chunk's cache (``lead``: its plain cache under `plain_cache_key`)."""
        return recompute_chunk(self.lm, self.index, self.kvstore, self.embedder, self.prefix, chunk.key, chunk.text,
                               self.neighbour_context, self.neighbour_kv, self.batch_tokens, lead)

    def prepare(self, question: str, k: int = 4, mode: str | None = None, ratio: float | None = None, *,
                chunks: Sequence[str | RetrievedChunk] | None = None, fuse_config: FuseConfig | None = None,
                caches: Sequence[KV | None] | None = None, first_exact: bool = True, selector: Selector | None = None,
                gate: GateConfig | bool | None = None) -> FusedPrompt:
        """Retrieve, load and fuse, stopping before generation: the fused prompt then generates (`FusedPrompt.generate`,
        `stream`) and scores given tokens on the same cache (`nll`, `teacher_logprobs`). Args as in `answer`.

        Example:
            >>> fused = rag.prepare("Who designed the bridge?", k=4)  # doctest: +SKIP
            >>> answer = fused.generate()  # doctest: +SKIP
            >>> fused.nll(reference_token_ids)  # doctest: +SKIP
        """
        with self._lock:
            return prepare_answer(self.context, question, k, chunks, mode, ratio, fuse_config, caches,
                                            first_exact, selector, gate)

    def stream(self, question: str, k: int = 4, mode: str | None = None, ratio: float | None = None, *,
               chunks: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None, fuse_config: FuseConfig | None = None,
               caches: Sequence[KV | None] | None = None, first_exact: bool = True,
               selector: Selector | None = None, gate: GateConfig | bool | None = None) -> Iterator[str]:
        """Yield the answer's text as it is generated (args as in `answer`); `last_answer` holds its `Answer`."""
        generate = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        fused = self.prepare(question, k, mode, ratio, chunks=chunks, fuse_config=fuse_config, caches=caches,
                             first_exact=first_exact, selector=selector, gate=gate)
        pieces = fused.stream(generate)
        first = next(pieces, None)  # the Answer exists once decoding starts
        self.last_answer = fused.answer
        if first is not None:
            yield from itertools.chain([first], pieces)

    def answer(self, question: str, k: int = 4, mode: str | None = None, ratio: float | None = None, *,
               chunks: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None, fuse_config: FuseConfig | None = None,
               caches: Sequence[KV | None] | None = None, first_exact: bool = True,
               selector: Selector | None = None, gate: GateConfig | bool | None = None) -> Answer:
        """Retrieve ``k`` chunks (or use ``chunks``), fuse their caches and generate an answer.

        Args:
            question: the question (non-empty).
            k: chunks to retrieve; more than the index holds uses all of them.
            mode: a fusion mode (`kvrag.fusion.available_modes`); by default ``probe`` under the
                correctness gate. ``full`` recomputes everything.
            ratio: ``cacheblend``'s or ``probe``'s recompute ratio in (0, 1] (default 0.15).
            chunks: chunk keys to use instead of retrieving (the direct path).
            max_new_tokens, temperature, top_p, stop, seed: decoding (greedy by default).
            fuse_config: full control over fusion (overrides ``mode`` and ``ratio``).
            caches: one entry per chunk of ``chunks``: pre-RoPE ``(keys, values)``, each ``[L, H, n, D]``,
                fused instead of the stored cache (e.g. caches round-tripped through a codec, or produced
                elsewhere), or None to recompute that chunk; ``full`` recomputes every chunk anyway.
            first_exact: whether ``caches``' first entry was computed right after the index's prompt
                prefix, where the prompt places it: then it is exact and no selector recomputes it. Pass
                False for caches computed any other way (e.g. each chunk on its own from position 0).
            selector: a `kvrag.fusion.Selector` that chooses the recomputed positions instead of the one
                ``mode`` names (e.g. `kvrag.fusion.FixedSelector`); ``mode`` still decides which caches load.
            gate: the correctness gate (`GateConfig`; `kvrag.query.gate`). Its defaults answer exactly (every stale
                token recomputed); ``GateConfig(fuse=True)`` fuses long prompts: sooner, answers close to, not equal
                to, a full prefill's, checked where `GateConfig` says. None (the default) runs it when
                no mode, ratio, fusion settings, selector or caches are given; True runs the default `GateConfig`,
                False turns it off. `Answer.gate` says what it did.

        Returns:
            `Answer` with the text, TTFT and its breakdown, and the chunks used.

        Raises:
            ValueError: an unknown mode; ``caches`` without ``chunks``, or not one per chunk; ``first_exact=False``
                without ``caches``.
        """
        generate = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        with self._lock:
            fused = self.prepare(question, k, mode, ratio, chunks=chunks, fuse_config=fuse_config, caches=caches,
                                 first_exact=first_exact, selector=selector, gate=gate)
            self.last_answer = answer = fused.generate(generate)
        return answer

    def nll(self, question: str, target_ids: Sequence[int], chunks: Sequence[str | RetrievedChunk],
            mode: str = "full", ratio: float = 0.15, fuse_config: FuseConfig | None = None) -> float:
        """Mean teacher-forced negative log-likelihood of ``target_ids`` after the fused prompt."""
        return self.prepare(question, len(chunks), mode, ratio, chunks=chunks, fuse_config=fuse_config,
                            gate=False).nll(target_ids)

    def teacher_logprobs(self, question: str, target_ids: Sequence[int], chunks: Sequence[str | RetrievedChunk],
                         mode: str = "full", ratio: float = 0.15, fuse_config: FuseConfig | None = None
                         ) -> torch.Tensor:
        """`FusedPrompt.teacher_logprobs` of ``target_ids`` after the fused prompt."""
        return self.prepare(question, len(chunks), mode, ratio, chunks=chunks, fuse_config=fuse_config,
                            gate=False).teacher_logprobs(target_ids)

    @property
    def sessions(self) -> ChatSessions:
        """Conversations' kept KV across turns (`kvrag.chat.sessions`): ``stats()``, ``expect``, ``release``."""
        return self._sessions or self.configure_sessions(SessionConfig())

    def configure_sessions(self, config: SessionConfig) -> ChatSessions:
        """Bound the tiers that keep conversations' KV (`SessionConfig`); what they held is dropped."""
        if self._sessions is not None:
            self._sessions.close()
        self._sessions = ChatSessions(self.lm, lambda messages: conversation_for(self.context, messages), config)
        return self._sessions

    def chat_stream(self, messages: Sequence[Any], k: int = 4, mode: str | None = None, ratio: float | None = None,
                    *, retrieve: bool = True, chunks: Sequence[str | RetrievedChunk] | None = None,
                    max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                    stop: Sequence[str] = (), seed: int | None = None, fuse_config: FuseConfig | None = None,
                    gate: GateConfig | bool | None = None, history_cache: bool = True) -> Generator[str, None, Answer]:
        """Yield the answer to the last of ``messages`` (``{"role", "content"}`` dicts, an optional system one
        first) and return its `Answer` (also in `last_answer`). The last user message is the retrieval query;
        its passages are fused after the conversation's kept KV (``history_cache=False``: the history is
        recomputed). ``retrieve=False`` or ``k=0``: no passages. Other arguments as in `answer`;
        `Answer.history` says what was reused (docs/conversations.md).
        """
        generate = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        settings = TurnSettings(k, mode, ratio, fuse_config, gate)
        return (yield from stream_turn(self.context, self.sessions, messages, settings, generate, retrieve=retrieve,
                                       chunks=chunks, history_cache=history_cache,
                                       on_answer=lambda a: setattr(self, "last_answer", a)))

    def chat(self, messages: Sequence[Any], k: int = 4, mode: str | None = None, ratio: float | None = None,
             **options: Any) -> Answer:
        """`chat_stream` to the end: the whole `Answer` to the conversation's last user message."""
        return finish(self.chat_stream(messages, k, mode, ratio, **options))

    def close(self) -> None:
        """Close the index, the chunk store and the conversations' tiers."""
        if self._sessions is not None:
            self._sessions.close()
        self.index.close()
        self.kvstore.store.close()

    def __enter__(self) -> KVRag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
