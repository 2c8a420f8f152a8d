"""``kvrag index PATH… --index DIR``: build an index over files and folders, or extend one.

Contract, in order: read the documents (PDF, HTML and DOCX too; unreadable ones are set aside),
fail in one line when none is usable; load the model once (a new index: ``--model``, default
``smollm2``; an existing one: the model it was built with, or ``--model`` if that is the same model);
print the number of documents and tokens and the expected size of the chunk caches (tokens x the
model's K/V elements per token x the codec's measured bits per element), with a warning on stderr
when that exceeds the free disk space; build (one progress bar with an ETA, on stderr, on a
terminal or with ``--progress``); print the chunks and the bytes actually written; then one line
naming the skipped files and why; last, once per machine, compile kvrag's decoding kernels for the model
(`kvrag.generation.layer_steps.compile_ahead`, about 7 s on 2 cores, with a warning), so that the first answer
does not wait for them. Options not given on an existing index take its own settings.
``--store URL`` puts the caches in another store, e.g. a shared Redis (recorded in a new index, without
its password); a remote store that does not answer is refused before the model loads, and the sizes
printed are then those of the index folder alone (the caches are in the store). ``--engine ray`` splits,
embeds and computes the caches on a Ray cluster (``--address``, ``--workers``; docs/ray.md).
``--stream-levels 1,3`` also stores every cache at those levels of its codec, for ``kvrag ask --ttft-slo``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrag.cli.common import human_bytes, show_progress, store_arg
from kvrag.cli.sizes import expected_cache_bytes, folder_bytes
from kvrag.codec.base import make_codec
from kvrag.config import CodecConfig, SplitConfig
from kvrag.errors import IndexMismatchError, InputError
from kvrag.generation import layer_steps
from kvrag.indexing.documents import load_documents
from kvrag.model import load_model
from kvrag.prompt import DEFAULT_INSTRUCTION
from kvrag.rag import KVRag
from kvrag.storage.chunk_index import ChunkIndex
from kvrag.storage.stores import CachedStore, is_remote_url, open_index_store


def _free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes on the file system that will hold ``path`` (its nearest existing ancestor's)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def _estimate(args: argparse.Namespace, lm: Any, n_docs: int, tokens: int, codec: str, level: int,
              neighbour_context: int, existing: bool, remote: bool) -> None:
    """Print the expected size of the caches; warn on stderr when the disk (not a remote store) has less room."""
    spec = asdict(lm.spec)
    copies = 2 if neighbour_context else 1  # with neighbour context each chunk's plain cache is stored too
    expected = expected_cache_bytes(tokens, spec, codec, level, copies)
    if expected is None:
        size = f"expected size unknown for codec {codec!r} level {level}"
    else:
        what = codec + (f" level {level}" if codec == "cachegen" else "") + f", {spec['dtype']} model"
        size = f"about {human_bytes(expected)} of caches ({what}: {human_bytes(expected / max(tokens, 1))} a token)"
    if args.lazy:
        size = f"caches computed on first use, {size} once all are"
    elif existing:
        size += "; chunks already in the index are not computed again"
    docs = f"{n_docs} document{'' if n_docs == 1 else 's'}"
    print(f"{args.index}: {docs}, {tokens:,} tokens: {size}", flush=True)
    if expected is not None and not args.lazy and not remote:
        free, where = _free_bytes(Path(args.index))
        if expected > free:
            print(f"kvrag: warning: the caches need about {human_bytes(expected)} but {where} has only "
                  f"{human_bytes(free)} free", file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace, manifest: dict[str, Any] | None) -> tuple[str, str, int | None]:
    """Model name, codec and codec level: the options given, else the index's own, else the defaults."""
    if manifest is None:
        return args.model or "smollm2", args.codec or CodecConfig().name, args.codec_level
    codec = manifest["codec"]
    if args.codec is not None and args.codec != codec["name"]:  # refused before any model loads
        raise IndexMismatchError(f"index {args.index} uses codec {codec['name']!r}, not {args.codec!r}")
    context = manifest.get("neighbour_context", 0)
    if args.neighbour_context is not None and args.neighbour_context != context:
        raise IndexMismatchError(
            f"index {args.index} computes caches with neighbour_context={context}, not {args.neighbour_context}")
    return args.model or manifest["model"]["source"], args.codec or str(codec["name"]), codec.get("level")


