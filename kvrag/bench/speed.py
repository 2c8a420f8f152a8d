"""TTFT against context length for every fusion mode, with the chunks' caches pre-stored on disk.

For each length, random token chunks of ``--chunk-tokens`` are prefilled once after a fixed prefix
(`kvgen.chunk_caches`), stored through `KVStore` with the lossless ``raw`` codec in a temporary
folder, and each mode is timed from loading the chunks to the first token's logits (``full`` loads
nothing and recomputes every token). Modes are interleaved within each repeat, warm-up runs are
excluded, GPU work is synchronised around every clock read, and every ratio is against ``full``
measured in the same run. ``--arch`` builds a published model shape with random weights (no
download, no tokenizer), so the numbers are timings only.

Outputs in ``--out``: ``speed.json``, ``speed.md`` and ``speed.png`` (TTFT vs context length).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrag.bench import common

log = logging.getLogger(__name__)

# Published shapes (HF config.json of each model); rope_scaling as shipped.
ARCHS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        family="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": dict(
        family="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        rope_theta=1e6,
        max_position_embeddings=131072,
    ),
    "mistral-7b": dict(
        family="mistral",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32768,
        rope_theta=1e6,
        max_position_embeddings=131072,
        sliding_window=None,
    ),
    "smollm2-135m": dict(
        family="llama",
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=1e5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        family="llama",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=131072,
    ),
}
PREFIX_TOKENS = 32  # stands in for the chat-template head + instruction
SUFFIX_TOKENS = 32  # stands in for the question and the generation prompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF id/folder, .gguf file, or 'smollm2' (real weights)")
    src.add_argument("--arch", default=None, choices=sorted(ARCHS), help="published shape, random weights")
    parser.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens (chunks only)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--modes", default=common.DEFAULT_SPEED_MODES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, …")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out/speed", help="output directory")


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r} asked for CUDA, but torch sees no GPU")
    return name


def arch_model(arch: str, device: str, dtype: str | None) -> Any:
    """Build a `LoadedModel` with the published shape of ``arch`` and random (normal-init) weights."""
    import torch
    import transformers as tf

    from kvrag.model import _resolve_dtype, wrap_model

    params = dict(ARCHS[arch])
    config_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[params.pop("family")]
    torch_dtype = _resolve_dtype(dtype, device)
    config = config_cls(**params)
    torch.manual_seed(0)
    with torch.device(device):  # initialise in place: an 8B model never passes through host memory
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    return wrap_model(model.eval(), None, source=f"random:{arch}")


def load_lm(args: argparse.Namespace, device: str) -> tuple[Any, str]:
    from kvrag.model import load_model

    if args.model:
        return load_model(args.model, dtype=args.dtype, device=device), args.model
    arch = args.arch or "smollm2-135m"
    return arch_model(arch, device, args.dtype), arch


class Workload:
    """One context length: random chunks whose caches are stored on disk, plus prefix and suffix."""

    def __init__(self, lm: Any, kvstore: Any, length: int, chunk_tokens: int, seed: int) -> None:
        import torch

        from kvrag.kvgen import chunk_caches, chunk_key, prefix_cache

        gen = torch.Generator().manual_seed(seed + length)
        rand = lambda n: torch.randint(3, lm.spec.vocab_size, (n,), generator=gen)  # noqa: E731
        self.prefix = prefix_cache(lm, rand(PREFIX_TOKENS).tolist())
        sizes = [chunk_tokens] * (length // chunk_tokens) + ([length % chunk_tokens] if length % chunk_tokens else [])
        self.chunk_ids = [rand(n) for n in sizes]
        self.suffix_ids = rand(SUFFIX_TOKENS)
        self.keys = [chunk_key(lm.fingerprint, self.prefix.ids.tolist(), c.tolist()) for c in self.chunk_ids]
        self.stored_bytes = 0
        for i, (k, v) in chunk_caches(lm, self.prefix, [c.tolist() for c in self.chunk_ids], 4 * chunk_tokens):
            self.stored_bytes += kvstore.put(self.keys[i], k.cpu(), v.cpu())
        self.kvstore = kvstore

    def time_mode(self, lm: Any, config: Any) -> dict[str, float]:
        """Load (+decode) the stored chunks and fuse; seconds, with GPU work synchronised."""
        import torch

        from kvrag.fuse import FusionInput, fuse

        device = lm.device
        common.cuda_sync(device)
        t0 = time.perf_counter()
        if config.mode == "full":
            kv: list[Any] = [None] * len(self.keys)
        else:
            kv = [tuple(t.to(device, non_blocking=True) for t in self.kvstore.load(k)) for k in self.keys]
        common.cuda_sync(device)
        t1 = time.perf_counter()
        result = fuse(lm, FusionInput(self.prefix, self.chunk_ids, kv, self.suffix_ids), config)
        int(torch.argmax(result.logits))  # the first token; also waits for the GPU
        common.cuda_sync(device)
        t2 = time.perf_counter()
        return {
            "ttft_s": t2 - t0,
            "load_s": t1 - t0,
            "fuse_s": t2 - t1,
            "recompute_fraction": result.recompute_fraction,
            "tokens": result.n_tokens,
        }


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def free_memory(device: Any) -> None:
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def time_length(lm: Any, work: Workload, specs: list[common.ModeSpec], repeats: int) -> list[dict[str, Any]]:
    """Warm-up once per mode, then ``repeats`` interleaved rounds; medians per mode."""
    samples: dict[str, list[dict[str, float]]] = {s.label: [] for s in specs}
    for spec in specs:
        work.time_mode(lm, spec.config)
    for r in range(repeats):
        for spec in specs[r % len(specs) :] + specs[: r % len(specs)]:
            samples[spec.label].append(work.time_mode(lm, spec.config))
    full_ms = statistics.median(s["ttft_s"] for s in samples[specs[0].label]) * 1e3
    rows = []
    for spec in specs:
        med = {k: statistics.median(s[k] for s in samples[spec.label]) for k in ("ttft_s", "load_s", "fuse_s")}
        rows.append(
            {
                "mode": spec.label,
                "ttft_ms": med["ttft_s"] * 1e3,
                "load_ms": med["load_s"] * 1e3,
                "fuse_ms": med["fuse_s"] * 1e3,
                "speedup": full_ms / (med["ttft_s"] * 1e3),
                "recompute_fraction": samples[spec.label][0]["recompute_fraction"],
                "prompt_tokens": samples[spec.label][0]["tokens"],
                "ttft_ms_all": [s["ttft_s"] * 1e3 for s in samples[spec.label]],
            }
        )
    return rows


def run_lengths(
    args: argparse.Namespace,
    lm: Any,
    specs: list[common.ModeSpec],
    tmp: Path,
    on_length: Callable[[list[dict[str, Any]], list[str]], object] = lambda results, notes: None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every length; ``on_length`` sees the results so far after each (partial outputs)."""
    from kvrag.codec.base import make_codec
    from kvrag.store import KVStore, make_store

    kvstore = KVStore(make_store("disk", tmp / "chunks", fsync=False), make_codec("raw"), lm.fingerprint)
    results, notes = [], []
    for length in common.parse_ints(args.lengths, "--lengths"):
        total = PREFIX_TOKENS + length + SUFFIX_TOKENS
        if total > lm.spec.max_position:
            notes.append(f"length {length} skipped: {total} tokens exceed the model's window {lm.spec.max_position}")
            continue
        try:
            work = Workload(lm, kvstore, length, args.chunk_tokens, args.seed)
            rows = time_length(lm, work, specs, args.repeats)
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


