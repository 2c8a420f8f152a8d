"""`PromptAnswers`: the facade's answers to a flat prompt string, as LangChain or LlamaIndex hand one to an LLM, and
the rest of what makes `KVRag` an `kvrag.backend.AnswerBackend` for the adapters (`describe`, `warm`).

`KVRag` inherits these methods. The prompt's passages are located (`kvrag.query.locate`) and the answer is then
planned, fused under the correctness gate and generated exactly as `KVRag.answer` does it for a question
(`kvrag.query.gate`). Each call returns its own `Answer`; calls from several threads run one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvrag.config import FuseConfig, GateConfig, GenerateConfig
from kvrag.query.answer import Answer, RetrievedChunk, finish
from kvrag.query.locate import index_chunks
from kvrag.query.pipeline import FusedPrompt, QueryContext, resolve_chunks
from kvrag.query.prepare import prepare_prompt, settings

if TYPE_CHECKING:
    from kvrag.fusion.selectors.base import Selector
    from kvrag.model import LoadedModel


class PromptAnswers:
    """Answers to flat prompt strings over an opened index (mixed into `KVRag`, which sets the attributes)."""

    path: Path
    lm: LoadedModel
    last_answer: Answer | None
    _lock: threading.RLock

    def describe(self) -> dict[str, str]:
        """The index's folder and model, for an adapter's identifying parameters."""
        return {"index": str(self.path), "model": str(self.lm.source)}

    def warm(self, texts: Iterable[str], show_progress: bool = True) -> int:
        """Refused: an index stores its chunks' caches when they are added (`KVRag.add`); warming is for a passage
        cache (`kvrag.passages.PassageCache`).
        """
        raise TypeError("warm() is for a passage cache (model= with cache=, no index); an index stores its chunks' "
                        "caches when they are added")

    @property
    def context(self) -> QueryContext:
        """The index's question-time state (`KVRag.context`)."""
        raise NotImplementedError

    def prepare_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, *,
                       candidates: Sequence[str | RetrievedChunk] | None = None,
                       fuse_config: FuseConfig | None = None, selector: Selector | None = None,
                       gate: GateConfig | bool | None = None) -> FusedPrompt:
        """`prepare` for a flat prompt string, as LangChain or LlamaIndex hand one to an LLM: the stored chunks
        found in it read their caches (`kvrag.query.locate`), the rest is recomputed, under the gate by default.
        Arguments as in `answer_prompt`.
        """
        asked, gate_config = settings(mode, ratio, fuse_config, selector, None, gate)  # checked first
        with self._lock:
            ctx = self.context
            found = index_chunks(ctx) if candidates is None else resolve_chunks(ctx.index, candidates)
            return prepare_prompt(ctx, prompt, found, asked, gate_config, selector)

    def stream_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, *,
                      candidates: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
                      temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
                      seed: int | None = None, fuse_config: FuseConfig | None = None,
                      selector: Selector | None = None, gate: GateConfig | bool | None = None,
                      written: str | None = None) -> Generator[str, None, Answer]:
        """Yield the answer to a flat ``prompt`` as it is generated and return its own `Answer`.

        Args mirror `answer_prompt`; ``written`` (the prompt before a chat template) is not needed here: the
        index's chunks are found in ``prompt`` itself. Fusion runs one call at a time; the pieces are decoded as
        the generator is stepped, holding no lock, so it may be stepped from any thread (frameworks step streams
        from executors).
        """
        generate = GenerateConfig(max_new_tokens, temperature, top_p, tuple(stop), seed)
        fused = self.prepare_prompt(prompt, mode, ratio, candidates=candidates, fuse_config=fuse_config,
                                    selector=selector, gate=gate)
        yield from fused.stream(generate)
        assert fused.answer is not None
        self.last_answer = fused.answer
        return fused.answer

    def answer_prompt(self, prompt: str, mode: str | None = None, ratio: float | None = None, *,
                      candidates: Sequence[str | RetrievedChunk] | None = None, max_new_tokens: int = 64,
                      temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] = (),
                      seed: int | None = None, fuse_config: FuseConfig | None = None,
                      selector: Selector | None = None, gate: GateConfig | bool | None = None) -> Answer:
        r"""Answer a flat prompt string, reusing the caches of the index's chunks found in it.

        The prompt is laid out as ``[head][passage]…[tail]`` (`kvrag.query.locate`): the head's KV is kept
        between calls by token prefix, each passage found reads its stored cache, and the answer is then made
        exactly as `answer` makes it: by default under the correctness gate, which gives the full prefill's
        answer (``gate=GateConfig(fuse=True)`` fuses long prompts).

        Args:
            prompt: the exact prompt string (no chat template is added; `kvrag.query.locate.chat_prompt` adds
                the model's).
            mode, ratio, fuse_config, selector, gate: as in `answer`.
            candidates: chunk keys or chunks that may occur in the prompt (default: every chunk of the index).
            max_new_tokens, temperature, top_p, stop, seed: decoding (greedy by default).

        Returns:
            This call's `Answer`; its ``chunks`` are the chunks whose caches the prompt could read, in prompt
            order, and ``gate`` what the gate did.

        Example:
            >>> top = rag.retrieve("Who?", k=1)[0]  # doctest: +SKIP
            >>> rag.answer_prompt("Context:\n" + top.text.strip() + "\n\nQ: Who?\nA:").chunks  # doctest: +SKIP
        """
        return finish(self.stream_prompt(prompt, mode, ratio, candidates=candidates, max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                                         fuse_config=fuse_config, selector=selector, gate=gate))