def _check_store(args: argparse.Namespace, manifest: dict[str, Any] | None) -> str | None:
    """The remote store the caches go to, named without its password, once it answered; None for a local one.

    Raises:
        StoreUnavailableError: it does not answer (before any model loads).
    """
    url = args.store or ((manifest or {}).get("store") or {}).get("url")
    if url is None or not is_remote_url(url):
        return None
    store = open_index_store(Path(args.index), manifest or {}, store_arg(args))
    assert isinstance(store, CachedStore)
    try:
        getattr(store.inner, "ping", lambda: None)()
    finally:
        store.close()
    return store.label


def run(args: argparse.Namespace) -> int:
    index_path = Path(args.index)  # not a file: checked before this module loaded (`kvrag.cli.arguments`)
    manifest, chunks_before = None, 0
    if ChunkIndex.exists(index_path):
        with ChunkIndex.open(index_path) as existing:
            manifest = existing.manifest
            chunks_before = len(existing)
    model_name, codec_name, level = _settings(args, manifest)
    remote = _check_store(args, manifest)
    loaded = load_documents([Path(p) for p in args.paths])
    if not loaded.docs:
        raise InputError(f"no documents to index in {', '.join(args.paths)}"
                         + (f" ({loaded.skipped_summary()})" if loaded.skipped else ""))

    codec = make_codec(codec_name, level)  # an unknown codec or level fails here, before the model loads
    split = SplitConfig(mode=args.split, max_tokens=args.max_tokens, min_tokens=min(args.min_tokens, args.max_tokens))
    dtype = args.dtype or (manifest["model"]["spec"]["dtype"] if manifest is not None else None)
    lm = load_model(model_name, dtype=dtype, device=args.device)
    texts = [text for _, text, _ in loaded.docs]
    tokens = sum(len(ids) for ids in lm.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"])
    neighbour_context = (args.neighbour_context if manifest is None or args.neighbour_context is not None
                         else manifest.get("neighbour_context", 0)) or 0
    _estimate(args, lm, len(loaded.docs), tokens, codec.name, codec.level, neighbour_context, manifest is not None,
              remote is not None)

    bytes_before = folder_bytes(index_path)
    t0 = time.perf_counter()
    rag = KVRag.build(loaded, index_path, model=lm, embedder=args.embedder, split=split, codec=codec_name,
                      codec_level=level, index_kind=args.index_kind, dtype=args.dtype, device=args.device,
                      batch_tokens=args.batch_tokens, neighbour_context=args.neighbour_context,
                      neighbour_kv=args.neighbour_kv, show_progress=show_progress(args), caches=not args.lazy,
                      instruction=DEFAULT_INSTRUCTION if args.instruction is None else args.instruction,
                      question_tail=args.question_tail, store=store_arg(args), stream_levels=args.stream_levels,
                      engine=args.engine, address=args.address, workers=args.workers, codec_state=args.codec_state)
    elapsed = time.perf_counter() - t0
    n_chunks = len(rag.index)
    rag.close()
    total = folder_bytes(index_path)
    new = f" ({n_chunks - chunks_before} new)" if manifest is not None else ""
    caches = f"; the caches are in {remote}" if remote is not None else ""
    print(f"{args.index}: {n_chunks} chunks{new}; wrote {human_bytes(max(0, total - bytes_before))} in "
          f"{elapsed:.1f} s, {human_bytes(total)} on disk in all{caches}", flush=True)
    if loaded.skipped:
        print(loaded.skipped_summary(), flush=True)
    layer_steps.compile_ahead(lm.model)  # once per machine (it warns when it does): the first answer decodes at once
    return 0
