"""What the LangChain and LlamaIndex LLMs share: answering one flat prompt through `KVRag.stream_prompt`.

Both frameworks hand their LLM one string. `stream_prompt_answer` wraps it in the model's chat template
when asked, answers it with kvrag's defaults (the gate included) or the settings given, and returns this
call's own `kvrag.Answer`, so that concurrent calls never read each other's. `answer_metadata` is what
LangChain's ``generation_info`` and LlamaIndex's ``additional_kwargs`` report of it; `MODE_HELP` and
`RATIO_HELP` describe their ``mode`` and ``ratio`` fields from the registry of fusion modes.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

from kvrag.fusion import available_modes, selector_class
from kvrag.query.locate import chat_prompt

# the fields' descriptions, from the registry of fusion modes (as the command line's choices are)
MODE_HELP = f"A fixed fusion mode ({', '.join(available_modes())}); None: kvrag's default under its gate."
_RATIO_MODES = [m for m in available_modes() if selector_class(m).scales_with_ratio]
RATIO_HELP = f"The recompute ratio of {' or '.join(_RATIO_MODES)}; None: the mode's default."

# the per-call options a framework may pass through ``invoke(..., **kwargs)`` or ``complete(..., **kwargs)``
CALL_OPTIONS = ("mode", "ratio", "gate", "max_new_tokens", "temperature", "top_p", "seed", "stop")


def stream_prompt_answer(rag: Any, prompt: str, chat_template: bool, options: Mapping[str, Any],
                         overrides: Mapping[str, Any]) -> Generator[str, None, Any]:
    """Yield the answer's text pieces to ``prompt`` and return its `kvrag.Answer`.

    ``options`` are the LLM's own settings; ``overrides`` the call's keyword arguments, of which those named in
    `CALL_OPTIONS` replace them (others are ignored, as frameworks pass their own).
    """
    text = chat_prompt(rag.lm.tokenizer, prompt) if chat_template else prompt
    settings = dict(options)
    settings.update((k, v) for k, v in overrides.items() if k in CALL_OPTIONS)
    settings["stop"] = tuple(settings.get("stop") or ())
    return (yield from rag.stream_prompt(text, **settings))


def answer_metadata(answer: Any) -> dict[str, Any]:
    """One answer's report: time to first token, the chunks read, the mode, the recompute and the gate."""
    info = {"ttft_s": answer.ttft_s, "chunk_ids": [c.key for c in answer.chunks], "mode": answer.mode,
            "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.n_prompt_tokens,
            "timings": dict(answer.timings)}
    if answer.gate is not None:
        info["gate"] = answer.gate.to_json()
    return info
