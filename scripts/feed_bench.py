r"""Loading throughput of `StoreFeed` alone: every layer of a chunk region read from the store and
delivered to the device, with no fusion beside it.

Llama-3.1-8B cache shape (32 layers, 8 KV heads, head dim 128, bf16), chunks of 512 tokens with
random contents, stored on local disk (page cache warm, as in ``kvrag bench speed``'s disk tier).
Prints, per codec and variant, the median milliseconds to deliver all layers, the loading threads'
busy time and the stored gigabytes per second; then single-thread rates of the pieces (CRC-32,
positioned reads) for scale.

Variants: the staging layout (``scatter``: each chunk's rows read straight into the side-by-side
planes; ``packed``: each chunk's blob read whole, planes put side by side after the upload, see
`kvrag.loading.staging.PlaneLayout`), how packed blobs are read (``per chunk`` from Python, ``batched`` by
`kvrag.loading.extents` without the GIL) and the decoding threads.

    python3 scripts/feed_bench.py 32768 raw,int8
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrag.storage import checksum  # noqa: E402

from kvrag.loading import extents  # noqa: E402
from kvrag.loading import feed as feed_mod  # noqa: E402
from kvrag.codec.base import make_codec  # noqa: E402
from kvrag.loading.feed import StoreFeed  # noqa: E402
from kvrag.storage.store import KVStore, make_store  # noqa: E402

LAYERS, HEADS, DIM, CHUNK = 32, 8, 128, 512
# (label, decoding threads, packed staging, batched extent reads)
VARIANTS = [("scatter", 8, False, False), ("packed, per chunk", 8, True, False), ("packed, batched", 4, True, True),
            ("packed, batched", 8, True, True), ("packed, batched", 16, True, True)]


def drain(kvstore: KVStore, keys: list[str], device: torch.device, workers: int | None) -> tuple[float, float]:
    """Milliseconds to deliver every layer (synchronised), and the loading threads' busy milliseconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    feed = StoreFeed(kvstore, keys, [CHUNK] * len(keys), LAYERS, device, torch.bfloat16, workers=workers)
    for i in range(LAYERS):
        k, v = feed.layer(i)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    feed.close()
    return ms, feed.decode_s * 1e3


def median_drain(kvstore: KVStore, keys: list[str], device: torch.device, workers: int | None) -> tuple[float, float]:
    drain(kvstore, keys, device, workers)
    runs = [drain(kvstore, keys, device, workers) for _ in range(3)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def pieces_rates(path: Path) -> None:
    data = path.read_bytes()
    buf = bytearray(len(data))
    t0 = time.perf_counter()
    zlib.crc32(data)
    crc = len(data) / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    checksum.crc32(data)
    fast = len(data) / (time.perf_counter() - t0) / 1e9
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    os.preadv(fd, [memoryview(buf)], 0)
    read = len(data) / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    print(f"one thread, {len(data) / 1e6:.0f} MB file: zlib.crc32 {crc:.2f} GB/s, {checksum.IMPLEMENTATION} "
          f"{fast:.2f} GB/s, preadv (page cache) {read:.2f} GB/s")


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    codecs = (sys.argv[2] if len(sys.argv) > 2 else "raw,int8").split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_chunks = length // CHUNK
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, HEADS, CHUNK, DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(LAYERS, HEADS, CHUNK, DIM, generator=gen).to(torch.bfloat16)
    print(f"{length} tokens, {n_chunks} chunks, device {device}, {os.cpu_count()} cpus")
    available, packed_devices = extents.available, set(feed_mod.PACKED_STAGING_DEVICES)
    for name in codecs:
        tmp = Path(tempfile.mkdtemp())
        kvstore = KVStore(make_store("disk", tmp, fsync=False), make_codec(name), "bench")
        keys = [f"{j:064x}" for j in range(n_chunks)]
        size = sum(kvstore.put(key, k, v) for key in keys)
        gb = size / 1e9
        for label, workers, packed, batched in VARIANTS:
            feed_mod.PACKED_STAGING_DEVICES = {"cuda", "cpu"} if packed else set()
            if not batched:
                extents.available = lambda: False
            try:
                ms, busy = median_drain(kvstore, keys, device, workers)
            finally:
                extents.available = available
                feed_mod.PACKED_STAGING_DEVICES = packed_devices
            print(f"{name} {gb:.2f} GB, {label}, workers {workers}: {ms:.0f} ms ({gb / ms * 1e3:.1f} GB/s), "
                  f"busy {busy:.0f} ms")
        pieces_rates(next(p for p in tmp.rglob("*") if p.is_file()))


if __name__ == "__main__":
    main()
