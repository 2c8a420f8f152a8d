"""Chat templates rendered as transformers renders them, without importing transformers (`render`).

Contract: `render(template, messages, add_generation_prompt, specials)` gives the text transformers'
``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` gives for plain messages (dicts of
strings, lists and numbers): the template compiled once in jinja2's immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the loop controls, a ``{% generation %}`` block that renders its body, a ``tojson`` that keeps
non-ASCII text, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (one that refuses
names starting with ``_``). The template sees ``messages`` (keys whose value is None dropped; a message's reasoning
under any of its names also given as ``reasoning_content`` and ``thinking``), ``tools`` and ``documents`` (None
unless given, as JSON-like data), ``add_generation_prompt``, and the tokenizer's named special tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: the body, as written (it marks what the assistant wrote)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing attribute names that start with ``_``."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot store attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """``template`` compiled in the environment of the module docstring."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(template)


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the template sees it: keys whose value is None dropped, its reasoning under every name."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
           specials: Mapping[str, Any]) -> str:
    """``messages`` in ``template`` (see the module docstring); ``specials``: the named special tokens' texts and
    any other variable the caller gives the template (``tools`` and ``documents`` as JSON-like data among them).
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    context = {"tools": None, "documents": None, **specials}
    return compiled(template).render(messages=[_message(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt, **context)
