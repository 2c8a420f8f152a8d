"""Turn what a user hands to `KVRag.build` into ``(doc_id, text, source)`` triples.

Accepted: a string (the text itself), an ``(id, text)`` pair, a `pathlib.Path` to a file or a
folder, a `Loaded` from an earlier call (used as it is), or an iterable mixing these. Files are read
by their suffix (case-insensitive):

- ``.txt .md .rst .text``: UTF-8 text;
- ``.json``/``.jsonl``: records ``{title, text[, id]}``, one document each;
- ``.html .htm .xhtml``: the visible text (standard library parser; scripts, styles and templates
  dropped, block elements kept as paragraph breaks);
- ``.pdf``: the text layer of every page, via ``pypdf`` (pages are paragraphs);
- ``.docx``: paragraphs and table rows in document order, via ``python-docx``.

A file named directly is read as text whatever its suffix (unless it is one of the formats above).
A folder is read recursively, hidden files and folders (``.name``) left out; its files of other
types are skipped. Everything that cannot be read (binary, undecodable, encrypted or scanned PDFs,
broken files, empty documents) is listed in `Loaded.skipped` with a short reason, and
`load_documents` logs one warning naming them (`skipped_summary`). Nothing is read from the
network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Union

from kvrag.errors import InputError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
RECORD_SUFFIXES = (".json", ".jsonl")
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
PDF_SUFFIXES = (".pdf",)
DOCX_SUFFIXES = (".docx",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES + HTML_SUFFIXES + PDF_SUFFIXES + DOCX_SUFFIXES
_SNIFF_BYTES = 8192


@dataclass
class Loaded:
    """Normalised documents and what was skipped (with the reason)."""

    docs: list[tuple[str, str, str]] = field(default_factory=list)  # (doc_id, text, source)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)

    def skipped_summary(self, limit: int = 5) -> str:
        """One line naming what was skipped and why (`skipped_summary`); ``""`` when nothing was."""
        return skipped_summary(self.skipped, limit)


Document = Union[str, tuple[str, str], os.PathLike, Loaded]


class _Skip(Exception):
    """A file that cannot be read; the message is the short reason recorded in `Loaded.skipped`."""


def skipped_summary(skipped: list[tuple[str, str]], limit: int = 5) -> str:
    """``"skipped 2 files: a.bin (not text), b.pdf (encrypted)"``, naming at most ``limit`` of them."""
    if not skipped:
        return ""
    files = all("#" not in source and source for source, _ in skipped)
    noun = ("file" if files else "item") + ("" if len(skipped) == 1 else "s")
    named = [f"{source or '<text>'} ({reason})" for source, reason in skipped[:limit]]
    more = f" and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return f"skipped {len(skipped)} {noun}: {', '.join(named)}{more}"


def _text_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _is_binary(data: bytes) -> bool:
    return b"\x00" in data[:_SNIFF_BYTES]


def _decode_utf8(data: bytes) -> str:
    if _is_binary(data):
        raise _Skip("not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _Skip(f"not UTF-8: {exc.reason} at byte {exc.start}") from None


# -- HTML ---------------------------------------------------------------------------------------

_HTML_DROPPED = frozenset({"script", "style", "noscript", "template", "svg", "math", "iframe", "object"})
_HTML_BLOCKS = frozenset(
    "address article aside blockquote body caption dd details dialog div dl dt fieldset figcaption figure "
    "footer form h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section summary table tbody tfoot thead "
    "title tr ul".split())
_PROTECT = str.maketrans({"\n": "\ue000", " ": "\ue001", "\t": "\ue002"})
_RESTORE = str.maketrans({"\ue000": "\n", "\ue001": " ", "\ue002": "\t"})
_CHARSET = re.compile(rb"""charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


class _HTMLText(HTMLParser):
    """Collects the visible text of an HTML page, block elements as paragraph breaks."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._dropped = 0  # depth inside elements whose content is not text
        self._pre = 0  # depth inside <pre>

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _HTML_DROPPED:
            self._dropped += 1
        elif tag == "br":
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")
        elif tag in _HTML_BLOCKS:
            self.parts.append("\n\n")
            self._pre += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        if tag in _HTML_DROPPED:
            self._dropped = max(0, self._dropped - 1)
        elif tag in _HTML_BLOCKS:
            self.parts.append("\n\n")
            self._pre = max(0, self._pre - (tag == "pre"))

    def handle_data(self, data: str) -> None:
        if self._dropped:
            return
        if self._pre:  # kept as it is: its whitespace hidden from the normalisation in `text`
            self.parts.append(data.translate(_PROTECT))
        else:
            self.parts.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        text = re.sub(r" *\n *", "\n", "".join(self.parts))
        text = re.sub(r"\n{3,}", "\n\n", text).strip().translate(_RESTORE)
        return re.sub(r"\n\s*\n\s*\n", "\n\n", text).strip("\n")  # around <pre> blocks


def html_text(html: str) -> str:
    """The visible text of an HTML document: paragraphs separated by a blank line."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return parser.text()


