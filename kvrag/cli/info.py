"""``kvrag info INDEX``: what an index holds and what it takes on disk.

Contract: reads the manifest and the chunk table only (no model, no torch), and the sizes of the caches
in the index's store (its ``chunks/`` folder, or a network store's keys under the index's namespace). Prints,
as text or with ``--json`` as one object: chunks and their tokens; bytes split into caches, FAISS vectors,
codec state, chunk text (``chunks.sqlite``) and other files; how many times smaller than one bf16 K/V cache of
every token (``bf16_kv_bytes``) the caches and the whole index are (``times_smaller_than_bf16``: every copy the
index stores counts, a neighbour-context index's second cache of each chunk and its stream levels too); where
the caches are (``store``: None for the folder); the stream levels stored besides the codec's own; cache bytes per
token; the model's source and shape; the embedder; the codec's name and level; the creation date; the neighbour-context
setting; the caches' bound in bytes, when the index has one (``max_cache_bytes``); where a shared codec state
is (``codec_state``: the user's cache folder, or None when it is kept in the index). ``--json`` adds the whole
manifest under ``"manifest"``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvrag.cli.common import human_bytes
from kvrag.cli.sizes import PARTS, index_sizes, kv_elements_per_token
from kvrag.errors import IndexNotFoundError
from kvrag.storage import codec_state
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.index_layout import IndexLayout

_PART_NAMES = {"caches": "caches", "faiss": "FAISS", "codec_state": "codec state", "text": "text", "other": "other"}


def describe(path: Path) -> dict[str, Any]:
    """The facts `kvrag info` prints, as a JSON-ready dict."""
    if not path.is_dir():
        raise IndexNotFoundError(f"no kvrag index at {path}: the folder does not exist")
    with ChunkIndex.open(path) as index:
        manifest = index.manifest
        records = index.records()
    tokens = sum(r.n_tokens for r in records)
    try:
        ref = codec_state.read_ref(IndexLayout.of(path).codec_state)
    except codec_state.SharedStateError:
        ref = None
    shared = str(codec_state.states_root() / ref[0] / ref[1]) if ref else None
    sizes = index_sizes(path, manifest)
    model, codec = manifest.get("model", {}), manifest.get("codec", {})
    spec = model.get("spec", {})
    bf16 = tokens * kv_elements_per_token(spec) * 2 if spec else 0  # one bf16 K/V cache of every token
    return {
        "path": str(path),
        "chunks": len(records),
        "tokens": tokens,
        "bytes": sizes,
        "cache_bytes_per_token": sizes["caches"] / tokens if tokens else 0.0,
        "bf16_kv_bytes": bf16,
        "times_smaller_than_bf16": {"caches": bf16 / sizes["caches"] if bf16 and sizes["caches"] else None,
                                    "index": bf16 / sizes["total"] if bf16 and sizes["total"] else None},
        "model": model.get("source"),
        "model_spec": spec,
        "embedder": manifest.get("embedder"),
        "codec": {"name": codec.get("name"), "level": codec.get("level")},
        "stream_levels": list(manifest.get("stream_levels", [])),
        "store": (manifest.get("store") or {}).get("url"),
        "neighbour_context": manifest.get("neighbour_context", 0),
        "max_cache_bytes": (manifest.get("store") or {}).get("max_bytes"),
        "codec_state": shared,
        "created": manifest.get("created"),
        "manifest": manifest,
    }


def _text(info: dict[str, Any]) -> str:
    spec, sizes = info["model_spec"], info["bytes"]
    shape = ""
    if spec:
        shape = (f" ({spec.get('arch')}, {spec['n_layers']} layers, {spec['n_kv_heads']} KV heads x "
                 f"{spec['head_dim']}, {spec.get('dtype')}: {kv_elements_per_token(spec):,} K/V values a token)")
    codec = info["codec"]
    parts = ", ".join(f"{_PART_NAMES[p]} {human_bytes(sizes[p])}" for p in PARTS)
    per_token = f"{human_bytes(info['cache_bytes_per_token'])} of cache"
    if info["neighbour_context"]:
        per_token += f" (two caches a chunk: neighbour context {info['neighbour_context']})"
    smaller = info["times_smaller_than_bf16"]
    if smaller["caches"]:
        per_token += (f"; {smaller['caches']:.1f}x smaller than bf16 K/V ({human_bytes(info['bf16_kv_bytes'])}), "
                      f"the whole index {smaller['index']:.1f}x")
    rows = [
        ("index", info["path"]),
        ("created", str(info["created"])),
        ("model", f"{info['model']}{shape}"),
        ("embedder", str(info["embedder"])),
        ("codec", f"{codec['name']} level {codec['level']}"
                  + (f" (also stored at levels {', '.join(map(str, info['stream_levels']))})"
                     if info["stream_levels"] else "")),
        ("chunks", f"{info['chunks']:,} ({info['tokens']:,} tokens)"),
        ("on disk" if info["store"] is None else "stored", f"{human_bytes(sizes['total'])}: {parts}"
         + ("" if info["store"] is None else f" (the caches in {info['store']})")),
        ("per token", per_token),
    ]
    if info["max_cache_bytes"]:
        rows.append(("bound", f"caches kept under {human_bytes(info['max_cache_bytes'])}, least recently used "
                              "evicted (computed again from their text when needed)"))
    if info["codec_state"]:
        rows.append(("codec", f"state in the user's cache folder: {info['codec_state']}"))
    return "\n".join(f"{name:<10} {value}" for name, value in rows)


def run(args: argparse.Namespace) -> int:
    info = describe(Path(args.index))
    print(json.dumps(info, indent=2) if args.json else _text(info))
    return 0
