"""A codec's fitted state kept in the user's cache folder, outside the index that references it.

A fitted ``cachegen`` state is 3.9 MB for SmolLM2-135M: kept in every index, it was most of a small index. Here it is
kept beside the model's other states, content-addressed.

Contract:

- States live under ``default_cache_dir()/codec-states/<name>/<digest>/`` (`kvrag.user_cache`), ``name`` =
  `state_name` (the codec and the model's fingerprint), ``digest`` = `files_digest` of the state's files (their
  names and bytes): a folder is written once and never changed, so a state an index references cannot change
  under it, and indexes whose fits are identical share one folder.
- `publish` saves ``codec``'s fitted state (atomically: a temporary folder renamed into place; an existing folder
  of the same digest is kept, a damaged one replaced); it returns the digest.
  `load` loads the state of one digest, raising `SharedStateError` when it is missing, damaged or another one
  (twice in a row: a folder being put right by another process is read again).
- An index references its state with ``codec/shared.json`` (`write_ref`, `read_ref`): ``{"name", "digest"}``.
- Each index folder that references a state is recorded beside it (`note_user`, by `write_ref` and whenever an
  index loads the state, which also marks the state used): ``<name>/users/<digest>/<key>`` holds the index's codec
  folder. `collect` removes the states whose every recorded user is gone (deleted, moved, or now referencing
  another state) and that nothing wrote or used for `GRACE_S` (7 days: an index moved and opened within them is
  recorded again); it runs after every fit (`kvrag.storage.codec_state.save_fitted`).
  A state without any recorded user (written before users were recorded) is kept: the indexes that reference it
  are unknown, and removing it would leave them to `kvrag repair`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrag.atomic_files import atomic_write_json, read_json
from kvrag.user_cache import default_cache_dir

REF = "shared.json"
RETRY_S = 0.5
USERS = "users"  # <name>/users/<digest>/<key>: one file per index codec folder that references the state
GRACE_S = 7 * 86400.0  # a state written or used this recently is never collected
_DIGEST = re.compile(r"[0-9a-f]{24}")

log = logging.getLogger(__name__)


class SharedStateError(ValueError):
    """A shared codec state that an index references is missing, damaged or not the one referenced."""


def state_name(codec: Any, fingerprint: str) -> str:
    """The name of ``codec``'s fitted states for the model with ``fingerprint``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{codec.name}-{fingerprint}")[:120]


def states_root() -> Path:
    """The folder of every shared codec state."""
    return default_cache_dir() / "codec-states"


def files_digest(folder: Path) -> str:
    """The sha256 (first 24 hex digits) of a state folder's files: names and bytes, in name order."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:24]


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,119}")  # what `state_name` makes: never '..', never a separator


def _folder(name: str, digest: str) -> Path:
    """The folder of state ``name``/``digest``: both read from an index, so both are checked to name one folder
    under `states_root` (a name such as ``../x`` is refused, as every other path read from an index is).
    """
    if not _NAME.fullmatch(name):
        raise SharedStateError(f"{name!r} is not a codec state name")
    if not _DIGEST.fullmatch(digest):
        raise SharedStateError(f"{digest!r} is not a codec state digest")
    return states_root() / name / digest


def publish(codec: Any, fingerprint: str) -> str:
    """Save ``codec``'s fitted state among the model's shared states; its digest."""
    name = state_name(codec, fingerprint)
    parent = states_root() / name
    parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=".fitting-", dir=parent))
    try:
        codec.save_state(temp)
        digest = files_digest(temp)
        final = _folder(name, digest)
        if final.is_dir() and files_digest(final) != digest:  # that state, damaged: this fit puts it right
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(temp, final)
        except OSError:  # the same state is there already (another index fitted it): keep that one
            if not final.is_dir():
                raise
            os.utime(final)  # published again: `collect` leaves it its grace period
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return digest


def load(codec: Any, name: str, digest: str) -> None:
    """Load the shared state ``name``/``digest`` into ``codec``; `SharedStateError` when it cannot be, read twice
    (a folder another process is putting right, `publish`, is read again after `RETRY_S`).
    """
    try:
        _load_once(codec, name, digest)
    except SharedStateError:
        time.sleep(RETRY_S)
        _load_once(codec, name, digest)


def _load_once(codec: Any, name: str, digest: str) -> None:
    folder = _folder(name, digest)
    if not folder.is_dir():
        raise SharedStateError(f"the shared codec state {folder} is missing")
    if files_digest(folder) != digest:
        raise SharedStateError(f"the shared codec state {folder} is damaged (its files changed)")
    try:
        codec.load_state(folder)
    except (ValueError, OSError) as exc:
        raise SharedStateError(f"the shared codec state {folder} is damaged: {str(exc).splitlines()[0]}") from None


def write_ref(state_dir: Path, name: str, digest: str) -> None:
    """Reference the shared state ``name``/``digest`` from an index's codec folder (and record it as a user)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(state_dir / REF, {"name": name, "digest": digest})
    note_user(state_dir, name, digest)


def note_user(state_dir: Path, name: str, digest: str) -> None:
    """Record that the index codec folder ``state_dir`` references the state ``name``/``digest`` and marks the state
    used (`collect` keeps a state while a recorded user still references it, and `GRACE_S` after its last use). A
    cache folder that cannot be written is no error.
    """
    where, folder = state_dir.resolve(), _folder(name, digest)
    record = folder.parent / USERS / digest / hashlib.sha256(str(where).encode()).hexdigest()[:24]
    try:
        os.utime(folder)  # used now: `collect` leaves it `GRACE_S` from here
        if not record.is_file():
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(str(where), encoding="utf-8")
    except OSError as exc:
        log.debug("could not record %s as a user of the codec state %s/%s: %s", where, name, digest, exc)


def _still_used(users: Path, name: str, digest: str) -> bool:
    """Whether a user recorded under ``users`` still references ``name``/``digest``; the records of users that
    no longer do are removed.
    """
    used = False
    for record in users.iterdir():
        try:
            ref = read_ref(Path(record.read_text(encoding="utf-8")))
        except (SharedStateError, OSError, ValueError):
            ref = None
        if ref == (name, digest):
            used = True
        else:
            record.unlink(missing_ok=True)
    return used


def collect(grace_s: float = GRACE_S) -> list[Path]:
    """Remove the shared states that no recorded user references any more (see the module contract); the state
    folders removed.
    """
    removed: list[Path] = []
    root = states_root()
    for named in sorted(root.iterdir()) if root.is_dir() else []:
        users_root = named / USERS
        if not users_root.is_dir():
            continue
        for users in sorted(users_root.iterdir()):
            folder = named / users.name
            if not _DIGEST.fullmatch(users.name) or not users.is_dir() or _still_used(users, named.name, users.name):
                continue
            if folder.is_dir():
                try:
                    if time.time() - folder.stat().st_mtime < grace_s:
                        continue
                except OSError:
                    continue
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            shutil.rmtree(users, ignore_errors=True)
    if removed:
        log.info("removed %d codec state(s) no index references any more", len(removed))
    return removed


def read_ref(state_dir: Path) -> tuple[str, str] | None:
    """The shared state an index's codec folder references, or None when it references none."""
    path = state_dir / REF
    if not path.is_file():
        return None
    try:
        ref = read_json(path)
        name, digest = str(ref["name"]), str(ref["digest"])
        _folder(name, digest)  # a name or digest that would leave the states' folder: damaged
        return name, digest
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise SharedStateError(f"{path} is damaged: {exc}") from None
