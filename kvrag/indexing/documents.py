"""Turn what a user hands to `KVRag.build` into ``(doc_id, text, source)`` triples.

Accepted: a string (the text itself), an ``(id, text)`` pair, a `pathlib.Path` to a file or a
folder (``*.txt``, ``*.md``, ``*.rst``, ``*.json``/``*.jsonl`` of ``{title, text}`` read
recursively), or an iterable mixing these. Files that are not UTF-8 text (binary or
undecodable) are skipped with a warning and listed in `Loaded.skipped`; empty or whitespace-only
documents are skipped likewise. Nothing is read from the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
Document = Union[str, tuple[str, str], os.PathLike]


@dataclass
class Loaded:
    """Normalised documents and what was skipped (with the reason)."""

    docs: list[tuple[str, str, str]] = field(default_factory=list)  # (doc_id, text, source)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)


def _text_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _read_file(path: Path, out: Loaded) -> None:
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        out.skipped.append((str(path), "binary file"))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        out.skipped.append((str(path), f"not UTF-8 ({exc.reason} at byte {exc.start})"))
        return
    if path.suffix in (".json", ".jsonl"):
        _read_records(path, text, out)
    else:
        _append(out, str(path), text, str(path))


def _read_records(path: Path, text: str, out: Loaded) -> None:
    try:
        if path.suffix == ".jsonl":
            items: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            items = json.loads(text)
    except json.JSONDecodeError as exc:
        out.skipped.append((str(path), f"invalid JSON: {exc}"))
        return
    for i, item in enumerate(items if isinstance(items, list) else [items]):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            out.skipped.append((f"{path}#{i}", "record without a 'text' string"))
            continue
        title = str(item.get("title", "")).strip()
        body = f"{title}\n{item['text']}" if title else item["text"]
        _append(out, str(item.get("id", f"{path}#{i}")), body, f"{path}#{i}")


def _append(out: Loaded, doc_id: str, text: str, source: str) -> None:
    if not text.strip():
        out.skipped.append((source, "empty document"))
    else:
        out.docs.append((doc_id, text, source))


def _read_path(path: Path, out: Loaded) -> None:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file() and child.suffix in TEXT_SUFFIXES + (".json", ".jsonl"):
                _read_file(child, out)
    elif path.is_file():
        _read_file(path, out)
    else:
        raise FileNotFoundError(f"document path does not exist: {path}")


def load_documents(documents: Document | Iterable[Document]) -> Loaded:
    """Normalise ``documents`` (see module docstring); raises TypeError for unknown item types."""
    out = Loaded()
    items: Iterable[Any] = [documents] if isinstance(documents, (str, os.PathLike)) else documents
    if isinstance(documents, tuple) and len(documents) == 2 and all(isinstance(x, str) for x in documents):
        items = [documents]
    for item in items:
        if isinstance(item, os.PathLike):
            _read_path(Path(item), out)
        elif isinstance(item, str):
            _append(out, _text_id(item), item, "")
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str):
            _append(out, str(item[0]), item[1], str(item[0]))
        else:
            raise TypeError(
                f"documents must be str, (id, text) pairs or pathlib.Path objects; got {type(item).__name__}"
            )
    for source, reason in out.skipped:
        log.warning("skipped %s: %s", source or "<text>", reason)
    return out
