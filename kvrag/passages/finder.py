r"""Find the passages a framework stuffed into a flat prompt, knowing nothing of the documents.

Contract: `find_passages(prompt)` returns the passage texts in ``prompt``, in order, each a substring of it
(`split_passages(document)`: those one document gives, wherever a prompt holds it):

- Frameworks join retrieved documents with a blank line (LangChain's tutorial ``"\n\n".join``, LlamaIndex's
  context string), so the prompt's paragraphs, split at blank lines, are the candidates.
- The template around the context shares the first and the last paragraph with the first and the last document.
  In the first paragraph the passage starts after the last *template line*: a rule (``-----``) or a line that
  starts with a label (``Context:``, ``Question: ...``), the label itself cut off. In the last paragraph it ends
  before the first rule, or else before the trailing label lines (``Question: ...``, ``Answer:``).
- A piece shorter than ``min_chars`` (a question, a heading) is no passage.

The cut depends on the passage's own text only, so a document cut once is cut the same way each time it comes
first or last; one that a template splits otherwise is simply a different passage. This module is pure string work.
"""

from __future__ import annotations

import re

MIN_CHARS = 80  # a shorter piece is not worth a cache of its own (a question, a heading, a label)
_BLANK = re.compile(r"\n[ \t]*\n")
_RULE = re.compile(r"^[ \t]*([-=_*#~])\1{2,}[ \t]*$")
_LABEL = re.compile(r"^[ \t]*[A-Z][\w ]{0,30}:[ \t]*")


def _is_template_line(line: str) -> bool:
    return bool(_RULE.match(line) or _LABEL.match(line))


def _after_template(paragraph: str) -> str:
    """The first paragraph's text after its last template line (a label's own text kept)."""
    lines = paragraph.split("\n")
    last = max((i for i, line in enumerate(lines) if _is_template_line(line)), default=None)
    if last is None:
        return paragraph
    label = _LABEL.match(lines[last])
    head = lines[last][label.end():] if label and not _RULE.match(lines[last]) else ""
    return "\n".join([head, *lines[last + 1:]])


def _before_template(paragraph: str) -> str:
    """The last paragraph's text before its first rule, or else before its trailing label lines."""
    lines = paragraph.split("\n")
    rule = next((i for i, line in enumerate(lines) if _RULE.match(line)), None)
    if rule is not None:
        return "\n".join(lines[:rule])
    while lines and _LABEL.match(lines[-1]):
        lines.pop()
    return "\n".join(lines)


def split_passages(document: str, min_chars: int = MIN_CHARS) -> list[str]:
    """The passages a document becomes inside a prompt that joins documents with blank lines: its paragraphs
    (stripped, at least ``min_chars`` long), as `find_passages` finds them there. For precomputing caches.
    """
    return list(dict.fromkeys(p.strip() for p in _BLANK.split(document) if len(p.strip()) >= min_chars))


def find_passages(prompt: str, min_chars: int = MIN_CHARS) -> list[str]:
    """The passages in ``prompt`` (stripped, each a substring of it), in order; see the module contract."""
    paragraphs = _BLANK.split(prompt)
    found: list[str] = []
    for i, paragraph in enumerate(paragraphs):
        text = paragraph
        if i == 0:
            text = _after_template(text)
        if i == len(paragraphs) - 1:
            text = _before_template(text)
        text = text.strip()
        if len(text) >= min_chars and text not in found:
            found.append(text)
    return found
