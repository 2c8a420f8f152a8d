"""TTFT against context length for every fusion mode, with the chunks' caches pre-stored on disk.

For each length, random token chunks of ``--chunk-tokens`` are prefilled once after a fixed prefix
(`kvgen.chunk_caches`), stored through `KVStore` with the ``--codec`` codec (lossless ``raw`` by
default) in a temporary folder, and each mode is timed from loading the chunks to the first token's
logits (``full`` loads nothing and recomputes every token). Loading runs layer by layer alongside the recompute (a
`kvrag.loading.feed` pipeline) from each ``--tiers`` source: ``disk`` (the store; page cache warm), ``ram``
(host memory, pinned on CUDA) and ``gpu`` (resident in GPU memory). A plain transformers forward
over the same prompt (``hf-prefill``) is timed too, to show that ``full`` is a fair baseline. Runs
are interleaved within each repeat, warm-up runs are excluded, GPU work is synchronised around every
clock read, and every ratio is against ``full`` measured in the same run. ``--arch`` builds a
published model shape with random weights (no download, no tokenizer), so the numbers are timings
only.

Outputs in ``--out``: ``speed.json``, ``speed.md`` and ``speed.png`` (TTFT vs context length).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from kvrag.bench import common
from kvrag.bench.archs import ARCHS
from kvrag.bench.workload import PREFIX_TOKENS, SUFFIX_TOKENS, TIERS, Workload
from kvrag.codec.base import make_codec
from kvrag.model import load_model
from kvrag.model.loading import _resolve_dtype, wrap_model
from kvrag.storage.kvstore import KVStore
from kvrag.storage.stores import ThrottledStore, make_store

log = logging.getLogger(__name__)



def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r} asked for CUDA, but torch sees no GPU")
    return name


def arch_model(arch: str, device: str, dtype: str | None) -> Any:
    """Build a `LoadedModel` with the published shape of ``arch`` and random (normal-init) weights."""
    params = dict(ARCHS[arch])
    config_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[params.pop("family")]
    torch_dtype = _resolve_dtype(dtype, device)
    config = config_cls(**params)
    torch.manual_seed(0)
    with torch.device(device):  # initialise in place: an 8B model never passes through host memory
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    return wrap_model(model.eval(), None, source=f"random:{arch}")


def load_lm(args: argparse.Namespace, device: str) -> tuple[Any, str]:
    if args.model:
        return load_model(args.model, dtype=args.dtype, device=device), args.model
    arch = args.arch or "smollm2-135m"
    return arch_model(arch, device, args.dtype), arch


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def free_memory(device: Any) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


PLAIN = "hf-prefill"


def time_length(lm: Any, work: Workload, specs: list[common.ModeSpec], repeats: int,
                tiers: Sequence[str] = ("disk",)) -> list[dict[str, Any]]:
    """Warm-up once per run kind, then ``repeats`` interleaved rounds; medians per (mode, tier).

    ``full`` loads nothing and runs once per round; every other mode runs once per tier. A plain
    transformers forward over the same prompt (``hf-prefill``) is timed alongside as a fairness check.
    """
    runs: list[tuple[str, str, Callable[[], dict[str, float]]]] = [(PLAIN, "-", lambda: work.time_plain_prefill(lm))]
    for spec in specs:
        for tier in ["-"] if spec.config.mode == "full" else tiers:
            source = tier if tier != "-" else "disk"
            runs.append((spec.label, tier, functools.partial(work.time_mode, lm, spec.config, source)))
    samples: dict[tuple[str, str], list[dict[str, float]]] = {(m, t): [] for m, t, _ in runs}
    for _, _, run in runs:
        run()
    for r in range(repeats):
        for mode, tier, run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            samples[mode, tier].append(run())
    full_ms = statistics.median(s["ttft_s"] for s in samples[specs[0].label, "-"]) * 1e3
    rows = []
    for mode, tier, _ in runs:
        got = samples[mode, tier]
        med = {k: statistics.median(s.get(k, 0.0) for s in got)
               for k in ("ttft_s", "load_s", "fuse_s", "decode_s", "recompute_fraction", "ratio", "text_chunks")}
        rows.append(
            {
                "mode": mode,
                "tier": tier,
                "ttft_ms": med["ttft_s"] * 1e3,
                "load_ms": med["load_s"] * 1e3,
                "fuse_ms": med["fuse_s"] * 1e3,
                "read_decode_ms": med["decode_s"] * 1e3,
                "speedup": full_ms / (med["ttft_s"] * 1e3),
                "recompute_fraction": med["recompute_fraction"],
                "ratio": med["ratio"],  # the median ratio fused at (an +adaptive mode's plans raise it)
                "text_chunks": med["text_chunks"],  # median chunks recomputed from text (+adaptive)
                "prompt_tokens": got[0]["tokens"],
                "ttft_ms_all": [s["ttft_s"] * 1e3 for s in got],
            }
        )
        if "plan_load_s" in got[0]:  # +adaptive: each repeat's predictions next to what it measured
            rows[-1].update({f"{k}_ms_all": [s[f"{k}_s"] * 1e3 for s in got]
                             for k in ("plan_load", "plan_recompute", "decode", "fuse")})
    return rows


def run_lengths(
    args: argparse.Namespace,
    lm: Any,
    specs: list[common.ModeSpec],
    tmp: Path,
    on_length: Callable[[list[dict[str, Any]], list[str]], object] = lambda results, notes: None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every length; ``on_length`` sees the results so far after each (partial outputs)."""
    store = make_store("disk", tmp / "chunk-caches", fsync=False)
    if getattr(args, "store_mbps", None):
        store = ThrottledStore(store, args.store_mbps * 1e6)
    kvstore = KVStore(store, make_codec(args.codec), lm.fingerprint, lm.family.windows, decoded_bytes=0)
    results, notes = [], []
    tiers = parse_tiers(args.tiers, lm.device)
    for length in common.parse_ints(args.lengths, "--lengths"):
        total = PREFIX_TOKENS + length + SUFFIX_TOKENS
        if total > lm.spec.max_position:
            notes.append(f"length {length} skipped: {total} tokens exceed the model's window {lm.spec.max_position}")
            continue
        try:
            work = Workload(lm, kvstore, length, args.chunk_tokens, args.seed, tiers)
            rows = time_length(lm, work, specs, args.repeats, tiers)
        except (RuntimeError, MemoryError) as exc:
            if not is_oom(exc):
                raise
            free_memory(lm.device)
            notes.append(f"length {length} skipped: out of memory on {lm.device} ({str(exc).splitlines()[0]})")
            log.warning("%s", notes[-1])
            continue
        for row in rows:
            row.update(length=length, stored_mb=work.stored_bytes / 2**20)
        results += rows
        log.info("length %d: full %.1f ms", length, rows[0]["ttft_ms"])
        del work
        free_memory(lm.device)
        on_length(results, notes)
    return results, notes


