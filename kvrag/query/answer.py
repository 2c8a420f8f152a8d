"""What a question returns: the chunks it used (`RetrievedChunk`) and the `Answer` with its timings.

`decode_into` is the generate stage's last step: it decodes from a fused cache into an `Answer`,
yielding text as it goes, and stamps the time to first token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from kvrag.config import GenerateConfig
from kvrag.generation.decode import TextStreamer, decode_tokens, eos_ids
from kvrag.model import LoadedModel
from kvrag.query.load_plan import LoadPlan
from kvrag.storage.chunk_index import ChunkRecord

T = TypeVar("T")


@dataclass(frozen=True)
class RetrievedChunk:
    """A chunk used for an answer: its key, text, retrieval score and origin, and the token ids its cache was
    computed for when they are not its text's own (`kvrag.query.pipeline.QueryContext.stored_ids`). ``in_place``:
    its cache holds its rows as a pass over this very prompt's tokens before it computed them (a passage cache's,
    `kvrag.passages.cache`), so they need no recompute where they stand.
    """

    key: str
    text: str
    score: float
    doc_id: str
    source: str
    seq: int
    ids: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    in_place: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def from_record(cls, record: ChunkRecord, score: float = math.nan) -> RetrievedChunk:
        """The chunk of an index record, with its retrieval score (NaN when not retrieved)."""
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
    token_logprobs: list[float] = field(default_factory=list)  # log-probability of each generated token
    load_plan: LoadPlan | None = None  # the loading controller's plan, for an adaptive fusion
    gate: Any = None  # the correctness gate's `GateReport`, when it ran (`kvrag.query.gate`)
    history: Any = None  # a conversation turn's `kvrag.chat.sessions.HistoryReport`

    def to_json(self) -> dict[str, Any]:
        """The answer as ``kvrag ask --json`` prints it."""
        out = {
            "answer": self.text, "mode": self.mode, "ratio": self.ratio, "ttft_s": self.ttft_s,
            "timings": self.timings, "prompt_tokens": self.n_prompt_tokens,
            "recompute_fraction": self.recompute_fraction,
            "chunks": [{"key": c.key, "score": c.score, "doc_id": c.doc_id, "source": c.source}
                       for c in self.chunks],
        }
        if self.load_plan is not None:
            out["load_plan"] = self.load_plan.to_json()
        if self.gate is not None:
            out["gate"] = self.gate.to_json()
        if self.history is not None:
            out["history"] = self.history.to_json()
        return out


def decode_into(answer: Answer, lm: LoadedModel, cache: Any, logits: torch.Tensor, n_tokens: int,
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


def finish(pieces: Generator[str, None, T]) -> T:
    """Run a generator of text pieces to its end and return what it returns (a streamed call's `Answer`)."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return cast(T, done.value)
