"""OpenAI's chat-completions wire format: parsing a request body, shaping responses, chunks and errors.

Contract: `parse_chat_request(body, defaults)` turns a decoded JSON body into a `ChatRequest` or raises
`RequestError` (HTTP status 400, one-line message, the offending parameter) — nothing else. Messages
come out as plain ``{"role", "content"}`` dicts (``developer`` becomes ``system``; content given as a
list of text parts is joined). kvrag's retrieval options ride in the same body (OpenAI clients' "extra
body"): ``k``, ``mode``, ``ratio``, ``retrieve`` and ``history_cache``. Fields OpenAI defines that kvrag
has no use for are ignored; ones it cannot honour (``n`` > 1, tools, ``logprobs``) are refused.
`completion_body`, `chunk_body`, `usage_body` and `error_body` build the response objects; every float
in them is finite or None, so they are strict JSON. Nothing here imports FastAPI or torch.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED_ROLES = ("tool", "function")
MAX_STOP = 4


class RequestError(Exception):
    """A request kvrag refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        """The error as OpenAI's ``{"error": {...}}`` JSON object."""
        return error_body(self.message, self.kind, self.param, self.code)


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for the options it leaves out (the server's settings)."""

    k: int = 4
    max_tokens: int = 256
    history_cache: bool = True
    modes: tuple[str, ...] = ()  # the fusion modes a request may name (empty: not checked here)


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completions request: the conversation, decoding and retrieval options."""

    messages: list[dict[str, str]]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    k: int = 4
    mode: str | None = None
    ratio: float | None = None
    retrieve: bool = True
    history_cache: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def chat_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `KVRag.chat_stream` (after the messages) for this request."""
        return dict(k=self.k, mode=self.mode, ratio=self.ratio, retrieve=self.retrieve,
                    max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    stop=self.stop, seed=self.seed, history_cache=self.history_cache)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _content(message: Mapping[str, Any], i: int) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(f"messages[{i}].content: only text parts are supported, got {kind!r}",
                                   f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise RequestError(f"messages[{i}] has no content (tool calls are not supported)", f"messages[{i}].content")
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got "
                       f"{type(content).__name__}", f"messages[{i}].content")


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """The ``messages`` array as ``{"role", "content"}`` dicts, or `RequestError` naming what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array of {role, content} objects", "messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = message.get("role")
        if role in UNSUPPORTED_ROLES:
            raise RequestError(f"messages[{i}].role {role!r} is not supported (no tools)", f"messages[{i}].role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                               f"messages[{i}].role")
        role = "system" if role == "developer" else role
        if role == "system" and i != 0:
            raise RequestError(f"messages[{i}]: a system message may only come first", f"messages[{i}].role")
        messages.append({"role": role, "content": _content(message, i)})
    if messages[-1]["role"] != "user":
        raise RequestError(f"the last message must have role 'user', got {messages[-1]['role']!r}", "messages")
    if not messages[-1]["content"].strip():
        raise RequestError("the last user message is empty", "messages")
    return messages


def _optional(body: Mapping[str, Any], name: str, check: Any, what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise RequestError(f"'{name}' must be {what}, got {value!r}", name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise RequestError(f"'stop' must be a non-empty string or an array of at most {MAX_STOP} of them", "stop")
    return tuple(stops)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"'n' must be 1 (kvrag returns one choice), got {n!r}", "n")
    if body.get("tools") or body.get("functions"):
        raise RequestError("tools and functions are not supported", "tools")
    if body.get("logprobs"):
        raise RequestError("'logprobs' is not supported", "logprobs")
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format {fmt.get('type')!r} is not supported (text only)", "response_format")


def parse_chat_request(body: Any, defaults: RequestDefaults) -> ChatRequest:
    """A chat-completions body as a `ChatRequest`.

    Raises:
        RequestError: the body is not an object, or a field has a bad value (the message names it).
    """
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
    messages = parse_messages(body.get("messages"))
    model = _optional(body, "model", lambda v: isinstance(v, str), "a string")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false")
    options = _optional(body, "stream_options", lambda v: isinstance(v, Mapping), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", "stream_options")
    positive = (lambda v: _is_int(v) and v >= 1, "a positive integer")
    max_tokens = _optional(body, "max_completion_tokens", *positive)
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", *positive)
    temperature = _optional(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number in [0, 2]")
    top_p = _optional(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    seed = _optional(body, "seed", _is_int, "an integer")
    k = _optional(body, "k", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    mode = _optional(body, "mode", lambda v: isinstance(v, str) and (not defaults.modes or v in defaults.modes),
                     f"one of {', '.join(defaults.modes)}" if defaults.modes else "a string")
    ratio = _optional(body, "ratio", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    retrieve = _optional(body, "retrieve", lambda v: isinstance(v, bool), "true or false")
    history = _optional(body, "history_cache", lambda v: isinstance(v, bool), "true or false")
    return ChatRequest(
        messages=messages, model=model, stream=bool(stream), include_usage=include_usage,
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=0.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p), stop=_stop(body.get("stop")), seed=seed,
        k=defaults.k if k is None else k, mode=mode, ratio=None if ratio is None else float(ratio),
        retrieve=True if retrieve is None else retrieve,
        history_cache=defaults.history_cache and (True if history is None else history),
    )


# -- responses ------------------------------------------------------------------------------------


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) inside it replaced by None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def new_completion_id() -> str:
    """A fresh ``chatcmpl-…`` id."""
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(completion_id: str, model: str, text: str, finish_reason: str, usage: dict[str, int],
                    extra: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice, ``usage``, and kvrag's ``extra`` under ``"kvrag"``."""
    return {
        "id": completion_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage, "system_fingerprint": None, "kvrag": finite(extra),
    }


def chunk_body(completion_id: str, model: str, created: int, delta: dict[str, Any] | None = None,
               finish_reason: str | None = None, usage: dict[str, int] | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``: a delta (or, with ``usage`` and no delta, the final usage-only chunk)."""
    body: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "system_fingerprint": None}
    if delta is None and usage is not None:
        body["choices"] = []
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]
    if usage is not None:
        body["usage"] = usage
    if extra is not None:
        body["kvrag"] = finite(extra)
    return body