def parse_tiers(text: str, device: Any) -> list[str]:
    """``disk,ram,gpu`` -> tiers to time; ``gpu`` needs a CUDA model."""
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if not tiers or bad:
        raise ValueError(f"--tiers must list some of {TIERS}, got {text!r}")
    if "gpu" in tiers and getattr(device, "type", str(device)) != "cuda":
        raise ValueError("--tiers gpu needs a CUDA device (caches resident in GPU memory)")
    return list(dict.fromkeys(tiers))


def speed_markdown(results: list[dict[str, Any]]) -> str:
    headers = ["context tokens", "mode", "caches in", "TTFT ms", "speedup vs full", "load ms (waited)",
               "read+decode ms (overlapped)", "fuse ms", "recomputed", "ratio", "chunks from text"]
    rows = [
        [
            r["length"],
            r["mode"],
            r.get("tier", "disk"),
            r["ttft_ms"],
            f"{r['speedup']:.2f}×",
            r["load_ms"],
            r.get("read_decode_ms", 0.0),
            r["fuse_ms"],
            r["recompute_fraction"],
            r.get("ratio", "-") if r["mode"].startswith(("cacheblend", "probe")) else "-",
            r.get("text_chunks", 0),
        ]
        for r in results
    ]
    return common.markdown_table(headers, rows)


def speed_plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode, tier in dict.fromkeys((r["mode"], r.get("tier", "disk")) for r in results):
        rs = [r for r in results if r["mode"] == mode and r.get("tier", "disk") == tier]
        label = mode if tier == "-" else f"{mode} ({tier})"
        style = "--" if mode == PLAIN else ":" if tier == "ram" else "-." if tier == "gpu" else "-"
        ax.plot([r["length"] for r in rs], [r["ttft_ms"] for r in rs], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (chunk tokens)")
    ax.set_ylabel("TTFT ms (load + fuse, median)")
    common.save_plot(plt, fig, ax, path, title, grid="both")


def write_outputs(args: argparse.Namespace, lm: Any, name: str, results: list[dict[str, Any]], notes: list[str]) -> str:
    """Write ``speed.json``, ``speed.md`` and ``speed.png``; returns the markdown table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        **common.stamp(args),
        "model": name,
        "device": str(lm.device),
        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        "chunk_tokens": args.chunk_tokens,
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "repeats": args.repeats,
        "tiers": args.tiers,
        "codec": args.codec,
        "store_mbps": getattr(args, "store_mbps", None),
        "notes": notes,
        "results": results,
    }
    common.write_json(out / "speed.json", payload)
    table = speed_markdown(results)
    hw = payload["hardware"]
    where = (
        hw["gpu"]["name"]
        if hw["gpu"]
        else f"CPU {hw['cpu']} ({hw['cpus_usable']} usable cores, {torch.get_num_threads()} threads)"
    )
    note_text = "".join(f"\n- {n}" for n in notes)
    disk = "local store, page cache warm"
    if payload["store_mbps"]:
        disk = f"the local store read through one {payload['store_mbps']:g} MB/s link"
    (out / "speed.md").write_text(
        f"# kvrag bench speed\n\n`{payload['command']}`\n\n{name}, {payload['dtype']} on {where}; "
        f"chunks of {args.chunk_tokens} tokens, caches stored with the {args.codec} codec and loaded layer by layer "
        f"during fusion from the listed tier (disk: {disk}; ram: host memory; gpu: "
        f"GPU memory); load ms is the loading fusion waited for; median of {args.repeats}.\n\n"
        f"{table}\n{note_text}\n"
    )
    if results:
        speed_plot(results, out / "speed.png", f"{name} ({payload['dtype']}, {lm.device})")
    return table + note_text


def run(args: argparse.Namespace) -> int:
    common.set_threads(args.threads)
    specs = common.with_fuse_settings(common.parse_modes(args.modes), args.check_layers, args.attention,
                                     args.first_ratio_scale)
    if args.repeats < 1 or args.chunk_tokens < 1:
        raise ValueError(f"--repeats and --chunk-tokens must be >= 1, got {args.repeats}, {args.chunk_tokens}")
    lm, name = load_lm(args, resolve_device(args.device))
    with tempfile.TemporaryDirectory(prefix="kvrag-speed-") as tmp:
        results, notes = run_lengths(
            args, lm, specs, Path(tmp), lambda res, nts: write_outputs(args, lm, name, res, nts)
        )
    print(write_outputs(args, lm, name, results, notes))
    return 0
