"""A codec's fitted state: where it is kept, how it is named and addressed, and how it is saved and loaded.

A codec that needs fitting (``Codec.needs_fit``, e.g. ``cachegen``) codes caches with a state fitted on sample
chunks; every cache coded with it needs that same state to decode. A fitted ``cachegen`` state is 3.9 MB for
SmolLM2-135M: kept in every index, it was most of a small index.

Contract:

- Where a state lives, one of three places:

  - **in an index's folder**: its ``codec/`` folder (`IndexLayout.codec_state`), the files `Codec.save_state`
    writes; indexes whose manifest says ``codec.state == "index"`` (`IN_INDEX`, indexes from before).
  - **the folder backend**: shared per model in the user's cache folder (`kvrag.user_cache`), under
    ``states_root()/<name>/<digest>/``; the index's ``codec/`` folder only references it (`REF`). Indexes whose
    manifest says ``codec.state == "shared"`` (`SHARED`, the default for new indexes).
  - **the store backend**: once per model in a passage cache's byte store (`kvrag.passages`), beside the blobs,
    shared by every process using that store.

- Named: a state's name is `state_name` (the codec and the model's fingerprint) in both backends.
- Addressed by a digest of its bytes, so a state that is referenced or keyed can never change under its readers:
  in the folder backend `files_digest` of its files (their names and bytes, 24 hex digits), in the store backend
  the sha256 of its zip (16 hex digits).

The index (`load_codec_state`, `save_fitted`, `mark_fitted`, `codec_ready`, `state_kept`):

- `load_codec_state` raises `IndexCorruptError` for a damaged state, or a shared one that is missing or changed
  (`kvrag repair` fits it again and recomputes the caches); a state that is missing or half-written while no chunk
  cache is stored is no error (a build was killed before its first cache, and the next build fits it again).
- `save_fitted` saves a state just fitted where the index keeps it (each index fits its own: a state fitted on
  other text coded `examples/docs` 11 % larger and changed its demo answer); with the folder backend it then
  removes the states no index references any more (`collect`).
- `mark_fitted` records that a build finished fitting it; `codec_ready` says whether a build may store caches with
  the codec (it needs no fitting, or its state is fitted or marked so).

The folder backend (`publish_in_folder`, `load_from_folder`, `write_ref`, `read_ref`, `note_user`, `collect`):

- A folder ``<name>/<digest>/`` is written once and never changed, and indexes whose fits are identical share one.
- `publish_in_folder` saves ``codec``'s fitted state (atomically: a temporary folder renamed into place; an
  existing folder of the same digest is kept, a damaged one replaced); it returns the digest.
  `load_from_folder` loads the state of one digest, raising `SharedStateError` when it is missing, damaged or
  another one (twice in a row: a folder being put right by another process is read again).
- An index references its state with ``codec/shared.json`` (`write_ref`, `read_ref`): ``{"name", "digest"}``.
- Each index folder that references a state is recorded beside it (`note_user`, by `write_ref` and whenever an
  index loads the state, which also marks the state used): ``<name>/users/<digest>/<key>`` holds the index's codec
  folder. `collect` removes the states whose every recorded user is gone (deleted, moved, or now referencing
  another state) and that nothing wrote or used for `GRACE_S` (7 days: an index moved and opened within them is
  recorded again); it runs after every fit (`save_fitted`). A state without any recorded user (written before
  users were recorded) is kept: the indexes that reference it are unknown, and removing it would leave them to
  `kvrag repair`.

The store backend (`load_from_store`, `publish_in_store`):

- `load_from_store` loads the stored state into ``codec`` and returns its digest, or None when none is stored yet
  (or the codec needs no fitting: its digest is then ``"none"``).
- `publish_in_store` stores the state ``codec`` was just fitted with, unless another process stored one first, and
  loads whichever is stored, so that every writer codes with the same state; it returns that state's digest.
- The state travels as one zip of the files `Codec.save_state` writes (each with its CRC); the digest goes into
  every passage key, so a refitted state never decodes another's blobs. The store is an `BoundedDiskStore` or
  `BoundedRedisStore` (``get_state``/``put_state``, outside the byte bound).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrag.atomic_files import atomic_write_json, read_json
from kvrag.errors import IndexCorruptError
from kvrag.storage.index_layout import IndexLayout
from kvrag.user_cache import default_cache_dir

if TYPE_CHECKING:
    from kvrag.codec.base import Codec

log = logging.getLogger(__name__)

SHARED, IN_INDEX = "shared", "index"  # where an index keeps its codec state (its manifest's ``codec.state``)
REF = "shared.json"  # in an index's codec folder: the folder backend's state it references
RETRY_S = 0.5
USERS = "users"  # <name>/users/<digest>/<key>: one file per index codec folder that references the state
GRACE_S = 7 * 86400.0  # a state written or used this recently is never collected
_DIGEST = re.compile(r"[0-9a-f]{24}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,119}")  # what `state_name` makes: never '..', never a separator


def state_name(codec: Any, fingerprint: str) -> str:
    """The name of ``codec``'s fitted states for the model with ``fingerprint``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{codec.name}-{fingerprint}")[:120]


# --- the index: its codec folder keeps the state or references the folder backend's ---------------------------


