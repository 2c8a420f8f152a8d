"""`PassageCache`: answer flat prompts with any retriever's passages, caching each passage's KV on first sight.

Contract:

- No index: the passages are found in the prompt (`kvrag.passages.finder`) or given (``passages=``). A passage's
  key hashes the model's fingerprint, the codec and its fitted state's digest, kvrag's prompt prefix, its token ids
  and where its rows were computed (`kvrag.passages.keys`): an edited passage, another model or another codec state
  is another key.
- A call answers at once: the passages whose caches are stored are fused as an index's chunks are
  (`kvrag.query.prepare.prepare_prompt`, under the correctness gate by default), everything else is recomputed with
  the prompt. After the answer, on a background thread (`BackgroundWork`), each missing passage's rows in the pass
  that answered are stored as its cache (`kvrag.passages.prompt_rows`: they carry the passages before it as
  context, at no cost), keyed by the tokens before it there and linked after the passage before it. A prompt with
  those same tokens before it reads them in place, with nothing recomputed but its text (the gate's ``stored``
  plan); another prompt reads them after the same passage, and an answer that fuses (``GateConfig(fuse=True)``, or
  no gate) reads them wherever the passage stands (`kvrag.passages.keys`' seen links). A passage the pass did not
  compute as one run is prefilled alone (between the calls' fusions, one batch at a time), read anywhere. So no
  stored cache is taken as exact right after kvrag's prompt prefix (``prefix_exact=False``). A mode that recomputes
  everything (``full``) is a plain prefill of the prompt as one text: it looks nothing up and stores nothing.
- A passage found but not in place (a cache `warm` stored, rows read after the same passage or first in another
  prompt) gets its in-place entry too when the pass that answered read no stored cache (a full prefill, or kept
  exact rows and one pass over the rest): that prompt asked again then reads every passage in place. A fused pass's
  rows attended to stored caches: when the same run of passages comes back fused, a full prefill of it after the
  answer stores them in place (`kvrag.passages.exact_pass`).
- Caches are stored with the ``int8`` codec by default (`PASSAGE_CODEC`).
- The store is bounded in bytes (`kvrag.passages.cache_url`: ``file://`` under the user's cache folder by default,
  or ``redis://``), those not read since stored evicted first (`kvrag.storage.stores.protected_blobs`); the
  codec's fitted state is stored once per model beside the blobs (`kvrag.storage.codec_state`), fitted on the first
  passages stored.
- `stats` counts passages looked up and found; `info` adds the bytes held, the bound and the store's segments
  (protected and on probation). `flush` waits for pending stores (also run when the interpreter exits, for at most
  `EXIT_FLUSH_S`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from collections.abc import Generator, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any, cast

from tqdm.auto import tqdm

from kvrag.codec import Codec, make_codec
from kvrag.config import FuseConfig, GateConfig, GenerateConfig
from kvrag.indexing.kvgen import chunk_caches
from kvrag.loading.tiered_feed import TIERED_DEVICES
from kvrag.model import LoadedModel, hf_compat, load_model
from kvrag.model.prefix import KV, PrefixCache, prefix_cache
from kvrag.passages.background import BackgroundWork
from kvrag.passages.cache_url import memory_bound, open_cache_store, url_codec
from kvrag.passages.exact_pass import ExactPasses
from kvrag.passages.finder import MIN_CHARS, find_passages, split_passages
from kvrag.passages.keys import PassageKeys
from kvrag.passages.lookup import look_up
from kvrag.passages.pending import CacheStats, FoundPassage, MissingPassage
from kvrag.passages.prompt_rows import rows_of_passes
from kvrag.prompt import build_layout
from kvrag.query.answer import Answer, RetrievedChunk, finish
from kvrag.query.head_cache import DEFAULT_PROMPT_BYTES, HeadCache
from kvrag.query.locate import encode
from kvrag.query.pipeline import QueryContext
from kvrag.query.plan import LoadController
from kvrag.query.prepare import prepare_prompt, settings
from kvrag.storage.codec_state import load_from_store, publish_in_store
from kvrag.storage.decoded_tier import DEFAULT_DECODED_BYTES
from kvrag.storage.kvstore import KVStore

log = logging.getLogger(__name__)

FIT_PASSAGES = 16  # passages a codec that needs fitting is fitted on, when no state is stored yet
BATCH_TOKENS = 2048  # tokens per background prefill batch: the longest a call may wait for the model
EXIT_FLUSH_S = 60.0
# int8: rows read in place gave full's answers on 38 of 39 held-out questions, and decode sooner than cachegen's on
# a CPU (benchmarks/any-retriever README, "Rows read in place"); cachegen keeps 2.6x more: ``codec="cachegen"``
PASSAGE_CODEC = "int8"
CHAT_PASSED = ("temperature", "top_p", "stop", "seed", "fuse_config", "gate")  # chat options a passage cache uses


_OPEN: weakref.WeakSet[PassageCache] = weakref.WeakSet()  # caches not closed: their pending stores run at exit


@atexit.register
def _flush_at_exit() -> None:
    for cache in list(_OPEN):
        cache.flush(EXIT_FLUSH_S)


class PassageCache:
    """A model and a bounded store of passage caches: answers flat prompts (see the module contract).

    Args:
        lm: the loaded model.
        store: a bounded store (`kvrag.passages.cache_url.open_cache_store`).
        codec: the codec the caches are stored with (default: kvrag's default codec).
        min_chars: the shortest piece of a prompt taken as a passage.
        decoded_bytes: the bound of the tier of hot passage caches kept decoded in memory (`KVStore.decoded`; on
            the CPU, 0 turns it off): a passage stored after an answer, or read once, is fused from memory next.
        prompt_bytes: the bound of the whole prompts kept exact in memory (`heads`, a `HeadCache`; 0 keeps none): a
            prompt asked again is read from its kept rows. Another `HeadCache` may replace `heads` before the first
            answer (the question-time context takes it then).

    Example:
        >>> cache = PassageCache.open("smollm2", "file:///tmp/kv?max_bytes=2GB")  # doctest: +SKIP
        >>> cache.answer_prompt(prompt).text  # doctest: +SKIP
    """

    def __init__(self, lm: LoadedModel, store: Any, codec: Codec | None = None, min_chars: int = MIN_CHARS,
                 decoded_bytes: int = DEFAULT_DECODED_BYTES, prompt_bytes: int = DEFAULT_PROMPT_BYTES) -> None:
        if not callable(getattr(store, "put_state", None)):
            raise TypeError("a passage cache needs a store bounded in bytes (open_cache_store), got "
                            f"{type(store).__name__}")
        self.lm, self.store, self.min_chars = lm, store, min_chars
        self.heads = HeadCache(prompt_bytes=prompt_bytes)  # template heads and whole prompts kept exact
        self.layout = build_layout(lm.tokenizer)
        self.kvstore = KVStore(store, codec or make_codec(PASSAGE_CODEC), lm.fingerprint, lm.family.windows,
                               decoded_bytes)
        self.keys = PassageKeys(store, self.kvstore, lm.fingerprint, self.layout.prefix_ids,
                                load_from_store(store, self.kvstore.codec, lm.fingerprint))
        self.recovered = 0  # passages recomputed alone because their blob went missing after the lookup
        self._lock = threading.RLock()  # the model: one fusion or background prefill at a time
        self._prefix: PrefixCache | None = None
        self._context: QueryContext | None = None
        self.controller = LoadController()
        self.stats = CacheStats()
        self.last_answer: Answer | None = None
        self._writer: BackgroundWork[MissingPassage] = BackgroundWork(self._store_missing, "kvrag-passage-writer")
        self.exact_passes = ExactPasses(lm, self._lock, self._writer.submit, BATCH_TOKENS)
        _OPEN.add(self)

    @classmethod
    def open(cls, model: str | LoadedModel, cache: str | None = None, *, max_bytes: int | str | None = None,
             device: str | None = None, dtype: str | None = None, codec: str | None = None,
             codec_level: int | None = None) -> PassageCache:
        """A passage cache for ``model`` (a name, path or `LoadedModel`) in the store ``cache`` names.

        ``cache``: ``file:///path?max_bytes=5GB``, ``redis://host:6379/0?max_bytes=1GB``, a folder, or None for
        the user's cache folder; ``max_bytes`` overrides the URL's bound; the URL's ``decoded_bytes`` bounds the
        decoded tier, ``prompt_bytes`` the prompts kept exact, ``codec`` is the default ``codec``. The store is
        checked before the model loads.
        """
        decoded_bytes, prompt_bytes = memory_bound(cache, "decoded_bytes"), memory_bound(cache, "prompt_bytes")
        codec = codec or url_codec(cache) or PASSAGE_CODEC
        store = open_cache_store(cache, max_bytes)
        lm = model if isinstance(model, LoadedModel) else load_model(model, device=device, dtype=dtype)
        return cls(lm, store, make_codec(codec, codec_level), decoded_bytes=decoded_bytes,
                   prompt_bytes=prompt_bytes)

    # -- the question-time state ------------------------------------------------------------------

    @property
    def prefix(self) -> PrefixCache:
        """The prompt prefix's KV: every passage cache is computed after it."""
        if self._prefix is None:
            self._prefix = prefix_cache(self.lm, self.layout.prefix_ids)
        return self._prefix

    @property
    def context(self) -> QueryContext:
        """What the question-time stages read (no chunk index and no embedder: passages come with the prompt)."""
        if self._context is None:
            # prefix_exact=False: a passage's cache holds its rows as first seen in a prompt, after the text before it
            # there (`kvrag.passages.prompt_rows`), so no stored cache is exact right after kvrag's prompt prefix
            self._context = QueryContext(self.lm, cast(Any, None), cast(Any, None), self.kvstore, self.layout,
                                         self.prefix, 0, self.controller, self._recompute, prefix_exact=False,
                                         heads=self.heads)
        return self._context

    def describe(self) -> dict[str, str]:
        """The cache's store and model, for an adapter's identifying parameters."""
        return {"cache": f"{type(self.store).__name__} {getattr(self.store, 'root', '')}", "model": str(self.lm.source)}

    def passages_in(self, prompt: str) -> list[str]:
        """The passages found in a flat prompt (`kvrag.passages.finder.find_passages`)."""
        return find_passages(prompt, self.min_chars)

    def passage_ids(self, text: str) -> list[int]:
        """A passage's own token ids (its stripped text alone): the cache `warm` stores, and the one a prompt reads
        wherever the passage stands after a line break, as a stuff step puts it.
        """
        return encode(self.lm.tokenizer, text.strip())

    def _lookup(self, prompt: str, texts: Iterable[str], anywhere: bool = False,
                ) -> tuple[list[RetrievedChunk], list[MissingPassage], list[FoundPassage]]:
        """The passages of ``texts`` in ``prompt`` whose caches are stored (``anywhere``: also rows computed after
        other text, for an answer that fuses), those to store after the answer, and how the found ones were reached
        (`kvrag.passages.lookup.look_up`), counted in `stats`.
        """
        found, missing, looked_up, reached = look_up(self.keys, self.lm.tokenizer, self.passage_ids, prompt, texts,
                                                     anywhere)
        self.stats.looked_up += looked_up
        self.stats.found += len(found)
        return found, missing, reached

    # -- answers ---------------------------------------------------------------------------------

    def stream_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, *,
                      passages: Sequence[str] | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                      top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
                      fuse_config: FuseConfig | None = None, gate: GateConfig | bool | None = None,
                      written: str | None = None, **ignored: Any) -> Generator[str, None, Answer]:
        """Yield the answer to ``prompt`` as it is generated and return its `Answer`; then store missing passages.

        Args:
            prompt: the exact prompt string (the adapters add the model's chat template).
            mode, ratio, fuse_config, gate: as in `kvrag.KVRag.answer` (default: under the correctness gate).
            passages: the passage texts in the prompt (default: found in ``written``, `passages_in`).
            written: the prompt as the framework wrote it, before a chat template was put around it (default:
                ``prompt``): its passages are found there.
            max_new_tokens, temperature, top_p, stop, seed: decoding (greedy by default).
        """
        generate = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        asked, gate_config = settings(mode, ratio, fuse_config, None, None, gate)
        plain = asked.kind.recomputes_all  # a full prefill: the prompt as one text, nothing stored
        with self._lock:
            texts = [] if plain else self.passages_in(written or prompt) if passages is None else passages
            found, missing, reached = self._lookup(prompt, texts, anywhere=gate_config is None or gate_config.fuses)
            recovered = self.recovered
            fused = prepare_prompt(self.context, prompt, found, asked, gate_config)
            if fused.gate is not None and fused.gate.decision == "stored" and self.recovered != recovered:
                # a blob read in place went missing since the lookup and was computed alone: no longer in place
                fused = prepare_prompt(self.context, prompt, [], asked, gate_config)
        try:
            yield from fused.stream(generate)
        finally:  # after the answer (or a stream closed early): never on its critical path
            self.keys.keep(reached)  # before the stores below evict anything
            source = None if fused.prompt_ids is None else (fused.prompt_ids, hf_compat.cache_layers(fused.fused.cache))
            exact = fused.exact_rows  # a passage found elsewhere is stored in place from a full prefill's rows only
            self._writer.submit([replace(m, source=source, exact=exact) for m in missing if exact or not m.elsewhere])
            if not exact:
                self.exact_passes.after(prompt, missing)
        assert fused.answer is not None
        self.last_answer = fused.answer
        return fused.answer

    def answer_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, **options: Any) -> Answer:
        """`stream_prompt`, whole."""
        return finish(self.stream_prompt(prompt, mode, ratio, **options))

    def chat_stream(self, messages: Sequence[dict[str, str]], k: int = 4, mode: str | None = None,
                    ratio: float | None = None, *, max_new_tokens: int = 256, **options: Any
                    ) -> Generator[str, None, Answer]:
        """A chat turn whose messages hold the passages (as a chain put them): the model's chat template over
        ``messages``, then `stream_prompt` with the passages found in their contents. ``k``, ``retrieve``,
        ``chunks`` and ``history_cache`` mean nothing without an index and are ignored (the chat models pass them).
        """
        tokenizer = self.lm.tokenizer
        if getattr(tokenizer, "chat_template", None):
            prompt = str(tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))
        else:
            prompt = (tokenizer.bos_token or "") + "\n\n".join(m["content"] for m in messages)
        passages = [p for m in messages for p in self.passages_in(str(m["content"]))]
        kept = {name: options[name] for name in CHAT_PASSED if name in options}
        answer = yield from self.stream_prompt(prompt, mode, ratio, passages=passages, max_new_tokens=max_new_tokens,
                                               **kept)
        return answer

    def chat(self, messages: Sequence[dict[str, str]], k: int = 4, mode: str | None = None,
             ratio: float | None = None, **options: Any) -> Answer:
        """`chat_stream`, whole."""
        return finish(self.chat_stream(messages, k, mode, ratio, **options))

    # -- storing ---------------------------------------------------------------------------------

    def warm(self, texts: Iterable[str], show_progress: bool = True) -> int:
        """Compute and store now the caches of the passages of ``texts`` (documents, each split at blank lines as a
        prompt shows it: `kvrag.passages.finder.split_passages`) not stored yet: an ingestion step. Returns how many
        were stored.
        """
        missing = []
        for text in dict.fromkeys(p for t in texts for p in split_passages(t or "", self.min_chars)):
            ids = self.passage_ids(text)
            if self.keys.stored(ids) is None:
                missing.append(MissingPassage(text, tuple(ids)))
        return self._store_missing(missing, show_progress, hold=False)  # a bulk ingestion: the tier keeps what is read

    def _caches(self, work: list[MissingPassage]) -> Generator[tuple[int, KV], None, None]:
        """The caches of ``work``'s passages, one prefill batch at a time under the model's lock."""
        batches = chunk_caches(self.lm, self.prefix, [list(m.ids) for m in work], BATCH_TOKENS)
        while True:
            with self._lock:
                got = next(batches, None)
            if got is None:
                return
            yield got

    def _fit(self, work: list[MissingPassage], rows: dict[MissingPassage, KV]) -> dict[MissingPassage, KV]:
        """Fit the codec on the first passages and publish its state (another process's, if it was first); the
        sample's caches, to be stored rather than computed again.
        """
        sample = list(dict.fromkeys(work))[:FIT_PASSAGES]
        caches = {m: rows[m] for m in sample if m in rows}
        todo = [m for m in sample if m not in rows]
        caches.update({todo[i]: (k.cpu(), v.cpu()) for i, (k, v) in self._caches(todo)})
        codec = self.kvstore.codec
        codec.fit(list(caches.values()), self.lm.spec.n_layers)
        self.keys.digest = publish_in_store(self.store, codec, self.lm.fingerprint)
        log.info("fitted the %s codec's state for %s on %d passages", codec.name, self.lm.source, len(caches))
        return caches

    def _store_missing(self, missing: list[MissingPassage], show_progress: bool = False, hold: bool = True) -> int:
        """Compute and store the caches of ``missing`` passages that are still not stored (returns how many); with
        ``hold``, keep each decoded in the store's tier too (on the CPU): the next prompt placing it reads memory.
        """
        hold, stored = hold and self.lm.device.type in TIERED_DEVICES, 0
        if not missing:
            return 0
        found = rows_of_passes(self.lm, [(m.source, m.ids) for m in missing])  # their rows in the prompt's pass
        rows = {m: got.kv for m, got in zip(missing, found) if got is not None}
        contexts = {m: got.context for m, got in zip(missing, found) if got is not None and m.exact}
        fitted = self._fit(missing, rows) if self.keys.digest is None else {}
        todo = [(m, key) for m in dict.fromkeys(missing)
                if (key := self._entry_key(m, m in rows, contexts.get(m))) is not None
                and not self.kvstore.contains(key)]
        rest = [(m, key) for m, key in todo if m not in fitted and m not in rows]
        with tqdm(total=sum(len(m.ids) for m, _ in todo), unit="tok", desc="caching passages",
                  disable=not show_progress or not todo) as bar:
            done = [(m, key, kv) for m, key in todo if (kv := fitted.get(m, rows.get(m))) is not None]
            done_later = ((rest[i][0], rest[i][1], kv) for i, kv in self._caches([m for m, _ in rest]))
            for m, key, kv in itertools.chain(done, done_later):
                self.stats.stored_bytes += self.kvstore.put(key, kv[0].cpu(), kv[1].cpu())
                if m in rows:  # rows taken from a prompt: found after the same passage again, and by fusing answers
                    self.keys.link(m.ids, m.after, key)
                self.stats.stored, stored = self.stats.stored + 1, stored + 1
                if hold:
                    self.kvstore.hold_decoded(key, self.prefix.kv[0][0].dtype)
                bar.update(len(m.ids))
        return stored

    def _entry_key(self, m: MissingPassage, has_rows: bool, context: str | None) -> str | None:
        """Where ``m``'s rows go: a full prefill's (``context``, the digest of the tokens before them) in place,
        linked after the passage before; a fused pass's (``has_rows``) after it; else a cache computed alone, plain.
        A passage stored elsewhere gets its in-place entry only (None without a full prefill's rows).
        """
        if m.elsewhere and context is None:
            return None
        return self.keys.key(m.ids, m.after if has_rows else (), context)

    def _recompute(self, chunk: RetrievedChunk, lead: bool = False) -> KV:
        """A passage's cache computed again (its blob was evicted or damaged since the lookup), alone after the
        prompt prefix, and stored as such (its plain key).
        """
        ids = self.context.stored_ids(chunk)
        self.recovered += 1
        _, kv = next(chunk_caches(self.lm, self.prefix, [ids], BATCH_TOKENS))
        if (plain := self.keys.key(ids)) is not None:
            self.kvstore.put(plain, kv[0].cpu(), kv[1].cpu())
        return kv

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the passages of earlier calls are stored; False when ``timeout`` passed first."""
        return self.exact_passes.flush(timeout) and self._writer.flush(timeout)

    def info(self) -> dict[str, Any]:
        """The store's bound, bytes held and segments (`BoundedDiskStore.popularity`), `stats` and the hit rate, the
        exact passes run (`ExactPasses`), the decoded tier's stats (`KVStore.stats`) and the prompts kept (`HeadCache`).
        """
        store = self.store
        return {"store": type(store).__name__, "max_bytes": store.max_bytes, "held_bytes": store.held(),
                "evicted": store.evicted, **store.popularity(), **asdict(self.stats), "hit_rate": self.stats.hit_rate,
                "exact_passes": self.exact_passes.passes, **self.kvstore.decoded.stats(), **self.heads.prompt_stats()}

    def close(self) -> None:
        """Store what is pending, then release the store."""
        _OPEN.discard(self)
        self.exact_passes.close()
        self._writer.close()
        self.store.close()

    def __enter__(self) -> PassageCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
