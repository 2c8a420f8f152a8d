"""What the LangChain and LlamaIndex LLMs share: answering one flat prompt through `KVRag.stream_prompt`.

Both frameworks hand their LLM one string. `stream_prompt_answer` wraps it in the model's chat template
when asked, answers it with kvrag's defaults (the gate included) or the settings given, and returns this
call's own `kvrag.Answer`, so that concurrent calls never read each other's. `answer_metadata` is what
LangChain's ``generation_info`` and LlamaIndex's ``additional_kwargs`` report of it; `MODE_HELP` and
`RATIO_HELP` describe their ``mode`` and ``ratio`` fields from the registry of fusion modes. `open_backend` gives
the LLMs what answers their prompts: the `kvrag.KVRag` given, or, with no index, a `kvrag.passages.PassageCache`
for ``model`` over the ``cache`` URL, which finds the passages in each prompt itself.
"""

from __future__ import annotations

import os
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


RAG_HELP = "An opened `kvrag.KVRag` (or a `kvrag.passages.PassageCache`); None: give model= (and cache=)."
MODEL_HELP = "Without rag=: the model (name, path or loaded) whose passage caches are kept in cache=."
CACHE_HELP = ("Without rag=: where passage caches are kept, file:///path?max_bytes=5GB or redis://host:6379/0?"
              "max_bytes=1GB; None: the user's cache folder, 5 GB.")


def open_backend(rag: Any, model: Any, cache: str | None, max_cache_bytes: int | str | None) -> Any:
    """``rag`` when given, else a `kvrag.passages.PassageCache` for ``model`` in ``cache``; ValueError for neither."""
    if rag is not None:
        if model is not None or cache is not None:
            raise ValueError("give rag= (an index) or model= with cache= (no index), not both")
        return rag
    if model is None:
        raise ValueError("give rag= (an opened kvrag.KVRag) or model= (and cache=) for passage caches without an index")
    from kvrag.passages import PassageCache

    return PassageCache.open(model, cache, max_bytes=max_cache_bytes)


def open_langchain_backend(rag: Any, model: Any, cache: Any, max_cache_bytes: int | str | None) -> tuple[Any, Any]:
    """`open_backend` for a LangChain model, whose ``cache`` field is also LangChain's response cache: a str or path
    names kvrag's passage cache (the field is then reset to None, LangChain's default); anything else is LangChain's
    (a ``BaseCache`` or bool) and kept. Returns the backend and the field's new value.
    """
    ours = isinstance(cache, str | os.PathLike)
    return open_backend(rag, model, cache if ours else None, max_cache_bytes), (None if ours else cache)


def describe_backend(rag: Any) -> dict[str, Any]:
    """What answers an LLM's prompts, for its identifying parameters: the index's folder or the cache's store."""
    where = str(rag.path) if hasattr(rag, "path") else f"{type(rag.store).__name__} {getattr(rag.store, 'root', '')}"
    return {"index" if hasattr(rag, "path") else "cache": where, "model": rag.lm.source}


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
    if hasattr(rag, "passages_in"):  # a passage cache: the passages of the prompt as the framework wrote it
        settings["passages"] = rag.passages_in(prompt)
    return (yield from rag.stream_prompt(text, **settings))


def answer_metadata(answer: Any) -> dict[str, Any]:
    """One answer's report: time to first token, the chunks read, the mode, the recompute and the gate."""
    info = {"ttft_s": answer.ttft_s, "chunk_ids": [c.key for c in answer.chunks], "mode": answer.mode,
            "recompute_fraction": answer.recompute_fraction, "prompt_tokens": answer.n_prompt_tokens,
            "timings": dict(answer.timings)}
    if answer.gate is not None:
        info["gate"] = answer.gate.to_json()
    return info
