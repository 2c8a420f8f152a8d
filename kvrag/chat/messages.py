"""A conversation as token ids: messages checked, rendered with the model's chat template, cut per message.

Contract:

- `normalise` turns the caller's messages (dicts with ``role`` and ``content``, or objects with those
  attributes) into ``[{"role", "content"}]``: roles ``system`` (first only), ``user`` and ``assistant``;
  the last message is the user's question. Anything else raises `InputError` in one line.
- `Conversation` holds the token ids of every earlier message, each rendered and tokenized on its own
  (the template's text for messages ``[:i + 1]`` minus its text for ``[:i]``), so a message's ids — and
  the KV computed over them — do not change when later messages are added. These plain ids recognise
  the conversation. `Conversation.user_turn` gives a user message as the model sees it: with passages
  it reads ``Passages: … Question: …`` as a single question does (`kvrag.prompt`); `reply` gives an
  answer's ids after the generation prompt.
- A template whose rendering of a longer conversation does not start with its rendering of the shorter
  one cannot be cut per message: `ConversationError` (a `ValueError`) says so in one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrag.errors import InputError
from kvrag.prompt import SEPARATOR

ROLES = ("system", "user", "assistant")
_CTX = "\x00KVRAG_CONTEXT\x00"
_QUESTION = "\x00KVRAG_QUESTION\x00"


class ConversationError(ValueError):
    """The chat template cannot be cut into per-message pieces."""


def normalise(messages: Sequence[Any]) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` dicts, checked (see the module contract)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of {{'role', 'content'}} messages, got {type(messages).__name__}")
    if not messages:
        raise InputError("messages is empty; give at least one user message")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        role = getattr(role, "value", role)  # enum roles (LlamaIndex's MessageRole)
        if role not in ROLES:
            raise InputError(f"message {i} has role {role!r}; kvrag takes 'system', 'user' and 'assistant'")
        if not isinstance(content, str):
            raise InputError(f"message {i} content must be a str, got {type(content).__name__}")
        if role == "system" and i > 0:
            raise InputError(f"message {i} is a system message; only the first message may be one")
        # an answer is kept under its stripped text (`Answer.text`): a client's joined stream pieces match it
        out.append({"role": str(role), "content": content.strip() if role == "assistant" else content})
    if out[-1]["role"] != "user":
        raise InputError(f"the last message must be the user's, got {out[-1]['role']!r}")
    if not out[-1]["content"].strip():
        raise InputError("the last user message is empty")
    return out


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    """The conversation's text under the model's chat template (a plain fallback without one)."""
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))
    parts = [tokenizer.bos_token or ""]
    for m in messages:
        parts.append(m["content"] + SEPARATOR if m["role"] == "system" else f"{m['role'].title()}: {m['content']}\n")
    return "".join(parts) + ("Assistant:" if generation else "")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def ids_digest(ids: Sequence[int]) -> str:
    """A key for a token-id sequence: how a conversation's history is recognised by its prefix."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]


@dataclass
class Turn:
    """A user message as the model sees it: ``head`` ids, the passages, then ``suffix`` (with the question
    and the generation prompt). Without passages ``head`` is None and ``suffix`` is the whole message.
    """

    head: list[int] | None
    suffix: str


@dataclass
class Conversation:
    """A conversation cut per message, in token ids, ready for one more turn.

    Attributes:
        messages: the history (system first), without the last user message.
        pieces: token ids of each history message as the template renders it after the earlier ones, in
            plain text (no passages): how the conversation is recognised (`kvrag.chat.sessions`).
        question: the last user message's content.
        passages: whether user messages carry passages.
    """

    messages: list[dict[str, str]]
    pieces: list[list[int]]
    question: str
    passages: bool
    tokenizer: Any
    question_tail: str = ""

    @property
    def history_ids(self) -> list[int]:
        """The history's plain token ids, message after message."""
        return [t for piece in self.pieces for t in piece]

    def boundaries(self) -> list[int]:
        """Token offsets where each plain history message ends."""
        out, n = [], 0
        for piece in self.pieces:
            n += len(piece)
            out.append(n)
        return out

    def user_turn(self, index: int) -> Turn:
        """User message ``index`` (``len(messages)``: the coming one) as the model sees it."""
        before = self.messages[:index]
        content = f"Passages:{SEPARATOR}{_CTX}Question: {_QUESTION}" if self.passages else _QUESTION
        if self.passages and self.question_tail:
            content += "\n" + self.question_tail
        shorter = _render(self.tokenizer, before, False)
        turn = _render(self.tokenizer, [*before, {"role": "user", "content": content}], True)
        _check_prefix([shorter, turn])
        rest = turn[len(shorter):]
        head: list[int] | None = None
        if self.passages:
            head_text, _, rest = rest.partition(_CTX)
            head = _ids(self.tokenizer, head_text)
        if _QUESTION not in rest:
            raise ConversationError("the chat template dropped the user message")
        question = self.question if index == len(self.messages) else self.messages[index]["content"].strip()
        return Turn(head, rest.replace(_QUESTION, question))

    def reply(self, index: int, text: str) -> list[int]:
        """Ids of the assistant's ``text`` answering user message ``index``, after the generation prompt."""
        before = self.messages[:index]
        user = {"role": "user", "content": self.question if index == len(self.messages)
                else self.messages[index]["content"]}
        asked = _render(self.tokenizer, [*before, user], True)
        done = _render(self.tokenizer, [*before, user, {"role": "assistant", "content": text}], False)
        _check_prefix([asked, done])
        return _ids(self.tokenizer, done[len(asked):])

    def closing_pieces(self, answer: str) -> list[list[int]]:
        """The plain ids of this turn's question and of ``answer``, as the next turn's history holds them."""
        turn = [*self.messages, {"role": "user", "content": self.question}]
        done = [*turn, {"role": "assistant", "content": answer}]
        texts = [_render(self.tokenizer, self.messages, False), _render(self.tokenizer, turn, False),
                 _render(self.tokenizer, done, False)]
        _check_prefix(texts)
        return [_ids(self.tokenizer, texts[1][len(texts[0]):]), _ids(self.tokenizer, texts[2][len(texts[1]):])]


def _check_prefix(texts: list[str]) -> None:
    for shorter, longer in zip(texts, texts[1:]):
        if not longer.startswith(shorter):
            raise ConversationError("the chat template renders earlier messages differently once later ones are "
                                    "added, so a conversation's KV cannot be kept across turns")


def conversation(tokenizer: Any, messages: Sequence[Any], instruction: str, question_tail: str = "",
                 passages: bool = True) -> Conversation:
    """Cut ``messages`` (see `normalise`) into per-message token ids, ready for the coming turn.

    Without a system message, ``instruction`` (the index's) is the system message.
    """
    msgs = normalise(messages)
    if msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": instruction}, *msgs]
    history, question = msgs[:-1], msgs[-1]["content"].strip()
    texts = [_render(tokenizer, history[: i + 1], False) for i in range(len(history))]
    _check_prefix(texts)
    pieces = [_ids(tokenizer, text[len(before):]) for before, text in zip(["", *texts], texts)]
    return Conversation(history, pieces, question, passages, tokenizer, question_tail)