def state_kept(manifest: dict[str, Any]) -> str:
    """Where the index with ``manifest`` keeps its codec state: `SHARED` or `IN_INDEX` (indexes from before)."""
    return SHARED if (manifest.get("codec") or {}).get("state") == SHARED else IN_INDEX


def load_codec_state(codec: Any, path: Path) -> None:
    """Load the fitted state of ``codec`` from the index at ``path`` (its `IndexLayout.codec_state`)."""
    layout = IndexLayout.of(path)
    state_dir = layout.codec_state
    present = state_dir.is_dir() and any(state_dir.iterdir())
    if not present:
        if layout.has_blobs():
            raise IndexCorruptError(state_dir, "is missing, but chunk caches coded with it are stored", path)
        return
    try:
        ref = read_ref(state_dir)
        if ref is not None:
            load_from_folder(codec, *ref)
            note_user(state_dir, *ref)  # (indexes built before users were recorded)
            return
        codec.load_state(state_dir)
    except (ValueError, OSError) as exc:
        if not layout.has_blobs() and not layout.fitted_marker.is_file():
            log.info("codec state in %s was not finished (%s); the next build fits it again", state_dir, exc)
            return
        raise IndexCorruptError(state_dir, f"is damaged: {str(exc).splitlines()[0]}", path) from None


def save_fitted(codec: Any, state_dir: Path, fingerprint: str, kept: str) -> None:
    """Save the state ``codec`` was just fitted with where the index keeps it (``kept``: `SHARED` or `IN_INDEX`)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if kept == SHARED:
        digest = publish_in_folder(codec, fingerprint)
        write_ref(state_dir, state_name(codec, fingerprint), digest)
        collect()  # states that deleted or refitted indexes left behind
    else:
        codec.save_state(state_dir)


def mark_fitted(state_dir: Path) -> None:
    """Record that the codec state in ``state_dir`` is fitted (`IndexLayout.FITTED`)."""
    (state_dir / IndexLayout.FITTED).touch()


def codec_ready(codec: Any, state_dir: Path) -> bool:
    """Whether ``codec`` needs no fitting, or its state in ``state_dir`` is fitted (or marked so)."""
    return not codec.needs_fit or bool(getattr(codec, "fitted", (state_dir / IndexLayout.FITTED).is_file()))


# --- the folder backend: states shared per model in the user's cache folder ----------------------------------


class SharedStateError(ValueError):
    """A shared codec state that an index references is missing, damaged or not the one referenced."""


def states_root() -> Path:
    """The folder of every shared codec state."""
    return default_cache_dir() / "codec-states"


def files_digest(folder: Path) -> str:
    """The sha256 (first 24 hex digits) of a state folder's files: names and bytes, in name order."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def _folder(name: str, digest: str) -> Path:
    """The folder of state ``name``/``digest``: both read from an index, so both are checked to name one folder
    under `states_root` (a name such as ``../x`` is refused, as every other path read from an index is).
    """
    if not _NAME.fullmatch(name):
        raise SharedStateError(f"{name!r} is not a codec state name")
    if not _DIGEST.fullmatch(digest):
        raise SharedStateError(f"{digest!r} is not a codec state digest")
    return states_root() / name / digest


def publish_in_folder(codec: Any, fingerprint: str) -> str:
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


def load_from_folder(codec: Any, name: str, digest: str) -> None:
    """Load the shared state ``name``/``digest`` into ``codec``; `SharedStateError` when it cannot be, read twice
    (a folder another process is putting right, `publish_in_folder`, is read again after `RETRY_S`).
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


# --- the store backend: a state kept once per model in a passage cache's byte store --------------------------


def _bundle(codec: Codec) -> bytes:
    """``codec``'s fitted state as one zip of the files `Codec.save_state` writes."""
    with tempfile.TemporaryDirectory() as folder:
        codec.save_state(Path(folder))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
            for path in sorted(Path(folder).iterdir()):
                bundle.write(path, path.name)
        return out.getvalue()


def _unbundle(codec: Codec, data: bytes) -> str:
    """Load the zipped state into ``codec`` (zip CRCs and the codec's own checks); its digest."""
    with tempfile.TemporaryDirectory() as folder, zipfile.ZipFile(io.BytesIO(data)) as bundle:
        for name in bundle.namelist():
            if "/" in name or name.startswith("."):
                raise ValueError(f"a codec state holds an unexpected file {name!r}")
            (Path(folder) / name).write_bytes(bundle.read(name))  # read() checks the CRC
        codec.load_state(Path(folder))
    return hashlib.sha256(data).hexdigest()[:16]


def load_from_store(store: Any, codec: Codec, fingerprint: str) -> str | None:
    """Load the stored state into ``codec``; its digest, ``"none"`` for a codec without state, None if not stored."""
    if not codec.needs_fit:
        return "none"
    data = store.get_state(state_name(codec, fingerprint))
    return None if data is None else _unbundle(codec, data)


def publish_in_store(store: Any, codec: Codec, fingerprint: str) -> str:
    """Store ``codec``'s fitted state unless one is stored already, then load the stored one; its digest."""
    stored = store.put_state(state_name(codec, fingerprint), _bundle(codec))
    return _unbundle(codec, stored)