def _decode_html(data: bytes) -> str:
    if _is_binary(data):
        raise _Skip("not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    declared = _CHARSET.search(data[:4096])
    encoding = declared.group(1).decode("ascii") if declared else "cp1252"  # HTML's default without one
    try:
        return data.decode(encoding)
    except (LookupError, UnicodeDecodeError):
        raise _Skip(f"cannot decode as {encoding}") from None


def _read_html(path: Path) -> str:
    return html_text(_decode_html(path.read_bytes()))


# -- PDF and DOCX -------------------------------------------------------------------------------

def _read_pdf(path: Path) -> str:
    try:  # pypdf takes ~0.25 s to import and `kvrag ask` imports this module (through kvrag.rag): only PDFs need it
        import pypdf.errors
    except ImportError:
        raise _Skip("reading PDF needs pypdf: pip install pypdf") from None
    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):  # many PDFs carry an empty user password
            raise _Skip("encrypted")
        pages = [page.extract_text() or "" for page in reader.pages]
    except pypdf.errors.DependencyError:
        raise _Skip("encrypted (decrypting it needs: pip install cryptography)") from None
    except (pypdf.errors.PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError) as exc:
        raise _Skip(f"unreadable PDF: {type(exc).__name__}") from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise _Skip("no text layer (scanned?)")
    return text


def _read_docx(path: Path) -> str:
    try:  # python-docx (with lxml) takes ~0.1 s to import and `kvrag ask` imports this module: only DOCX needs it
        import docx.opc.exceptions
    except ImportError:
        raise _Skip("reading DOCX needs python-docx: pip install python-docx") from None
    try:
        document = docx.Document(str(path))
        blocks: list[str] = []
        for item in document.iter_inner_content():
            if hasattr(item, "rows"):  # a table: one line per row
                rows = [" | ".join(cell.text.strip() for cell in row.cells) for row in item.rows]
                blocks.append("\n".join(r for r in rows if r.strip(" |")))
            else:
                blocks.append(item.text)
    except (docx.opc.exceptions.PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        raise _Skip(f"unreadable DOCX: {type(exc).__name__}") from None
    return "\n\n".join(b.strip() for b in blocks if b.strip())


# -- dispatch -----------------------------------------------------------------------------------

_READERS: dict[str, Callable[[Path], str]] = {
    **{s: _read_html for s in HTML_SUFFIXES}, **{s: _read_pdf for s in PDF_SUFFIXES},
    **{s: _read_docx for s in DOCX_SUFFIXES},
}


def _read_file(path: Path, out: Loaded) -> None:
    suffix = path.suffix.lower()
    try:
        if suffix in _READERS:
            _append(out, str(path), _READERS[suffix](path), str(path))
        elif suffix in RECORD_SUFFIXES:
            _read_records(path, _decode_utf8(path.read_bytes()), out)
        elif suffix == ".doc":
            raise _Skip("old Word format: save it as .docx")
        else:
            _append(out, str(path), _decode_utf8(path.read_bytes()), str(path))
    except _Skip as skip:
        out.skipped.append((str(path), str(skip)))
    except PermissionError:
        out.skipped.append((str(path), "permission denied"))


def _read_records(path: Path, text: str, out: Loaded) -> None:
    try:
        if path.suffix.lower() == ".jsonl":
            items: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Skip(f"invalid JSON at line {exc.lineno}") from None
    for i, item in enumerate(items if isinstance(items, list) else [items]):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            out.skipped.append((f"{path}#{i}", "record without a 'text' string"))
            continue
        title = str(item.get("title", "")).strip()
        body = f"{title}\n{item['text']}" if title else item["text"]
        _append(out, str(item.get("id", f"{path}#{i}")), body, f"{path}#{i}")


def _append(out: Loaded, doc_id: str, text: str, source: str) -> None:
    if not text.strip():
        out.skipped.append((source, "empty"))
    else:
        out.docs.append((doc_id, text, source))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _unsupported(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    if _is_binary(head):
        return "not text"
    return f"unsupported type {path.suffix.lower()}" if path.suffix else "no file type (name it .txt to index it)"


def _read_path(path: Path, out: Loaded) -> None:
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if not child.is_file() or _hidden(child, path):
                continue
            if child.suffix.lower() in SUPPORTED_SUFFIXES:
                _read_file(child, out)
            elif child.suffix.lower() == ".doc":
                out.skipped.append((str(child), "old Word format: save it as .docx"))
            else:
                try:
                    out.skipped.append((str(child), _unsupported(child)))
                except OSError as exc:
                    out.skipped.append((str(child), exc.strerror or type(exc).__name__))
    elif path.is_file():
        _read_file(path, out)
    else:
        raise InputError(f"document path does not exist: {path}")


def load_documents(documents: Document | Iterable[Document]) -> Loaded:
    """Normalise ``documents`` (see module docstring); raises TypeError for unknown item types."""
    if isinstance(documents, Loaded):
        return documents
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
        elif isinstance(item, Loaded):
            out.docs += item.docs
            out.skipped += item.skipped
        else:
            raise TypeError(
                f"documents must be str, (id, text) pairs or pathlib.Path objects; got {type(item).__name__}"
            )
    if out.skipped:
        log.warning("%s", out.skipped_summary())
    return out
