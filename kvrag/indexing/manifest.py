"""An index's `manifest.json`: what it was built with, so that opening it can check and reuse it.

The manifest records the format version, the library versions, the model (source, fingerprint and
`ModelSpec`), the embedder, the codec's parameters, the split settings, the prompt layout, the
neighbour-context settings, and where the chunk caches are stored (``"store"``: the URL of a store other
than the index's ``chunks/`` folder, without its password, and the namespace of the index's keys there;
`kvrag.storage.stores.index_store.store_record`), and the ``stream_levels``: the codec levels each chunk's cache is
also stored at for the streaming loader (absent when none; `check_stream_levels`). `new_manifest` writes no
index file (`ChunkIndex.create` stores it atomically); it records the local model and embedder paths it names as
this user's (`kvrag.trusted_paths`).

A manifest's checksum detects damage, not tampering: whoever can edit the file can recompute it. So what a
manifest names is checked before it is used: `manifest_codec` turns a codec or level this kvrag does not offer
into one `IndexCorruptError`, and `check_embedder` and `check_model_path` refuse an embedder or model path outside
the index (a sentence-transformers folder names the Python classes it is built from) unless the caller passes it
or this user built an index from it.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
from collections.abc import Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvrag import trusted_paths
from kvrag.codec.base import Codec, make_codec
from kvrag.config import SplitConfig, StoreConfig
from kvrag.embedder import Embedder
from kvrag.errors import IndexCorruptError, IndexMismatchError, UntrustedPathError
from kvrag.model import LoadedModel
from kvrag.prompt import DEFAULT_INSTRUCTION, PromptLayout
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.stores.index_store import store_record

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """The installed version of each distribution in ``names`` that is installed."""
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def library_versions() -> dict[str, str]:
    """Installed versions of kvrag and the libraries whose behaviour the stored caches depend on."""
    return installed_versions(("kvrag", "torch", "transformers", "faiss-cpu", "sentence-transformers"))


def stored_stream_levels(manifest: dict[str, Any], codec: Codec) -> tuple[int, ...]:
    """The levels an index stores each cache at besides ``codec``'s own (its manifest's ``stream_levels``)."""
    return tuple(level for level in manifest.get("stream_levels", ()) if level != codec.level)


def check_stream_levels(codec: Codec, levels: Iterable[int] | None) -> tuple[int, ...]:
    """``levels`` sorted without repeats and without the codec's own level, if the codec offers each one.

    Raises:
        ValueError: a level the codec does not offer.
    """
    chosen = sorted({int(lv) for lv in levels or ()})
    bad = [lv for lv in chosen if lv not in codec.levels()]
    if bad:
        raise ValueError(f"stream levels {bad}: codec {codec.name!r} offers levels {list(codec.levels())}")
    return tuple(lv for lv in chosen if lv != codec.level)


def new_manifest(lm: LoadedModel, embedder_name: str, codec: Codec, split: SplitConfig, layout: PromptLayout,
                 batch_tokens: int, neighbour_context: int, neighbour_kv: str,
                 store: str | StoreConfig | None = None, stream_levels: Iterable[int] = (),
                 codec_state: str = "shared") -> dict[str, Any]:
    """The manifest of a new index; ``store``: where its caches go (default: its ``chunks/`` folder);
    ``stream_levels``: more levels of the codec each cache is stored at (`check_stream_levels`); ``codec_state``:
    ``"shared"`` (the model's state in the user's cache folder) or ``"index"`` (in the index's own folder).
    """
    if codec_state not in ("shared", "index"):
        raise ValueError(f"codec_state must be 'shared' or 'index', got {codec_state!r}")
    levels = check_stream_levels(codec, stream_levels)
    for name in (lm.source, embedder_name):  # paths this user chose: opening the index may load them again
        local = local_path(name)
        if local is not None:
            trusted_paths.trust(local)
    return {**({"stream_levels": list(levels)} if levels else {}),
        "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "library_versions": library_versions(),
        "model": {"source": lm.source, "fingerprint": lm.fingerprint, "spec": asdict(lm.spec)},
        "embedder": embedder_name,
        "codec": {**codec.params(), **({"state": codec_state} if codec.needs_fit else {})},
        "split": asdict(split),
        "prompt": layout.to_json(),
        "batch_tokens": batch_tokens,
        "neighbour_context": neighbour_context,
        "neighbour_kv": neighbour_kv,
        "store": store_record(store, lm.fingerprint),
    }


def check_format(manifest: dict[str, Any], path: Path) -> None:
    """Refuse an index written in another format version."""
    if manifest.get("format_version") != FORMAT_VERSION:
        raise IndexMismatchError(
            f"index format {manifest.get('format_version')!r} at {path}; this kvrag reads {FORMAT_VERSION}")


def check_model(manifest: dict[str, Any], lm: LoadedModel, path: Path) -> None:
    """Refuse a model whose fingerprint is not the one the index was built with, naming both."""
    stored = manifest["model"]
    if lm.fingerprint != stored["fingerprint"]:
        raise IndexMismatchError(
            f"index {path} was built with model {stored['source']!r} (fingerprint "
            f"{stored['fingerprint']}), but the model given is {lm.source!r} (fingerprint {lm.fingerprint})")


def manifest_codec(manifest: dict[str, Any], path: Path) -> Codec:
    """The codec ``manifest`` names, unfitted; `IndexCorruptError` naming the manifest for one kvrag does not offer."""
    params = manifest.get("codec")
    name, level = (params.get("name"), params.get("level")) if isinstance(params, dict) else (None, None)
    try:
        return make_codec(name, level)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError) as exc:
        shown = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise IndexCorruptError(IndexLayout.of(path).manifest,
                                f"names codec {str(name)[:40]!r} at level {str(level)[:20]}, which this kvrag cannot "
                                f"read ({shown})",
                                fix=f"rebuild the index from its documents (kvrag index DOCS --index {path})") from None


def local_path(name: str) -> Path | None:
    """The folder or file ``name`` loads from when it is a local path (absolute, starting with ``.`` or ``~``, or
    existing); None for a hub id or an alias.
    """
    candidate = Path(name).expanduser()
    if not (candidate.is_absolute() or name.startswith((".", "~")) or candidate.exists()):
        return None
    return candidate.resolve()


def outside_path(name: str, root: Path) -> Path | None:
    """The folder or file ``name`` loads from when it is a local path outside ``root``, unless this user built an
    index from it (`kvrag.trusted_paths`); None for a hub id, a path inside ``root`` or a trusted one.
    """
    resolved = local_path(name)
    if resolved is None or resolved.is_relative_to(root.resolve()) or trusted_paths.trusted(resolved):
        return None
    return resolved


def check_embedder(manifest: dict[str, Any], path: Path, given: str | None) -> None:
    """Refuse to load the manifest's embedder from a path outside the index unless the caller names it (``given``).

    Raises:
        IndexMismatchError: ``given`` is not the index's embedder.
        UntrustedPathError: the manifest's embedder is a path outside the index and ``given`` is None.
    """
    stored = manifest.get("embedder")
    if not isinstance(stored, str) or not stored:
        raise IndexCorruptError(IndexLayout.of(path).manifest, "names no embedder",
                                fix=f"rebuild the index from its documents (kvrag index DOCS --index {path})")
    if given is not None:
        if Embedder(given).name != stored:
            raise IndexMismatchError(f"index uses embedder {stored!r}, not {given!r}")
        return
    if outside_path(stored, path) is not None:
        raise UntrustedPathError(f"{IndexLayout.of(path).manifest} names embedder {stored[:200]!r}, a path outside "
                                 f"the index; kvrag loads it only if you name it yourself: KVRag.open(..., "
                                 f"embedder=PATH) or --embedder PATH")


def check_model_path(manifest: dict[str, Any], path: Path, given: Any) -> None:
    """Refuse to load the manifest's model from a path outside the index unless the caller gives a model (``given``)
    or this user built an index from that path (`kvrag.trusted_paths`).

    Raises:
        UntrustedPathError: the manifest's model is such a path and ``given`` is None.
    """
    stored = str(manifest.get("model", {}).get("source", ""))
    if given is None and stored and outside_path(stored, path) is not None:
        raise UntrustedPathError(f"{IndexLayout.of(path).manifest} names model {stored[:200]!r}, a path outside the "
                                 f"index that no index was built from here; kvrag loads it only if you name it "
                                 f"yourself: KVRag.open(..., model=PATH) or --model PATH")


def check_opened(manifest: dict[str, Any], path: Path, embedder: str | None, model: Any = None) -> Codec:
    """Check an index's manifest before opening it; return its codec (unfitted).

    Raises:
        IndexMismatchError: another format version, or ``embedder`` is not the index's.
        UntrustedPathError: the manifest's embedder or model is a path outside the index, not named by the caller
            (``embedder``, ``model``) and not one this user built an index from.
        IndexCorruptError: the manifest names a codec or level this kvrag does not offer.
    """
    check_format(manifest, path)
    check_embedder(manifest, path, embedder)
    check_model_path(manifest, path, model)
    return manifest_codec(manifest, path)


def check_build_args(manifest: dict[str, Any], path: Path, model: Any, embedder: str | None, codec: str | None,
                     neighbour_context: int | None, neighbour_kv: str | None, instruction: str,
                     question_tail: str, stream_levels: Iterable[int] | None = None) -> None:
    """Refuse build arguments that contradict an existing index's manifest (the index keeps its own)."""
    own = manifest.get("stream_levels", [])
    asked = sorted({int(lv) for lv in stream_levels or ()} - {manifest["codec"].get("level")})
    if asked and asked != own:
        raise IndexMismatchError(f"index stores stream levels {own}, not {asked}; build another index for others")
    if isinstance(model, str) and model != manifest["model"]["source"]:
        log.info("index was built from %r; extending it with the model given (%r)", manifest["model"]["source"], model)
    if embedder is not None and Embedder(embedder).name != manifest["embedder"]:
        raise IndexMismatchError(f"index uses embedder {manifest['embedder']!r}, not {embedder!r}")
    if codec is not None and codec != manifest["codec"]["name"]:
        raise IndexMismatchError(f"index uses codec {manifest['codec']['name']!r}, not {codec!r}")
    context, placed = manifest.get("neighbour_context", 0), manifest.get("neighbour_kv", "prefill")
    if neighbour_context is not None and neighbour_context != context:
        raise IndexMismatchError(f"index computes caches with neighbour_context={context}, not {neighbour_context}")
    if neighbour_kv is not None and context and neighbour_kv != placed:
        raise IndexMismatchError(f"index puts neighbours before a chunk as {placed!r}, not {neighbour_kv!r}")
    prompt = manifest["prompt"]
    if (instruction not in (DEFAULT_INSTRUCTION, prompt["instruction"])
            or question_tail.strip() not in ("", prompt.get("question_tail", ""))):
        log.warning("index %s keeps the prompt it was built with (instruction %r, question tail %r)",
                    path, prompt["instruction"], prompt.get("question_tail", ""))
