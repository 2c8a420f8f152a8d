"""Codec benchmark: size (bits per element, container metadata included), ratio vs bf16, encode and
decode speed on one CPU core, and reconstruction error, for every codec and quality level.

Speeds are MB/s of *bf16-equivalent* data (elements × 2 bytes, whatever the cache dtype), measured
through the real container (`encode_chunk` / `ChunkReader.decode_all`, checksums included) with
``torch.set_num_threads(1)``; decode is the best of ``repeats`` passes. Codecs that need fitting
are fitted on ``fit_samples`` (by default the first half of the samples; the rest are measured),
so errors are out-of-sample, as for chunks added to an index after its codec was fitted.

Mounted as ``kvrag bench codec --index DIR [--json OUT] [--markdown OUT] [--n-chunks N]``: the chunk
caches come from an existing index (decoded with the index's own codec — build the index with
``--codec raw`` to measure against exact caches). Agreement with uncompressed caches on the real
model is measured separately (``quality_rows``, wired by the quality benchmark).
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
KV = tuple[Any, Any]  # (keys, values), each torch.Tensor [L, H, S, D]
_KEY = "0" * 40


def _measure(codec: Any, samples: Sequence[KV], repeats: int) -> dict[str, float]:
    from kvrag.container import ChunkReader, encode_chunk

    t0, c0 = time.perf_counter(), time.process_time()
    blobs = [encode_chunk(codec, _KEY, "bench", k, v) for k, v in samples]
    encode_s, encode_cpu = time.perf_counter() - t0, time.process_time() - c0
    decode_s = decode_cpu = math.inf
    decoded: list[Any] = []
    for _ in range(max(1, repeats)):
        t0, c0 = time.perf_counter(), time.process_time()
        decoded = [ChunkReader(_KEY, io.BytesIO(b), codec, "bench").decode_all() for b in blobs]
        decode_s, decode_cpu = min(decode_s, time.perf_counter() - t0), min(decode_cpu, time.process_time() - c0)
    elements = sum(2 * k.numel() for k, _ in samples)
    err: dict[str, float] = {}
    for name, idx in (("k", 0), ("v", 1)):
        num = sum(float((s[idx].float() - d[idx].float()).pow(2).sum()) for s, d in zip(samples, decoded))
        den = sum(float(s[idx].float().pow(2).sum()) for s in samples)
        err[name] = math.sqrt(num / den) if den > 0 else 0.0
        err[f"max_{name}"] = max(float((s[idx].float() - d[idx].float()).abs().max()) for s, d in
                                 zip(samples, decoded) if s[idx].numel()) if elements else 0.0
    nbytes = sum(len(b) for b in blobs)
    bits = nbytes * 8 / elements
    mb = elements * 2 / 1e6  # bf16-equivalent megabytes
    return {"chunks": len(samples), "elements": elements, "bytes": nbytes, "bits_per_element": bits,
            "ratio_vs_bf16": 16 / bits, "encode_MBps": mb / encode_s, "decode_MBps": mb / decode_s,
            "encode_MBps_cpu": mb / max(encode_cpu, 1e-9), "decode_MBps_cpu": mb / max(decode_cpu, 1e-9),
            "rel_err_k": err["k"], "rel_err_v": err["v"], "max_abs_err_k": err["max_k"],
            "max_abs_err_v": err["max_v"]}


def run_codec_bench(
    samples: Sequence[KV], codecs: Sequence[str] = ("raw", "int8", "cachegen"),
    levels: Sequence[int] | None = None, *, fit_samples: Sequence[KV] | None = None, repeats: int = 3,
) -> list[dict[str, Any]]:
    """Measure every codec at every level (``levels`` restricts them) on ``samples``.

    Args:
        samples: chunk caches ``(keys, values)``, each ``[L, H, S, D]`` with keys pre-RoPE.
        codecs: codec names for `make_codec`.
        levels: quality levels to measure (each codec measures those it has; all when None).
        fit_samples: caches to fit codecs that need it; by default the first half of ``samples`` (and
            only the second half is measured).
        repeats: decode passes; the fastest is reported.

    Returns:
        One dict per (codec, level): ``bits_per_element`` (container bytes × 8 / elements),
        ``ratio_vs_bf16``, ``encode_MBps`` / ``decode_MBps`` (bf16-equivalent, one thread, wall clock)
        and ``*_MBps_cpu`` (per second of this process's CPU time: steadier on a shared machine),
        ``rel_err_k`` / ``rel_err_v`` (relative L2 error), max absolute errors, sizes and counts.

    Example:
        >>> rows = run_codec_bench(caches, codecs=("int8", "cachegen"))  # doctest: +SKIP
        >>> print(to_markdown(rows))  # doctest: +SKIP
    """
    import torch

    from kvrag.codec import make_codec

    samples = list(samples)
    if fit_samples is None:
        fit_samples, samples = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    if not samples:
        raise ValueError("run_codec_bench needs at least one sample chunk to measure (two without fit_samples)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for name in codecs:
            base = make_codec(name)
            if base.needs_fit:
                if not fit_samples:
                    raise ValueError(f"codec {name!r} needs fitting but there are no fit samples")
                t0 = time.perf_counter()
                base.fit(list(fit_samples), int(fit_samples[0][0].shape[0]))
                log.info("fitted %s on %d chunks in %.1f s", name, len(fit_samples), time.perf_counter() - t0)
            for level in [lv for lv in base.levels() if levels is None or lv in levels] or base.levels():
                codec = base.with_level(level)
                row = {"codec": name, "level": level, "default": level == base.default_level(),
                       **_measure(codec, samples, repeats)}
                log.info("%s level %d: %.3f bits/element", name, level, row["bits_per_element"])
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return rows


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of `run_codec_bench` as a Markdown table."""
    from kvrag.bench.common import markdown_table

    headers = ["codec", "level", "bits/elem", "× vs bf16", "encode MB/s", "decode MB/s", "decode MB/s (CPU)",
               "rel err K", "rel err V"]
    table = [[r["codec"], f"{r['level']}{'*' if r.get('default') else ''}", r["bits_per_element"],
              r["ratio_vs_bf16"], r["encode_MBps"], r["decode_MBps"], r.get("decode_MBps_cpu", math.nan),
              r["rel_err_k"], r["rel_err_v"]] for r in rows]
    return markdown_table(headers, table) + (
        "\n\n`*` default level. MB/s of bf16-equivalent data (elements × 2 bytes) on one thread; "
        "(CPU): per second of process CPU time.")


def load_index_samples(index: Path, n_chunks: int) -> tuple[list[KV], str]:
    """Up to ``n_chunks`` chunk caches of an index (in insertion order) and the index's codec name."""
    from kvrag.rag import KVRag

    rag = KVRag.open(index)
    try:
        keys = [r.key for r in rag.index.records()[:n_chunks]]
        samples = [rag.kvstore.load(k) for k in keys]
        return samples, rag.kvstore.codec.name
    finally:
        rag.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", required=True, help="index directory whose chunk caches are measured")
    parser.add_argument("--n-chunks", type=int, default=64,
                        help="chunks measured (after --fit-chunks used to fit; default 64)")
    parser.add_argument("--fit-chunks", type=int, default=128, help="chunks used to fit codecs (default 128)")
    parser.add_argument("--codecs", default="raw,int8,cachegen", help="comma list of codec names")
    parser.add_argument("--levels", default=None, help="comma list of levels (default: every level)")
    parser.add_argument("--repeats", type=int, default=3, help="decode passes; the fastest counts")
    parser.add_argument("--json", default=None, help="write the rows (and run stamp) as JSON here")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")


def run(args: argparse.Namespace) -> int:
    from kvrag.bench import common

    if args.n_chunks < 1 or args.fit_chunks < 1:
        raise ValueError("--n-chunks and --fit-chunks must be >= 1")
    samples, source = load_index_samples(Path(args.index), args.fit_chunks + args.n_chunks)
    if len(samples) < 2:
        raise ValueError(f"index {args.index} holds {len(samples)} chunk(s); the codec bench needs at least 2")
    if source != "raw":
        log.warning("index %s stores caches with the lossy codec %r: errors are relative to those", args.index,
                    source)
    fit = min(args.fit_chunks, len(samples) // 2) if len(samples) < args.fit_chunks + args.n_chunks \
        else args.fit_chunks
    levels = [int(t) for t in args.levels.split(",") if t.strip()] if args.levels else None
    rows = run_codec_bench(samples[fit:], [c.strip() for c in args.codecs.split(",") if c.strip()], levels,
                           fit_samples=samples[:fit], repeats=args.repeats)
    table = to_markdown(rows)
    if args.json:
        common.write_json(Path(args.json), {**common.stamp(args), "source_codec": source, "fit_chunks": fit,
                                            "rows": rows})
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(f"# kvrag bench codec\n\n{len(samples) - fit} chunks of `{args.index}` "
                                       f"(codecs fitted on {fit} others; stored with `{source}`)\n\n{table}\n")
    print(table)
    return 0
