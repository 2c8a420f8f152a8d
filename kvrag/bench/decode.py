"""Decoder throughput: GB/s of K/V that the ``cachegen`` region decoder gives on a device, checked against the host.

Caches with the structure of real ones (per-channel offsets, low-rank token content, noise) of one
model's key/value shape are fitted and encoded: ``--distinct`` chunks of ``--chunk-tokens`` tokens for
``--layers`` layers. A *region* (`CacheGenCodec.decode_region`) of ``--chunks`` chunks, the distinct ones
repeated, is then decoded on ``--device`` for each region size asked for: one launch of the Triton rANS
decoder (`kvrag.kernels.rans_decode`: one program per blob, ``layers × chunks`` blobs) over blobs already in
device memory, and the whole ``decode_region`` from blobs in host memory (header checks and the launch's
layout on the host, the copy, the decoder and the two batched transforms into bf16).

Throughput counts the decoded K/V in bf16 (``layers × chunks × 2 × heads × tokens × head_dim × 2`` bytes)
over the median time of ``--repeats`` runs after a warm-up. Before timing, the Triton decoder's
region is checked to equal the host decoder's bit for bit (both transformed on the device).

Mounted as ``kvrag bench decode [--heads 8 --head-dim 128] [--chunks 8,32,128] [--out DIR]``; writes
``decode.json`` and ``decode.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.bench.common import markdown_table
from kvrag.codec import cachegen_region as region
from kvrag.codec.cachegen import CacheGenCodec
from kvrag.kernels import rans_decode

log = logging.getLogger(__name__)


def synthetic_chunk(seed: int, layers: int, heads: int, tokens: int, head_dim: int,
                    scale: float = 1.0) -> tuple[Any, Any]:
    """Keys and values ``[layers, heads, tokens, head_dim]`` (float32) shaped like real caches: per-channel
    offsets, six shared directions of token content, and noise, all times ``scale``.
    """
    gen = torch.Generator().manual_seed(seed)
    channels = heads * head_dim
    offsets = torch.linspace(-2, 2, channels)[torch.randperm(channels, generator=torch.Generator().manual_seed(99))]
    mix = torch.randn(6, channels, generator=torch.Generator().manual_seed(98))

    def one() -> Any:
        z = torch.randn(layers, tokens, 6, generator=gen) @ mix + 0.1 * torch.randn(layers, tokens, channels,
                                                                                   generator=gen)
        return (scale * (z + offsets)).view(layers, tokens, heads, head_dim).permute(0, 2, 1, 3).contiguous()

    return one(), one()


def _timed(fn: Callable[[], Any], device: Any, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, the device synchronised around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _region_row(codec: Any, encoded: list[list[bytes]], n_chunks: int, chunk_tokens: int, heads: int,
                head_dim: int, dev: Any, repeats: int) -> dict[str, Any]:
    """Time one region of ``n_chunks`` chunks (``encoded[layer][j]``, repeated) decoded on ``dev``."""
    ids = list(range(len(encoded)))
    blobs = [[row[j % len(row)] for j in range(n_chunks)] for row in encoded]
    lengths = [chunk_tokens] * n_chunks
    batch = region.build_batch(codec, blobs, ids, lengths)
    tables = region.device_tables(codec, dev).rans
    data, meta, runs = (t.to(dev) for t in (batch.data, torch.from_numpy(batch.meta), torch.from_numpy(batch.runs)))
    codes = torch.empty(batch.rows, batch.total, device=dev)
    kernel_s = _timed(lambda: rans_decode.decode(data, meta, runs, tables, codes, batch.max_starts), dev, repeats)
    whole_s = _timed(lambda: codec.decode_region(blobs, ids, lengths, torch.bfloat16, dev, kernel=True), dev, repeats)
    kv_bytes = len(ids) * n_chunks * 2 * heads * chunk_tokens * head_dim * 2
    log.info("%d blobs: kernel %.2f ms (%.1f GB/s), decode_region %.2f ms", len(ids) * n_chunks, kernel_s * 1e3,
             kv_bytes / kernel_s / 1e9, whole_s * 1e3)
    return {"chunks": n_chunks, "blobs": len(ids) * n_chunks, "tokens": n_chunks * chunk_tokens,
            "stored_MB": batch.data.numel() / 1e6, "decoded_MB": kv_bytes / 1e6,
            "kernel_ms": kernel_s * 1e3, "kernel_GBps": kv_bytes / kernel_s / 1e9,
            "decode_region_ms": whole_s * 1e3, "decode_region_GBps": kv_bytes / whole_s / 1e9}


def run_decode_bench(heads: int = 8, head_dim: int = 128, layers: int = 4, chunk_tokens: int = 512,
                     distinct: int = 4, chunks: Sequence[int] = (8, 32, 128), device: str = "auto",
                     repeats: int = 10, level: int | None = None) -> dict[str, Any]:
    """Fit, encode and decode as the module docstring says; one row per region size in ``chunks``.

    Raises:
        RuntimeError: the Triton decoder is missing, or its region differs from the host decoder's.
    """
    if not rans_decode.available():
        raise RuntimeError("the cachegen decoder benchmark needs triton (pip install triton)")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    samples = [synthetic_chunk(i, layers, heads, chunk_tokens, head_dim) for i in range(distinct + 2)]
    codec = CacheGenCodec()
    codec.fit(samples[distinct:], n_layers=layers)  # fitted on two chunks that are not decoded
    codec = codec.with_level(codec.default_level() if level is None else level)
    t0 = time.perf_counter()
    encoded = [[codec.encode_layer(k[i], v[i], i) for k, v in samples[:distinct]] for i in range(layers)]
    log.info("encoded %d blobs in %.1f s", layers * distinct, time.perf_counter() - t0)
    ids = list(range(layers))
    exact = torch.equal(
        codec.decode_region(encoded, ids, [chunk_tokens] * distinct, torch.bfloat16, dev, kernel=True),
        codec.decode_region(encoded, ids, [chunk_tokens] * distinct, torch.bfloat16, dev, kernel=False))
    if not exact:
        raise RuntimeError(f"the Triton decoder's region differs from the host decoder's on {dev}")
    rows = [_region_row(codec, encoded, n, chunk_tokens, heads, head_dim, dev, repeats) for n in chunks]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    return {"device": name, "heads": heads, "head_dim": head_dim, "layers": layers, "chunk_tokens": chunk_tokens,
            "level": codec.level, "bit_exact": exact, "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    headers = ["chunks", "blobs", "tokens", "stored MB", "decoded MB (bf16)", "kernel ms", "kernel GB/s",
               "decode_region ms", "decode_region GB/s"]
    table = [[r["chunks"], r["blobs"], r["tokens"], r["stored_MB"], r["decoded_MB"], r["kernel_ms"],
              r["kernel_GBps"], r["decode_region_ms"], r["decode_region_GBps"]] for r in result["rows"]]
    return (f"# kvrag bench decode\n\n`cachegen` level {result['level']} on {result['device']}; {result['heads']} "
            f"key/value heads of {result['head_dim']}, {result['layers']} layers, chunks of "
            f"{result['chunk_tokens']} tokens; the Triton decoder's region equals the host decoder's bit for bit: "
            f"{result['bit_exact']}. Median of the timed runs.\n\n" + markdown_table(headers, table) + "\n")


def run(args: argparse.Namespace) -> int:
    result = run_decode_bench(args.heads, args.head_dim, args.layers, args.chunk_tokens, args.distinct,
                              [int(c) for c in args.chunks.split(",")], args.device, args.repeats, args.level)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(result, indent=2))
    text = to_markdown(result)
    (out / "decode.md").write_text(text)
    print(text)
    return 0
