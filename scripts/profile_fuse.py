r"""Where fusion time goes at one context length: TTFT of each mode from each cache tier, a floor, and
torch profiler tables.

Builds a published model shape with random weights (as ``kvrag bench speed --arch``), stores random
chunks of 512 tokens with the ``raw`` codec, and prints:

- ``floor``: the model's own forward of the 32 suffix tokens over a transformers cache of the whole
  context (no placement, no selection): what any cache-reusing mode pays at least;
- ``full`` and ``hf-prefill``: kvrag's full prefill and the model's own forward over the prompt;
- per mode and tier: median TTFT of 5 runs (after one warm-up), and the load / fuse / read+decode
  split of the last run (as in ``bench speed``);
- the profiler tables (by CPU, then GPU, self time) of one run of each of the first ``NPROF`` modes.

Settings come from the environment: ``ARCH`` (default ``llama-3.1-8b``), ``LEN`` (context tokens,
8192), ``MODES`` (comma list of bench mode specs), ``TIERS`` (``disk``, ``ram``, ``gpu``; default
``gpu`` on CUDA, else ``ram``), ``NPROF`` (2). Runs on CUDA when there is a GPU, else on the CPU.

    LEN=8192 NPROF=1 MODES=cacheblend@0.15,reuse,prefix,probe@0.15,attnlink@16 TIERS=gpu,ram,disk \\
        python3 scripts/profile_fuse.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrag.model import hf_compat  # noqa: E402
from kvrag.bench import common, speed  # noqa: E402
from kvrag.codec.base import make_codec  # noqa: E402
from kvrag.storage.store import KVStore, make_store  # noqa: E402


def median_ms(fn: Callable[[], object], sync: Callable[[], None], n: int = 5) -> float:
    fn()
    sync()
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    arch = os.environ.get("ARCH", "llama-3.1-8b")
    length = int(os.environ.get("LEN", "8192"))
    modes = os.environ.get("MODES", "reuse,prefix,cacheblend@0.15,probe@0.15").split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiers = os.environ.get("TIERS", "gpu" if device == "cuda" else "ram").split(",")
    n_prof = int(os.environ.get("NPROF", "2"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    lm = speed.arch_model(arch, device, None)
    tmp = Path(tempfile.mkdtemp())
    kvstore = KVStore(make_store("disk", tmp / "chunks", fsync=False), make_codec("raw"), lm.fingerprint)
    work = speed.Workload(lm, kvstore, length, 512, 0, [t for t in tiers if t != "disk"])

    ids = torch.cat([work.prefix.ids.cpu()] + work.chunk_ids).to(device)
    with torch.no_grad():
        past = lm.model(input_ids=ids[None], use_cache=True).past_key_values
    suffix = work.suffix_ids.to(device)[None]

    def floor() -> None:
        hf_compat.crop_cache(past, ids.numel())
        with torch.no_grad():
            lm.model(input_ids=suffix, past_key_values=past, use_cache=True, logits_to_keep=1)

    print(f"floor (hf suffix over cache) {median_ms(floor, sync):.1f} ms")
    past = None  # frees the reference cache before the timed runs
    full = common.parse_mode("full").config
    full_ms = median_ms(lambda: work.time_mode(lm, full, tiers[0]), sync)
    print(f"full {full_ms:.1f} ms; hf-prefill {median_ms(lambda: work.time_plain_prefill(lm), sync):.1f} ms")
    for mode in modes:
        config = common.parse_mode(mode).config
        for tier in tiers:
            last: dict[str, float] = {}
            ms = median_ms(lambda: last.update(work.time_mode(lm, config, tier)), sync)  # noqa: B023
            print(f"{mode} {tier}: {ms:.1f} ms (last: load {last['load_s'] * 1e3:.1f} "
                  f"fuse {last['fuse_s'] * 1e3:.1f} decode {last['decode_s'] * 1e3:.1f})")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for mode in modes[:n_prof]:
        config = common.parse_mode(mode).config
        with profile(activities=activities) as prof:
            work.time_mode(lm, config, tiers[0])
        print("=====", mode)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
        if device == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
