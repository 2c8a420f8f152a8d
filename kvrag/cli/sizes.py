"""Index sizes for the CLI: what a build is expected to write, and what an index holds on disk.

Contract: `expected_cache_bytes` estimates the chunk caches of ``tokens`` tokens from the model's
spec (a `ModelSpec` as a dict: ``n_layers``, ``n_kv_heads``, ``head_dim``, ``dtype``) and the codec's
measured bits per stored element (`BITS_PER_ELEMENT`, measured on SmolLM2-135M caches, container
included: about, not exactly, what another model's caches take); None for a codec or level not
measured. `index_sizes` splits the bytes of an index into caches, FAISS vectors, codec state, chunk text
(SQLite) and the rest; the caches are counted where the index keeps them (`store_cache_bytes`: its
``chunks/`` folder, or the keys under its namespace in a network store, listed with ``SCAN``). Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvrag.config import StoreConfig
from kvrag.storage.index_layout import IndexLayout
from kvrag.storage.stores import is_remote_url, open_index_store

DTYPE_BITS = {"float32": 32, "float": 32, "float16": 16, "half": 16, "bfloat16": 16, "float64": 64}
# bits per stored K/V element, container included (SmolLM2-135M-Instruct caches; benchmarks/README.md,
# "Codecs"); cachegen's level 0 measured the same way (fitted on 40 MuSiQue passages, 20 others encoded,
# where level 1 took 2.61 bits).
BITS_PER_ELEMENT: dict[tuple[str, int], float] = {
    ("int8", 0): 8.5,
    ("cachegen", 0): 1.9,
    ("cachegen", 1): 2.6,
    ("cachegen", 2): 3.3,
    ("cachegen", 3): 4.4,
}
PARTS = ("caches", "faiss", "codec_state", "text", "other")


def kv_elements_per_token(spec: Mapping[str, Any]) -> int:
    """K and V elements one token adds to a cache, over all layers: 2 x layers x KV heads x head dim."""
    return 2 * int(spec["n_layers"]) * int(spec["n_kv_heads"]) * int(spec["head_dim"])


def bits_per_element(codec: str, level: int, dtype: str) -> float | None:
    """About how many bits the codec stores per K/V element (``raw``: the dtype's); None if unknown."""
    if codec == "raw":
        return float(DTYPE_BITS.get(dtype, 32))
    return BITS_PER_ELEMENT.get((codec, level))


def expected_cache_bytes(tokens: int, spec: Mapping[str, Any], codec: str, level: int,
                         copies: int = 1) -> float | None:
    """About the bytes of ``copies`` caches of ``tokens`` tokens each through the codec; None if unknown."""
    bits = bits_per_element(codec, level, str(spec["dtype"]))
    if bits is None:
        return None
    return tokens * kv_elements_per_token(spec) * bits / 8 * copies


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (0 when it does not exist)."""
    return _tree_bytes(Path(path))


def store_cache_bytes(path: Path, manifest: Mapping[str, Any]) -> int | None:
    """Bytes of the chunk caches in the network store the manifest records (every blob under the index's
    namespace); None for an index whose caches are in its folder.

    Raises:
        kvrag.errors.StoreUnavailableError: the store cannot be reached.
    """
    url = (manifest.get("store") or {}).get("url")
    if url is None or not is_remote_url(url):
        return None
    store = open_index_store(Path(path), manifest, StoreConfig(cache_bytes=0))
    try:
        return sum(store.sizes(list(store.keys())))
    finally:
        store.close()


def index_sizes(path: Path, manifest: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Bytes of an index by part (`PARTS`) and ``total``; with the ``manifest``, the caches of a network store
    count as ``caches`` (and in ``total``) too.
    """
    path = Path(path)
    out = dict.fromkeys(PARTS, 0)
    remote = store_cache_bytes(path, manifest) if manifest is not None else None
    if remote is not None:
        out["caches"] += remote
    for entry in path.iterdir():
        size = _tree_bytes(entry)
        if entry.name == IndexLayout.CHUNKS:
            out["caches"] += size
        elif entry.name == IndexLayout.CODEC:
            out["codec_state"] += size
        elif entry.name == IndexLayout.VECTORS:
            out["faiss"] += size
        elif entry.name.startswith(IndexLayout.DB):  # the database and its -wal / -shm files
            out["text"] += size
        else:
            out["other"] += size
    out["total"] = sum(out[p] for p in PARTS)
    return out
