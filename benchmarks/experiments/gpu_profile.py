"""Where a fusion's time goes on a GPU: the loader alone against the link's physics, and a profile of one fusion.

For each length: the stored chunk caches (``int8``) read through a `StoreFeed` with nothing else running
(GB/s of stored bytes and of the bf16 K/V it yields; with ``--loader-grid`` at several depths and thread
counts, the fastest of 3 each), a pinned host-to-device copy of the same bf16 size,
then ``torch.profiler`` over one fusion per mode and tier after a warm-up: its wall time, CPU-side time
(Python and launches), the kernels' GPU time and the number of kernel launches. A fusion whose CPU time
exceeds its GPU time is bound by its launches, not by its arithmetic.

    python benchmarks/experiments/gpu_profile.py --lengths 4096,8192 --modes reuse,probe@0.15 --out OUT
    python benchmarks/experiments/gpu_profile.py --lengths 8192,32768 --modes reuse --tiers disk --loader-grid
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import common
from kvrag.bench.speed import arch_model
from kvrag.bench.workload import Workload
from kvrag.codec.base import make_codec
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import make_store


def loader_alone(lm: Any, work: Workload, **feed_args: Any) -> dict[str, float]:
    """Every layer of every stored chunk through a `StoreFeed` (``feed_args``: its settings), nothing else running."""
    work.store_feed_options = feed_args
    feed = work.feed(lm, "disk")
    work.store_feed_options = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out_bytes = 0
    for layer in range(lm.spec.n_layers):
        k, v = feed.layer(layer)
        out_bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    feed.close()
    host = torch.empty(out_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(out_bytes, dtype=torch.uint8, device=lm.device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t1
    return {**feed_args, "loader_ms": seconds * 1e3, "stored_mb": work.stored_bytes / 1e6, "kv_mb": out_bytes / 1e6,
            "stored_gb_s": work.stored_bytes / seconds / 1e9, "kv_gb_s": out_bytes / seconds / 1e9,
            "pinned_h2d_gb_s": out_bytes / h2d / 1e9}


def profile_fusion(lm: Any, work: Workload, spec: common.ModeSpec, tier: str) -> dict[str, Any]:
    """One fusion under the profiler (after a warm-up): wall, CPU-side, GPU kernel time and launches."""
    from torch.profiler import ProfilerActivity, profile

    work.time_mode(lm, spec.config, tier)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timing = work.time_mode(lm, spec.config, tier)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
    top = events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48)
    return {"mode": spec.label, "tier": tier, "ttft_ms": timing["ttft_s"] * 1e3, "fuse_ms": timing["fuse_s"] * 1e3,
            "load_ms": timing["load_s"] * 1e3, "gpu_kernel_ms": gpu_us / 1e3, "kernel_launches": launches,
            "top_cpu": top}


def workers_ab(lm: Any, work: Workload, labels: list[str], counts: list[int]) -> dict[str, list[float]]:
    """TTFT ms of each mode from disk with the feed's decoding threads at each count, alternated, 5 rounds."""
    times: dict[str, list[float]] = {}
    try:
        for _ in range(6):
            for label in labels:
                for count in counts:
                    work.store_feed_options = {"workers": count}
                    ms = work.time_mode(lm, common.parse_mode(label).config, "disk")["ttft_s"] * 1e3
                    times.setdefault(f"{label} workers={count}", []).append(ms)
    finally:
        work.store_feed_options = {}
    return {k: v[1:] for k, v in times.items()}  # the first round warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama-3.1-8b")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--modes", default="reuse,probe@0.15")
    parser.add_argument("--tiers", default="disk,gpu")
    parser.add_argument("--loader-grid", action="store_true",
                        help="also time the loader alone at each depth x workers of 2,4,8 x 1,4,8,16")
    parser.add_argument("--workers-ab", default=None, metavar="A,B",
                        help="instead of profiling: each mode from disk with the loader's decoding threads at A and "
                             "at B, alternated, 5 rounds; TTFT ms of each")
    parser.add_argument("--out", default="bench-out/gpu-profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = arch_model(args.arch, "cuda", None)
    kvstore = KVStore(make_store("disk", out / "chunks", fsync=False), make_codec("int8"), lm.fingerprint)
    report: list[dict[str, Any]] = []
    for length in common.parse_ints(args.lengths, "--lengths"):
        work = Workload(lm, kvstore, length, 512, 0, ("gpu",))
        loader_alone(lm, work)  # warm-up: pinned buffers, page cache
        row: dict[str, Any] = {"length": length, **loader_alone(lm, work), "fusions": [], "grid": []}
        print(json.dumps({k: v for k, v in row.items() if k not in ("fusions", "grid")}), flush=True)
        for depth in (2, 4, 8) if args.loader_grid else ():
            for workers in (1, 4, 8, 16):
                row["grid"].append(min((loader_alone(lm, work, depth=depth, workers=workers) for _ in range(3)),
                                       key=lambda r: r["loader_ms"]))
                print(json.dumps(row["grid"][-1]), flush=True)
        if args.workers_ab:
            row["workers_ab"] = workers_ab(lm, work, args.modes.split(","), common.parse_ints(args.workers_ab, "A,B"))
            print(json.dumps(row["workers_ab"]), flush=True)
        for label in args.modes.split(",") if not args.workers_ab else ():
            for tier in args.tiers.split(","):
                got = profile_fusion(lm, work, common.parse_mode(label), tier)
                print(json.dumps({k: v for k, v in got.items() if k != "top_cpu"}), flush=True)
                print(got["top_cpu"], flush=True)
                row["fusions"].append(got)
        report.append(row)
        del work
        torch.cuda.empty_cache()
    (out / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
