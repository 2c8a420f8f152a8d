"""Decoding from a fused cache: the first token comes from the fusion pass's last-token logits,
the rest from ordinary single-token forward steps over the growing cache (kvrag's `RowCache` or transformers'
`DynamicCache`; run together with other answers' steps where a `kvrag.generation.step_batch.StepBatch` is installed).

The decoder knows nothing about retrieval; it sees a cache, logits and the next position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kvrag.config import GenerateConfig
from kvrag.generation import step_batch


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end generation (tokenizer EOS and the model's generation config)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def pick_token(logits: torch.Tensor, config: GenerateConfig, generator: torch.Generator | None) -> int:
    """Greedy when ``temperature == 0``, else temperature + nucleus (top-p) sampling."""
    if config.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > config.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def decode_tokens(
    model: Any, cache: Any, first_logits: torch.Tensor, start_pos: int,
    config: GenerateConfig, stop_ids: set[int], logprobs: list[float] | None = None,
) -> Iterator[int]:
    """Yield generated token ids; stops at an EOS id or after ``max_new_tokens`` (EOS not yielded).

    When ``logprobs`` is given, each yielded token's log-probability under the model is appended to it. With a
    `StepBatch` installed on this thread, each step after a yielded token is announced to it before the yield and
    taken from it when computed meanwhile.
    """
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
    logits, pos = first_logits, start_pos
    batch, step = step_batch.current(), object()  # the next step, announced to an installed batch
    try:
        for _ in range(config.max_new_tokens):
            token = pick_token(logits.cpu() if generator is not None else logits, config, generator)
            if token in stop_ids:
                return
            if logprobs is not None:
                logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
            if batch is not None:
                batch.announce(step, model, cache, token, pos)
            yield token
            taken = batch.take(step) if batch is not None else None  # computed with other answers' steps
            if taken is None:
                alone = batch.alone if batch is not None else step_batch.step_alone
                taken = alone(model, cache, token, pos)
            logits, pos = taken, pos + 1
    finally:
        if batch is not None:  # an answer that ends at a yield never takes its announced step
            batch.withdraw(step)


class TextStreamer:
    """Turns token ids into text increments, holding back partial UTF-8 and stop strings."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.stopped = True
                text = text[:cut]
        return text

    def push(self, token: int) -> str:
        """Add a token; return the new text that is safe to show."""
        self.ids.append(token)
        text = self.text()
        if text.endswith("\ufffd") and not self.stopped:
            return ""
        hold = 0 if self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        safe = text[: max(len(self.emitted), len(text) - hold)]
        delta, self.emitted = safe[len(self.emitted):], safe
        return delta

    def flush(self) -> str:
        text = self.text()
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
