"""Frozen configuration dataclasses, one per concern, passed down explicitly.

What the user chooses lives here (and `switched_off`, how an environment switch such as ``KVRAG_NATIVE_MODELS`` is
read); what the model dictates lives in `kvrag.model.loading.ModelSpec`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from kvrag.sizes import parse_bytes

SplitMode = Literal["semantic", "fixed", "document"]
ATTENTION_KERNELS: tuple[str, ...] = ("auto", "blocks", "flex", "tiles")
# The mode an answer fuses with when none is named: at the same ratio `probe` agreed with `full` more than
# `cacheblend` on every data set measured (benchmarks/README.md, "`probe` against `cacheblend`").
DEFAULT_MODE = "probe"


@dataclass(frozen=True)
class SplitConfig:
    """How documents are cut into chunks (KVSplit).

    Attributes:
        mode: ``"semantic"`` groups sentences under a token budget, preferring paragraph breaks and
            drops in neighbouring-sentence similarity; ``"fixed"`` cuts every ``max_tokens`` tokens;
            ``"document"`` keeps each document whole as one chunk (one passage = one chunk) and
            falls back to ``"semantic"`` for a document over the budget.
        max_tokens: hard budget per chunk, in the LLM tokenizer's tokens.
        min_tokens: a semantic chunk is not closed before it holds this many tokens (unless the
            document ends).
        similarity_drop: a semantic shift is a neighbouring-sentence cosine similarity this far
            below the document's median.
    """

    mode: SplitMode = "semantic"
    max_tokens: int = 256
    min_tokens: int = 64
    similarity_drop: float = 0.15

    def __post_init__(self) -> None:
        if self.mode not in ("semantic", "fixed", "document"):
            raise ValueError(
                f"SplitConfig.mode must be 'semantic', 'fixed' or 'document', got {self.mode!r}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"SplitConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SplitConfig.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )


@dataclass(frozen=True)
class CodecConfig:
    """Which codec stores chunk caches by default, and at which level (None: the codec's own default).

    ``cachegen`` at its default level 2 stores SmolLM2-135M's caches 4.8x smaller than bf16 (9.6x smaller
    than float32 ``raw``); its answers were the closest to uncompressed caches' per byte among the levels
    measured (benchmarks/codec-default-level). ``raw`` is lossless.
    """

    name: str = "cachegen"
    level: int | None = None


# `kvrag serve`'s slice of a fusion or prefill between two rounds of the answers already streaming, in tokens' work
# (`kvrag.fusion.slicing`), for a model on the CPU; chosen in benchmarks/serve-load/README.md ("Chunked prefill").
# On a GPU (not measured) a first step runs whole unless a budget is given.
PREFILL_CHUNK_TOKENS = 32
# ... and a slice ends only once this many seconds passed since the streaming answers' last round (0: at every
# budget's end): each hand-back runs a round of token steps that reads every weight, so a longer interval gives more
# answers a second and longer gaps between tokens (same README)
PREFILL_SLICE_INTERVAL_S = 0.0


def prefill_chunk_tokens(asked: int | str | None, device_type: str) -> int | None:
    """The slice budget `kvrag serve` runs with: ``asked`` (a positive int; 0 or None: a first step runs whole), or
    for ``"auto"`` `PREFILL_CHUNK_TOKENS` on the CPU and whole on other devices.
    """
    if asked == "auto":
        return PREFILL_CHUNK_TOKENS if device_type == "cpu" else None
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 0):
        raise ValueError(f"prefill_chunk_tokens must be an int >= 0, None or 'auto', got {asked!r}")
    return asked or None


@dataclass(frozen=True)
class SessionConfig:
    """Where conversations' kept KV lives between turns (`kvrag.chat.tiers`): each tier bounded in bytes.

    Attributes:
        device_bytes: KV kept in the model's GPU memory (used only when the model is on a GPU).
        host_bytes: KV kept in host memory.
        disk_bytes: KV written to ``disk_dir``; 0 turns the disk tier off.
        disk_dir: the disk tier's folder (None: a temporary folder, removed when the index is closed).
        max_context: the token budget of one turn's prompt plus its answer (None: the model's context
            window); over it, the oldest turns are dropped (`kvrag.chat.history`).
    """

    device_bytes: int = 2 << 30
    host_bytes: int = 1 << 30
    disk_bytes: int = 8 << 30
    disk_dir: str | None = None
    max_context: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SessionConfig.{name} must be an int >= 0, got {value!r}")
        if self.max_context is not None and self.max_context < 16:
            raise ValueError(f"SessionConfig.max_context must be >= 16 tokens, got {self.max_context}")


@dataclass(frozen=True)
class StoreConfig:
    """Where and how chunk caches are stored (`kvrag.storage.stores.index_store.open_index_store`; docs/stores.md).

    Attributes:
        backend: ``"disk"`` (the default) is the index's own store: its ``chunks/`` folder, or the URL it was
            built with. Anything else names a store by URL or path and, given to an existing index, overrides
            the recorded one (the same caches at another URL): ``file:///abs/path``, or a shared Redis or
            Valkey ``redis://[[USER]:PASSWORD@]HOST:PORT/DB`` (``rediss://`` with TLS).
        fsync: whether a file store flushes each write to stable storage before it returns.
        cache_bytes: the bound of the in-memory LRU cache of hot chunk caches kept in front of a remote store, in
            bytes or a size such as ``"256MiB"`` (`kvrag.sizes.parse_bytes`; 0 turns it off).
        connect_timeout_s, timeout_s: a remote store's connect timeout and its timeout per command.
        retries: how many times a remote command is tried again (with exponential backoff) after a
            connection error (a timeout is not tried again).
        retry_after_s: after a remote store failed, for how long it is taken as away without asking it
            again (chunks are then computed from their text).
        decoded_bytes: the bound of the process's tier of hot chunk caches kept decoded in memory
            (`kvrag.storage.decoded_tier`, on the CPU), in bytes or a size: a chunk read again is fused from there,
            neither read nor decoded (0 turns it off).
        cache_mb, decoded_mb: deprecated, in MiB: ``cache_bytes`` and ``decoded_bytes`` (a DeprecationWarning).
        max_bytes: a bound on the chunk caches' bytes in the store (None: none), caches not read since stored
            evicted first (`kvrag.storage.stores.BoundedDiskStore`, `BoundedRedisStore`); an evicted cache is computed
            again from its text when a prompt needs it. Given to a new index, it is recorded and kept.
    """

    backend: str = "disk"
    fsync: bool = True
    cache_bytes: int | str = 256 << 20
    connect_timeout_s: float = 1.0
    timeout_s: float = 5.0
    retries: int = 2
    retry_after_s: float = 5.0
    max_bytes: int | None = None
    decoded_bytes: int | str = 512 << 20
    cache_mb: float | None = None
    decoded_mb: float | None = None

    @staticmethod
    def decoded_bytes_of(store: str | StoreConfig | None) -> int:
        """The decoded tier's bound in bytes for ``store`` (a `KVRag` ``store=`` argument): its ``decoded_bytes``, else
        the default.
        """
        return int((store if isinstance(store, StoreConfig) else StoreConfig()).decoded_bytes)

    def __post_init__(self) -> None:
        if self.max_bytes is not None and not self.max_bytes > 0:
            raise ValueError(f"StoreConfig.max_bytes must be > 0 (or None), got {self.max_bytes!r}")
        if not self.backend:
            raise ValueError("StoreConfig.backend must name a store, got an empty string")
        for old, new in (("cache_mb", "cache_bytes"), ("decoded_mb", "decoded_bytes")):
            value = getattr(self, old)
            if value is not None:  # the sizes in MiB these bounds had before
                warnings.warn(f"StoreConfig.{old} is deprecated; give {new} (bytes, or a size such as '256MiB')",
                              DeprecationWarning, stacklevel=3)
                if not value >= 0:
                    raise ValueError(f"StoreConfig.{old} must be >= 0, got {value!r}")
                object.__setattr__(self, new, int(value * (1 << 20)))
                object.__setattr__(self, old, None)
            object.__setattr__(self, new, parse_bytes(getattr(self, new), f"StoreConfig.{new}", zero=True))
        if not (self.connect_timeout_s > 0 and self.timeout_s > 0):
            raise ValueError(f"StoreConfig timeouts must be > 0, got {self.connect_timeout_s!r}, {self.timeout_s!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"StoreConfig.retries must be an int >= 0, got {self.retries!r}")
        if not self.retry_after_s >= 0:
            raise ValueError(f"StoreConfig.retry_after_s must be >= 0, got {self.retry_after_s!r}")


@dataclass(frozen=True)
class FuseConfig:
    """How retrieved chunk caches are fused at query time.

    Attributes:
        mode: the name of a registered selector (`kvrag.fusion.available_modes`): the built-in
            ``full``, ``prefix``, ``reuse``, ``cacheblend``, ``attnlink`` and ``probe`` (the default,
            `DEFAULT_MODE`), or one added with `kvrag.fusion.register_selector`. An unknown name is refused
            where the selector is made (`kvrag.fusion.selector_class`), before any work.
        ratio: the fraction of chunk tokens recomputed, in (0, 1]: ``cacheblend``'s target after
            its last check layer, ``probe``'s selection through every layer.
        options: the mode's own settings, which its selector reads and checks (`Selector.Options`):
            ``cacheblend``: ``check_layers`` (default ``(1, 2, 3)``), ``first_ratio_scale`` (2.0) and ``score``
            (``"kv_attention"``); ``attnlink``: ``link_tokens`` (16); ``probe``: ``probe_from`` (0.33) and
            ``probe_to`` (1.0). A new mode's knobs are its own options, not fields here. E.g.
            ``FuseConfig("attnlink", options={"link_tokens": 32})``.
        attention: how tokens selected at scattered positions attend to the cache: ``"blocks"``
            (the decoder layer runs once per position-ordered block, each under a dense mask),
            ``"flex"`` (one decoder call per layer, its attention FlexAttention under a block mask;
            compiled on CUDA, an unfused reference elsewhere), ``"tiles"`` (on the CPU: one decoder call
            per layer, its attention in tiles of unmasked and masked keys, `kvrag.fusion.tiled_attention`, and
            a probe pass reading the question's attention from the layer's own products; elsewhere
            ``blocks``) or ``"auto"`` (the default: ``tiles`` on the CPU; on CUDA, where it compiles and
            runs, ``flex`` for selections attending to at least ``kvrag.fusion.attention.FLEX_MIN_KEYS``
            keys, ``blocks`` otherwise). All are exact. FlexAttention is compiled by the first fusion that
            uses it in a process, which is then slow.
        adaptive: let the loading controller (`kvrag.query.plan`) plan fusions that load from the
            store: recompute the last chunks from their text when loading them would take longer
            than recomputing them, and raise ``cacheblend``'s ratio (up to its
            ceiling) while loading would still hide the recompute. ``ratio`` stays the floor. Plans
            use the throughputs measured by earlier fusions of the same `KVRag` (or benchmark
            workload); until then nothing changes.
        ttft_slo: a time-to-first-token target in seconds for fusions that load from the store (CacheGen's
            bandwidth-adaptive streaming, `kvrag.query.plan`): per chunk, the loader picks the best stored
            encoding level (the index's own and its ``stream_levels``) whose transfer at the store link's
            measured throughput still meets the target, or the chunk's text (recomputed) where none does.
            None (the default) loads every chunk at the index's own level. ``Answer.load_plan`` says what
            was chosen and why.
    """

    mode: str = DEFAULT_MODE
    ratio: float = 0.15
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    attention: str = "auto"
    adaptive: bool = False
    ttft_slo: float | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        # the mode's name is checked against the selectors' registry where a selector is made from it
        # (`kvrag.fusion.selectors.selector_class`): the registry belongs to fusion, a later stage
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"mode must name a fusion mode, got {self.mode!r}")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise ValueError(f"options must map option names to values, got {self.options!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if not (isinstance(self.ratio, (int, float)) and 0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        if self.ttft_slo is not None and not (isinstance(self.ttft_slo, (int, float)) and self.ttft_slo > 0):
            raise ValueError(f"ttft_slo must be a number of seconds > 0, got {self.ttft_slo!r}")

    def with_options(self, **options: Any) -> FuseConfig:
        """A copy with ``options`` set on top of this config's own."""
        return replace(self, options={**self.options, **options})


SHORT_MODES = ("prefix", "full")  # `GateConfig.short_mode`


@dataclass(frozen=True)
class GateConfig:
    """When an answer trusts its fused cache, and what it does when it does not (`kvrag.query.gate`).

    The gate runs for the default mode (no mode, ratio or fusion settings passed) unless turned off.
    It checks the fused pass's first token before decoding; a failed check escalates through
    ``ladder`` (the same mode at larger recompute ratios) and at the end to a full prefill.

    By default the gate answers exactly: every stale token is recomputed (a short prompt's first chunk cache, exact
    where it stands, is read, and so are kept heads and prompts and rows stored in place), so the answer is the full
    prefill's but for the codec's rounding of what is read. Fusion, sooner and approximate, runs with ``fuse=True``
    (or ``strict``): with SmolLM2-135M, fused answers at ~1,600 tokens lost every single-fact answer that the full
    prefill got right (12 of 12 through LlamaIndex, 13 of 13 through `KVRag.answer`), and no signal read off a fused
    pass told drifting answers from faithful ones cheaply enough (benchmarks/quality-long-prompts, quality-gate).

    Attributes:
        fuse: fuse prompts of at least ``full_below_tokens`` stale tokens at the mode's ratio instead of answering
            them exactly: sooner (2.5-3x at 2K tokens with SmolLM2 on a CPU), with answers close to, not equal to,
            the full prefill's. Off by default.
        full_below_tokens: prompts whose stale chunk tokens (all but the first chunk, whose cache is
            exact) number fewer than this have all of them recomputed (``short_mode``): fusion saves
            little there.
        short_mode: how such a short prompt is answered. ``"prefix"`` reads the first chunk's stored cache,
            computed right after the prompt prefix, and recomputes every token after it: the full
            prefill's answer but for the codec's rounding of that one chunk (none with ``raw``).
            ``"full"`` prefills the whole prompt. In a conversation, where no chunk cache is exact,
            and under ``strict``, short prompts are prefilled in full.
        fuse_max_text_share: a prompt in which more than this share of the tokens has no stored cache (text a
            framework wrote, passages not cached yet) is prefilled in full: a fused pass recomputes those tokens
            at a higher cost per token than a full prefill: with SmolLM2 on CPU at 2K tokens it was 0.78x a full
            prefill's time at a fifth of the prompt in text and 1.2x at a third (benchmarks/any-retriever).
        max_text_before: a prompt with more than this many tokens of text before its first passage that no kept
            head holds (a question placed before the context, as LangChain's tutorial prompt does) is prefilled in
            full: every passage attends to that text in a full prefill, and no stored cache has seen it. Fused
            under LangChain's tutorial prompt, answers agreed 0.37-0.68 with the full prefill's at ~2K tokens at
            every recompute ratio tried, 15-50 % (benchmarks/frameworks).
        min_margin: the fused first token's log-probability lead over the runner-up, below which the
            cache is not trusted (0 turns the margin check off).
        probe_must_agree: distrust a fused pass whose first token differs from the one its probe pass
            (the question alone over the stored caches) predicted, unless the fused margin is at least
            ``sure_margin``. Modes without a probe pass through every layer (``probe`` with ``probe_to`` below 1)
            skip this check.
        sure_margin: a margin at which the fused first token is trusted even against the probe.
        ladder: recompute ratios tried in order after a failed check, before a full prefill.
        strict: answer from a fused cache only when a stricter check passes at the first ratio (a margin of
            at least ``strict_margin`` and, with a probe pass, the same first token); any failure goes
            straight to a full prefill (the ladder is skipped).
        strict_margin: the margin a strict check requires.
    """

    fuse: bool = False
    full_below_tokens: int = 512
    short_mode: str = "prefix"
    fuse_max_text_share: float = 0.25
    max_text_before: int = 8
    min_margin: float = 0.0
    probe_must_agree: bool = False
    sure_margin: float = float("inf")
    ladder: tuple[float, ...] = ()
    strict: bool = False
    strict_margin: float = 3.0

    def __post_init__(self) -> None:
        if self.full_below_tokens < 0:
            raise ValueError(f"full_below_tokens must be >= 0, got {self.full_below_tokens}")
        if self.short_mode not in SHORT_MODES:
            raise ValueError(f"short_mode must be one of {', '.join(SHORT_MODES)}, got {self.short_mode!r}")
        if self.max_text_before < 0:
            raise ValueError(f"max_text_before must be >= 0, got {self.max_text_before}")
        if not 0 <= self.fuse_max_text_share <= 1:
            raise ValueError(f"fuse_max_text_share must be in [0, 1], got {self.fuse_max_text_share}")
        if min(self.min_margin, self.sure_margin, self.strict_margin) < 0:
            raise ValueError(f"margins must be >= 0, got {self.min_margin}, {self.sure_margin}, {self.strict_margin}")
        if any(not 0 < r <= 1 for r in self.ladder) or list(self.ladder) != sorted(set(self.ladder)):
            raise ValueError(f"ladder must be increasing ratios in (0, 1], got {self.ladder}")

    @property
    def fuses(self) -> bool:
        """Whether prompts past the short ones are fused (``fuse`` or ``strict``) rather than prefilled in full."""
        return self.fuse or self.strict


@dataclass(frozen=True)
class GenerateConfig:
    """Decoding settings. Greedy unless ``temperature > 0``."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def switched_off(variable: str) -> bool:
    """Whether the environment switch ``variable`` turns its feature off (``0``, ``false``, ``no`` or ``off``)."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")
