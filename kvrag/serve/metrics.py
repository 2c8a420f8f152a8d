"""The server's Prometheus metrics, in a registry of their own (never prometheus_client's global one).

Contract: `ServeMetrics(queue_depth, active, session_stats)` registers every metric on its own
`CollectorRegistry`; `observe_answer` records one finished answer (TTFT, tokens, history reuse),
`count_request` one finished HTTP request by status code; `render()` gives the text exposition format
and its content type. The queue depth, active requests and the session cache's tiers are read when
scraped (``session_stats`` returns `rag.sessions.stats()`'s dict, or None when there is no session
cache). Metric names, all prefixed ``kvrag_``:

- ``kvrag_requests_total{endpoint, status}``: finished requests by HTTP status (499: client went away);
- ``kvrag_ttft_seconds``: time to first token (histogram), as kvrag measured it;
- ``kvrag_queue_wait_seconds``: time a request waited for a generation slot (histogram);
- ``kvrag_prompt_tokens_total``, ``kvrag_completion_tokens_total``;
- ``kvrag_history_reused_tokens_total`` (prefill saved by the history cache),
  ``kvrag_history_prefilled_tokens_total``;
- ``kvrag_queue_depth``, ``kvrag_active_requests`` (gauges);
- ``kvrag_expected_wait_seconds`` (gauge: a request's expected wait for its first token now, -1 before anything
  was measured), ``kvrag_refused_total{reason}`` (429s: ``queue`` full or expected ``wait`` too long);
- ``kvrag_held_total``, ``kvrag_held_seconds_total``: requests held in the waiting line before admission, and how
  long (``--max-hold``);
- ``kvrag_inter_token_seconds``: time between a streamed answer's text pieces (histogram);
- ``kvrag_decode_steps_batched`` (gauge): token steps run in a pass shared with other answers since start;
- ``process_resident_memory_bytes`` and the other ``process_*`` figures (where /proc exists);
- ``kvrag_chunk_caches_found_total``, ``kvrag_chunk_caches_missing_total`` (chunk caches read from the store,
  or computed again from their text: evicted or never stored), and for a store bounded in bytes
  ``kvrag_chunk_store_bytes`` and ``kvrag_chunk_store_limit_bytes``; ``kvrag_decoded_tier_hits_total``,
  ``kvrag_decoded_tier_misses_total``, ``kvrag_decoded_tier_bytes`` and ``kvrag_decoded_tier_limit_bytes`` (hot
  chunk caches kept decoded in memory, `kvrag.storage.decoded_tier`);
- ``kvrag_session_lookups_total``, ``kvrag_session_misses_total``, ``kvrag_session_saves_total``,
  ``kvrag_session_save_errors_total``, ``kvrag_session_save_seconds_total``,
  ``kvrag_session_disk_write_errors_total``, ``kvrag_session_disk_read_errors_total``, and per tier
  (``device``/``host``/``disk``) ``kvrag_session_tier_hits_total``, ``kvrag_session_tier_bytes``,
  ``kvrag_session_tier_limit_bytes``, ``kvrag_session_tier_entries``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError("kvrag serve needs prometheus-client: pip install 'kvrag[serve]'") from exc

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 120.0)
TIER_GAUGES = (("bytes", "kvrag_session_tier_bytes", "bytes held by the tier"),
               ("limit", "kvrag_session_tier_limit_bytes", "the tier's capacity in bytes"),
               ("entries", "kvrag_session_tier_entries", "conversation histories held by the tier"))


class ChunkStoreCollector(Collector):
    """Reads the index's `KVStore.stats()` at scrape time: caches found and missing, bytes held and bound."""

    def __init__(self, stats: Callable[[], dict[str, int] | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        """The chunk store's counters (and gauges for a bounded store)."""
        try:
            stats = self.stats()
        except Exception as exc:  # a scrape never fails for an unreachable store
            log.warning("reading the chunk store's figures failed: %s", exc)
            return
        if not stats:
            return
        yield CounterMetricFamily("kvrag_chunk_caches_found", "chunk caches read from the store",
                                  value=float(stats["found"]))
        yield CounterMetricFamily("kvrag_chunk_caches_missing",
                                  "chunk caches not in the store (evicted or never stored), computed from text",
                                  value=float(stats["missing"]))
        if "held_bytes" in stats:
            yield GaugeMetricFamily("kvrag_chunk_store_bytes", "bytes of chunk caches held by the bounded store",
                                    value=float(stats["held_bytes"]))
            yield GaugeMetricFamily("kvrag_chunk_store_limit_bytes", "the chunk store's bound in bytes",
                                    value=float(stats["max_bytes"]))
        if "decoded_hits" in stats:
            yield CounterMetricFamily("kvrag_decoded_tier_hits", "chunk caches fused from the decoded tier in memory",
                                      value=float(stats["decoded_hits"]))
            yield CounterMetricFamily("kvrag_decoded_tier_misses", "chunk caches the decoded tier did not hold",
                                      value=float(stats["decoded_misses"]))
            yield GaugeMetricFamily("kvrag_decoded_tier_bytes", "bytes of chunk caches kept decoded in memory",
                                    value=float(stats["decoded_bytes"]))
            yield GaugeMetricFamily("kvrag_decoded_tier_limit_bytes", "the decoded tier's bound in bytes",
                                    value=float(stats["decoded_max_bytes"]))


class SessionCollector(Collector):
    """Reads `rag.sessions.stats()` at scrape time into counters and per-tier gauges."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        """The session cache's counters and tiers as metric families (none when there is no cache)."""
        try:
            stats = self.stats()
        except Exception:  # a scrape must not fail because the cache's statistics did
            log.exception("reading the session cache's statistics failed")
            stats = None
        if not stats:
            return
        for key, name, what in (("lookups", "kvrag_session_lookups", "history lookups"),
                                ("misses", "kvrag_session_misses", "history lookups that found nothing"),
                                ("saves", "kvrag_session_saves", "conversation histories saved"),
                                ("save_errors", "kvrag_session_save_errors", "conversation histories not saved"),
                                ("save_s", "kvrag_session_save_seconds", "seconds spent saving histories"),
                                ("write_errors", "kvrag_session_disk_write_errors",
                                 "histories the disk tier could not write (a full disk): dropped"),
                                ("read_errors", "kvrag_session_disk_read_errors",
                                 "histories the disk tier could not read back: dropped, recomputed")):
            if key in stats:
                yield CounterMetricFamily(name, what, value=float(stats[key]))
        tiers = stats.get("tiers") or {}
        hits = CounterMetricFamily("kvrag_session_tier_hits", "history lookups served by each tier", labels=["tier"])
        for tier, values in tiers.items():
            hits.add_metric([tier], float(values.get("hits", 0)))
        yield hits
        for key, name, what in TIER_GAUGES:
            gauge = GaugeMetricFamily(name, what, labels=["tier"])
            for tier, values in tiers.items():
                if key in values:
                    gauge.add_metric([tier], float(values[key]))
            yield gauge


class ServeMetrics:
    """The server's metrics on their own registry.

    Args:
        queue_depth: returns how many requests wait for a slot (read at scrape time).
        active: returns how many requests are generating.
        session_stats: returns `rag.sessions.stats()` (or None).
        expected_wait: returns a request's expected wait for its first token now (None: not measured yet).
        chunk_store: returns the index's `KVStore.stats()` (or None).
        batched_steps: returns how many token steps ran in a pass shared with other answers.
    """

    def __init__(self, queue_depth: Callable[[], int], active: Callable[[], int],
                 session_stats: Callable[[], dict[str, Any] | None],
                 expected_wait: Callable[[], float | None] = lambda: None,
                 chunk_store: Callable[[], dict[str, int] | None] = lambda: None,
                 batched_steps: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvrag_requests", "finished HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvrag_ttft_seconds", "time to first token, as kvrag measured it",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram("kvrag_queue_wait_seconds", "time a request waited for a generation slot",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvrag_prompt_tokens", "prompt tokens of the answered requests", registry=r)
        self.completion_tokens = Counter("kvrag_completion_tokens", "generated tokens", registry=r)
        self.reused_tokens = Counter("kvrag_history_reused_tokens",
                                     "history tokens whose prefill the history cache saved", registry=r)
        self.prefilled_tokens = Counter("kvrag_history_prefilled_tokens",
                                        "history tokens prefilled because no cached history covered them",
                                        registry=r)
        Gauge("kvrag_queue_depth", "requests waiting for a generation slot",
              registry=r).set_function(lambda: float(queue_depth()))
        Gauge("kvrag_active_requests", "requests generating now", registry=r).set_function(lambda: float(active()))
        Gauge("kvrag_expected_wait_seconds", "a request's expected wait for its first token now (-1: not measured)",
              registry=r).set_function(lambda: float(-1.0 if (wait := expected_wait()) is None else wait))
        self.refused = Counter("kvrag_refused", "requests refused with 429, by reason (queue full, wait too long)",
                               ["reason"], registry=r)
        self.held = Counter("kvrag_held", "requests held in the waiting line before they were admitted", registry=r)
        self.held_seconds = Counter("kvrag_held_seconds", "time requests were held in the waiting line", registry=r)
        self.inter_token = Histogram("kvrag_inter_token_seconds", "time between a streamed answer's text pieces",
                                     buckets=TOKEN_BUCKETS, registry=r)
        Gauge("kvrag_decode_steps_batched", "token steps run in a pass shared with other answers, since start",
              registry=r).set_function(lambda: float(batched_steps()))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        r.register(SessionCollector(session_stats))
        r.register(ChunkStoreCollector(chunk_store))

    def count_request(self, endpoint: str, status: int) -> None:
        """Count one finished request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_refusal(self, reason: str) -> None:
        """Count one request refused with 429 (``queue`` or ``wait``)."""
        self.refused.labels(reason=reason).inc()

    def count_hold(self, seconds: float) -> None:
        """Count one request held in the waiting line for ``seconds`` before it was admitted."""
        self.held.inc()
        self.held_seconds.inc(max(seconds, 0.0))

    def observe_inter_token(self, seconds: float) -> None:
        """Record the time between two streamed text pieces."""
        self.inter_token.observe(max(seconds, 0.0))

    def observe_answer(self, answer: Any, queue_s: float) -> None:
        """Record a finished `Answer`: TTFT, tokens, history reuse, and the time it queued."""
        self.queue_wait.observe(max(queue_s, 0.0))
        if answer is None:
            return
        ttft = getattr(answer, "ttft_s", None)
        if isinstance(ttft, float) and ttft == ttft:  # not NaN
            self.ttft.observe(ttft)
        self.prompt_tokens.inc(int(getattr(answer, "n_prompt_tokens", 0) or 0))
        self.completion_tokens.inc(len(getattr(answer, "token_ids", ()) or ()))
        history = getattr(answer, "history", None)
        if history is not None:
            self.reused_tokens.inc(int(getattr(history, "reused_tokens", 0) or 0))
            self.prefilled_tokens.inc(int(getattr(history, "prefilled_tokens", 0) or 0))

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
