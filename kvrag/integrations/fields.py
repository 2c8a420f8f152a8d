"""The fields of kvrag's LLMs and chat models, declared once for LangChain and LlamaIndex alike.

Both frameworks' models are pydantic (v2) models, so each adapter class inherits one of these beside its framework's
base class (these first: their fields replace a base's field of the same name, such as LangChain's ``cache``):

- `AnswerFields`: what answers (``rag=``, or ``model=`` with ``cache=`` for a passage cache without an index) and how
  (``mode``, ``ratio``, ``gate``, decoding), and ``last_answer``;
- `PromptFields`: the LLMs, which are handed one flat prompt (``chat_template``);
- `ChatFields`: the chat models, which are handed a conversation (``k``, ``retrieve``, ``history_cache``, ``stop``).

Opening what answers happens once, as the model is made (`open_backend`): ``rag=`` is taken as it is; ``model=``
opens a `kvrag.passages.PassageCache` in ``cache=`` (a URL or folder); giving both, or neither, is refused in one
line. On a LangChain model ``cache`` is also LangChain's response cache: a `BaseCache` or bool given there keeps
that meaning and is left in place.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvrag.backend import AnswerBackend
from kvrag.fusion.selectors.base import available_modes, selector_class
from kvrag.passages.cache import PassageCache

# the fields' descriptions, from the registry of fusion modes (as the command line's choices are)
MODE_HELP = f"A fixed fusion mode ({', '.join(available_modes())}); None: kvrag's default under its gate."
_RATIO_MODES = [m for m in available_modes() if selector_class(m).scales_with_ratio]
RATIO_HELP = f"The recompute ratio of {' or '.join(_RATIO_MODES)}; None: the mode's default."
RAG_HELP = "An opened `kvrag.KVRag` (or a `kvrag.passages.PassageCache`); None: give model= (and cache=)."
MODEL_HELP = "Without rag=: the model (name, path or loaded) whose passage caches are kept in cache=."
CACHE_HELP = ("Without rag=: where passage caches are kept, file:///path?max_bytes=5GB or redis://host:6379/0?"
              "max_bytes=1GB; None: the user's cache folder, 5 GB. On LangChain a BaseCache or bool keeps its meaning.")

# the answering options each call passes on, and those a call may override through its keyword arguments
ANSWER_OPTIONS = ("mode", "ratio", "gate", "max_new_tokens", "temperature", "top_p", "seed")
CALL_OPTIONS = (*ANSWER_OPTIONS, "stop")
CHAT_OPTIONS = (*ANSWER_OPTIONS, "k", "retrieve", "history_cache")  # the fields a chat call passes on


def open_backend(rag: AnswerBackend | None, model: Any, cache: Any,
                 max_cache_bytes: int | str | None) -> tuple[AnswerBackend, Any]:
    """What answers (``rag``, or a passage cache for ``model`` in ``cache``) and the ``cache`` field's value after it:
    None once it named kvrag's cache, else what was given (a LangChain response cache). ValueError for both or
    neither.
    """
    ours = cache is None or isinstance(cache, str | os.PathLike)
    if rag is not None:
        if model is not None or (ours and cache is not None):
            raise ValueError("give rag= (an index) or model= with cache= (no index), not both")
        return rag, cache
    if model is None:
        raise ValueError("give rag= (an opened kvrag.KVRag) or model= (and cache=) for passage caches without an index")
    return PassageCache.open(model, str(cache) if ours and cache is not None else None,
                             max_bytes=max_cache_bytes), (None if ours else cache)


class AnswerFields(BaseModel):
    """What answers and how: the fields every kvrag LLM and chat model has (see the module's contract)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    rag: AnswerBackend | None = Field(default=None, description=RAG_HELP)
    model: Any = Field(default=None, exclude=True, description=MODEL_HELP)
    cache: Any = Field(default=None, description=CACHE_HELP)
    max_cache_bytes: int | str | None = Field(default=None, description="The cache's bound, overriding cache='s.")
    mode: str | None = Field(default=None, description=MODE_HELP)
    ratio: float | None = Field(default=None, gt=0.0, le=1.0, description=RATIO_HELP)
    gate: Any = Field(default=None, description="A `kvrag.GateConfig`, True or False; None: kvrag's default.")
    max_new_tokens: int = Field(default=64, gt=0, description="Most tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling's probability mass.")
    seed: int | None = Field(default=None, description="Sampling seed (when temperature > 0).")
    last_answer: Any = Field(default=None, exclude=True, description="The last call's `kvrag.Answer`.")

    @field_validator("rag", mode="before")
    @classmethod
    def _an_answer_backend(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, AnswerBackend):
            raise ValueError("rag must be an opened kvrag.KVRag (KVRag.open(path)) or kvrag.passages.PassageCache, "
                             f"got {type(value).__name__}")
        return value

    @model_validator(mode="after")
    def _open_backend(self) -> AnswerFields:
        self.rag, self.cache = open_backend(self.rag, self.model, self.cache, self.max_cache_bytes)
        self.model = None  # what it named is open now
        return self

    @property
    def backend(self) -> AnswerBackend:
        """What answers (opened as the model was made)."""
        assert self.rag is not None
        return self.rag

    def answer_options(self, names: tuple[str, ...] = ANSWER_OPTIONS) -> dict[str, Any]:
        """The fields every call passes on (`ANSWER_OPTIONS`), or those ``names``."""
        return {name: getattr(self, name) for name in names}


class PromptFields(AnswerFields):
    """The fields of an LLM handed one flat prompt."""

    chat_template: bool = Field(
        default=True, description="Wrap the prompt as the user turn of the model's chat template.")


class ChatFields(AnswerFields):
    """The fields of a chat model handed a conversation."""

    max_new_tokens: int = Field(default=256, gt=0, alias="max_tokens", description="Most tokens per answer.")
    k: int = Field(default=4, ge=0, description="Chunks retrieved for the last user message (0: none).")
    retrieve: bool = Field(default=True, description="Fuse the chunks retrieved for the last user message.")
    history_cache: bool = Field(default=True, description="Reuse the conversation's KV (False: prefill it).")
    stop: list[str] | None = Field(default=None, description="Strings that end the answer.")

    def chat_options(self) -> dict[str, Any]:
        """The fields a chat call passes on (`CHAT_OPTIONS`)."""
        return self.answer_options(CHAT_OPTIONS)
