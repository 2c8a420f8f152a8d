"""Checksums and confinement for an index's own files: what makes a damaged index say so.

Contract:

- `write_manifest` stores a JSON object with a ``"checksum"`` field: the SHA-256 of the object's
  canonical JSON (sorted keys, compact separators, without the field itself). `read_manifest` parses
  and checks it; a truncated, empty, edited or bit-flipped manifest raises `IndexCorruptError` naming
  the file and ``kvrag repair``. `manifest_problem` says what is wrong without raising.
- `row_digest` is the per-row checksum of a chunk's metadata and text in ``chunks.sqlite``.
- `links_out` lists the symbolic links inside an index folder whose target resolves outside it;
  `check_confined` refuses such a folder. kvrag never reads or writes through one.
- `is_chunk_key` accepts the keys kvrag writes (40 lowercase hex digits): nothing else may become a
  path in the chunk store.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvrag.errors import IndexCorruptError
from kvrag.storage import atomic

CHECKSUM_FIELD = "checksum"
_HEX = frozenset("0123456789abcdef")


def canonical_checksum(obj: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``obj``'s canonical JSON, leaving out its ``"checksum"`` field."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def with_checksum(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` carrying its own checksum."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    return {**body, CHECKSUM_FIELD: canonical_checksum(body)}


def write_manifest(path: str | os.PathLike[str], obj: dict[str, Any]) -> dict[str, Any]:
    """Write ``obj`` with its checksum to ``path`` atomically (write, fsync, rename); return what was written."""
    stored = with_checksum(obj)
    atomic.atomic_write_json(path, stored)
    return stored


def parse_manifest(data: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")`` when ``data`` is a manifest whose checksum holds, else ``(None, what is wrong)``."""
    if not data.strip():
        return None, "is empty"
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"is not valid JSON (truncated or damaged: {type(exc).__name__} at {_where(exc)})"
    if not isinstance(obj, dict):
        return None, "is not a JSON object"
    stored = obj.get(CHECKSUM_FIELD)
    if stored is None:
        return None, "has no checksum (written by an older kvrag, or edited)"
    if stored != canonical_checksum(obj):
        return None, "does not match its checksum (edited or damaged)"
    return obj, ""


def _where(exc: Exception) -> str:
    return f"byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else f"line {getattr(exc, 'lineno', '?')}"


def manifest_problem(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")`` if the file at ``path`` is a sound manifest, else ``(None, what is wrong)``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or type(exc).__name__})"
    return parse_manifest(data)


def read_manifest(path: Path, index: object) -> dict[str, Any]:
    """The manifest at ``path``, checked; `IndexCorruptError` naming the file and the fix otherwise."""
    obj, problem = manifest_problem(path)
    if obj is None:
        raise IndexCorruptError(path, problem, index)
    return obj


def row_digest(key: str, doc_id: str, seq: int, text: str, n_tokens: int, source: str) -> str:
    """Checksum of one chunk row (its key, place, text, token count and source), hex."""
    body = json.dumps([key, doc_id, int(seq), text, int(n_tokens), source], ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:32]


def sha256_hex(data: bytes) -> str:
    """SHA-256 of ``data``, hex."""
    return hashlib.sha256(data).hexdigest()


def is_chunk_key(key: object) -> bool:
    """Whether ``key`` is a chunk key kvrag writes: 40 lowercase hex digits, nothing a path could abuse."""
    return isinstance(key, str) and len(key) == 40 and _HEX.issuperset(key)


def links_out(root: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """Symbolic links under ``root`` (not followed) whose target resolves outside it: ``(link, target)``."""
    base = Path(root).resolve()
    out = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                target = entry.resolve()
                if target != base and base not in target.parents:
                    out.append((entry, str(target)))
    return out


def check_confined(root: str | os.PathLike[str]) -> None:
    """Refuse an index folder holding a link that leads outside it (`IndexCorruptError`)."""
    found = links_out(root)
    if found:
        link, target = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise IndexCorruptError(link, f"is a link to {target}, outside the index{more}; kvrag never reads or "
                                f"writes through one", fix=f"replace the link with a real folder or file "
                                f"inside {Path(root)}, then run 'kvrag repair {root}'")
