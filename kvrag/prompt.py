"""The prompt layout ``[prefix][chunk 1]…[chunk k][question suffix]``, in token ids.

The prefix (chat-template head, instruction, "Passages:") and the suffix (question, template tail,
generation prompt) come from the model's chat template, rendered once with sentinels. Each chunk
is tokenized on its own as ``text.strip() + SEPARATOR``, so its token ids — and therefore its
cached KV — do not depend on its neighbours.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

DEFAULT_INSTRUCTION = (
    "Answer the question using the passages. Reply with a short answer of a few words."
)
SEPARATOR = "\n\n"
_CTX = "\x00KVRAG_CONTEXT\x00"
_QUESTION = "\x00KVRAG_QUESTION\x00"


@dataclass(frozen=True)
class PromptLayout:
    """Token-level prompt template shared by indexing and querying.

    Attributes:
        prefix_text: everything before the first passage.
        suffix_template: everything after the last passage, with ``{question}`` in place.
        prefix_ids: token ids of ``prefix_text`` (special tokens as the template renders them).
        instruction: the system instruction used.
        question_tail: the line put after the question ("" for none).
    """

    prefix_text: str
    suffix_template: str
    prefix_ids: tuple[int, ...]
    instruction: str
    question_tail: str = ""

    def digest(self) -> str:
        """A hash of the layout's token ids and text, kept in the manifest to detect a changed tokenizer."""
        payload = json.dumps([self.prefix_ids, self.suffix_template], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """The layout as the manifest stores it."""
        return {"instruction": self.instruction, "question_tail": self.question_tail, "digest": self.digest()}


def _render(tokenizer: Any, instruction: str, question_tail: str) -> str:
    user = f"Passages:{SEPARATOR}{_CTX}Question: {_QUESTION}"
    if question_tail:
        user += "\n" + question_tail
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": instruction},
            {"role": "user", "content": user},
        ]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    bos = tokenizer.bos_token or ""
    return f"{bos}{instruction}{SEPARATOR}{user}\nAnswer:"


def build_layout(tokenizer: Any, instruction: str = DEFAULT_INSTRUCTION,
                 question_tail: str = "") -> PromptLayout:
    """Render the model's chat template around sentinels and split it into prefix and suffix.

    ``question_tail``, when given, is a line put right after the question. The chunk caches depend on the
    prefix alone; the tail only changes the suffix.
    """
    tail = question_tail.strip()
    rendered = _render(tokenizer, instruction, tail)
    head, _, rest = rendered.partition(_CTX)
    if _QUESTION not in rest:
        raise ValueError("the chat template dropped the user message; cannot build a prompt layout")
    suffix_template = rest.replace("{", "{{").replace("}", "}}").replace(_QUESTION, "{question}")
    prefix_ids = tuple(tokenizer(head, add_special_tokens=False)["input_ids"])
    return PromptLayout(head, suffix_template, prefix_ids, instruction, tail)


def chunk_text_for_prompt(text: str) -> str:
    """How a chunk appears in the prompt: stripped, followed by the separator."""
    return text.strip() + SEPARATOR


def chunk_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one chunk as it appears in the prompt."""
    return list(tokenizer(chunk_text_for_prompt(text), add_special_tokens=False)["input_ids"])


def suffix_text(layout: PromptLayout, question: str) -> str:
    """The prompt text after the passages: the question, the optional tail and the generation prompt."""
    return layout.suffix_template.format(question=question.strip())


def suffix_token_ids(tokenizer: Any, layout: PromptLayout, question: str) -> list[int]:
    """Token ids of the question suffix."""
    return list(tokenizer(suffix_text(layout, question), add_special_tokens=False)["input_ids"])


def prompt_text(layout: PromptLayout, chunk_texts: list[str], question: str) -> str:
    """The flat prompt string equivalent to the token layout (for frameworks that want text)."""
    body = "".join(chunk_text_for_prompt(t) for t in chunk_texts)
    return layout.prefix_text + body + suffix_text(layout, question)