def speed_markdown(results: list[dict[str, Any]]) -> str:
    headers = ["context tokens", "mode", "TTFT ms", "speedup vs full", "load ms", "fuse ms", "recomputed"]
    rows = [
        [
            r["length"],
            r["mode"],
            r["ttft_ms"],
            f"{r['speedup']:.2f}×",
            r["load_ms"],
            r["fuse_ms"],
            r["recompute_fraction"],
        ]
        for r in results
    ]
    return common.markdown_table(headers, rows)


def speed_plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        ax.plot([r["length"] for r in rs], [r["ttft_ms"] for r in rs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (chunk tokens)")
    ax.set_ylabel("TTFT ms (load + fuse, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(args: argparse.Namespace, lm: Any, name: str, results: list[dict[str, Any]], notes: list[str]) -> str:
    """Write ``speed.json``, ``speed.md`` and ``speed.png``; returns the markdown table."""
    import torch

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
    (out / "speed.md").write_text(
        f"# kvrag bench speed\n\n`{payload['command']}`\n\n{name}, {payload['dtype']} on {where}; "
        f"chunks of {args.chunk_tokens} tokens stored with the raw codec on local disk; median of "
        f"{args.repeats}.\n\n{table}\n{note_text}\n"
    )
    if results:
        speed_plot(results, out / "speed.png", f"{name} ({payload['dtype']}, {lm.device})")
    return table + note_text


def run(args: argparse.Namespace) -> int:
    common.set_threads(args.threads)
    specs = common.parse_modes(args.modes)
    if args.repeats < 1 or args.chunk_tokens < 1:
        raise ValueError(f"--repeats and --chunk-tokens must be >= 1, got {args.repeats}, {args.chunk_tokens}")
    lm, name = load_lm(args, resolve_device(args.device))
    with tempfile.TemporaryDirectory(prefix="kvrag-speed-") as tmp:
        results, notes = run_lengths(
            args, lm, specs, Path(tmp), lambda res, nts: write_outputs(args, lm, name, res, nts)
        )
    print(write_outputs(args, lm, name, results, notes))
    return 0
