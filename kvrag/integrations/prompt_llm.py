"""What the LangChain and LlamaIndex LLMs share: answering one flat prompt through its backend's `stream_prompt`.

Both frameworks hand their LLM one string. `stream_prompt_answer` wraps it in the model's chat template when asked,
answers it with kvrag's defaults (the gate included) or the settings given, and returns this call's own
`kvrag.Answer`, so that concurrent calls never read each other's. `answer_metadata` is what LangChain's
``generation_info`` and LlamaIndex's ``additional_kwargs`` report of it. The fields and what answers are in
`kvrag.integrations.fields`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

from kvrag.backend import AnswerBackend
from kvrag.integrations.fields import CALL_OPTIONS
from kvrag.query.answer import Answer
from kvrag.query.locate import chat_prompt


def stream_prompt_answer(rag: AnswerBackend, prompt: str, chat_template: bool, options: Mapping[str, Any],
                         overrides: Mapping[str, Any]) -> Generator[str, None, Answer]:
    """Yield the answer's text pieces to ``prompt`` and return its `kvrag.Answer`.

    ``options`` are the LLM's own settings; ``overrides`` the call's keyword arguments, of which those named in
    `CALL_OPTIONS` replace them (others are ignored, as frameworks pass their own).
    """
    text = chat_prompt(rag.lm.tokenizer, prompt) if chat_template else prompt
    settings = dict(options)
    settings.update((k, v) for k, v in overrides.items() if k in CALL_OPTIONS)
    settings["stop"] = tuple(settings.get("stop") or ())
    return (yield from rag.stream_prompt(text, written=prompt, **settings))


def answer_metadata(answer: Answer) -> dict[str, Any]:
    """One answer's report: time to first token, the chunks read, the mode, the recompute and the gate."""
    info = {"ttft_s": answer.ttft_s, "chunk_ids": [c.key for c in answer.chunks], "mode": answer.mode,
            "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.n_prompt_tokens,
            "timings": dict(answer.timings)}
    if answer.gate is not None:
        info["gate"] = answer.gate.to_json()
    return info
