"""TTFT of `full` and of kvrag's default on the CPU for every supported model family, beside Llama's.

    python benchmarks/experiments/family_speed.py --length 2048 --repeats 3 --threads 1 \
        --out benchmarks/experiments/family-speed

Each family gets one random-weight model of the same tiny-but-not-trivial shape (8 layers, hidden 512, 8 query and
4 key/value heads of 64, MLP 1536; the expert families 8 experts of 768, 2 per token), with what makes the family
differ set as its published checkpoints set it (windows, multipliers, NoPE layers, soft-caps, sinks). Each gets a
`kvrag.bench.workload.Workload`: random chunks of ``--chunk-tokens`` after a 32-token prefix, a 32-token question,
their caches stored on disk with the default codec. Three runs per family: transformers' own prefill of the
prompt (``hf-prefill``), ``full``, and the default (``probe@0.15``, the gate's fused path at this length, caches
read from disk while fusing). Every run of every family is repeated ``--repeats`` times, families and runs
interleaved (each round in a rotated order) so that the load of a shared machine falls on all of them alike; the
figure is the median TTFT (to the first token's logits). The stored caches' bytes are reported as kvrag stores
them (a windowed layer keeps its window's rows) and, for the windowed families, with every row kept. Writes
``family_speed.json`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvrag.bench.common import parse_mode
from kvrag.bench.workload import Workload

SHAPE = dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1536, vocab_size=32768, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
             pad_token_id=0)
EXPERTS = dict(num_experts_per_tok=2)
ALTERNATING = ["sliding_attention", "full_attention"] * 4


def family_config(name: str) -> Any:
    """The benchmark shape as family ``name``, with its published distinguishing settings."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**SHAPE)
    if name == "granite":  # granite-3.x
        return tf.GraniteConfig(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                                attention_multiplier=0.0078125, **SHAPE)
    if name == "olmo2":
        return tf.Olmo2Config(**SHAPE)
    if name == "phi3":  # Phi-4-mini's partial rotary
        return tf.Phi3Config(partial_rotary_factor=0.75, **SHAPE)
    if name == "smollm3":  # every fourth layer without positional encoding
        return tf.SmolLM3Config(no_rope_layers=[1, 1, 1, 0] * 2, **SHAPE)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=768, **EXPERTS, **SHAPE)
    if name == "mixtral":
        return tf.MixtralConfig(num_local_experts=8, **EXPERTS, **dict(SHAPE, intermediate_size=768))
    if name == "gemma2":
        return tf.Gemma2Config(query_pre_attn_scalar=64, sliding_window=4096, layer_types=ALTERNATING, **SHAPE)
    if name == "gemma3":  # Gemma 3 1B: 512-token windows, five local layers to one global
        types = (["sliding_attention"] * 5 + ["full_attention"]) + ["sliding_attention"] * 2
        return tf.Gemma3TextConfig(query_pre_attn_scalar=64, sliding_window=512, layer_types=types, **SHAPE)
    if name == "gpt_oss":
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
        return tf.GptOssConfig(sliding_window=128, layer_types=ALTERNATING, num_local_experts=8, rope_parameters=rope,
                               **EXPERTS, **dict(SHAPE, intermediate_size=768, max_position_embeddings=131072))
    raise ValueError(f"unknown family {name!r}")


FAMILIES = ("llama", "granite", "olmo2", "phi3", "smollm3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "gpt_oss")


def family_model(name: str) -> Any:
    """A `LoadedModel` of family ``name`` with random weights, float32, on the CPU."""
    import transformers as tf

    from kvrag.model.families import family_of
    from kvrag.model.loading import wrap_model

    config = family_config(name)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=family_of(config).attn_implementation())
    return wrap_model(model.eval(), None, source=f"random:{name}")


def workload(lm: Any, folder: Path, length: int, chunk_tokens: int, cut: bool = True) -> Workload:
    """Chunks of ``lm``'s stored on disk in ``folder`` with the default codec, a windowed layer's keeping its
    window's rows (``cut``, as kvrag stores them) or every row."""
    from kvrag.codec.base import make_codec
    from kvrag.config import CodecConfig
    from kvrag.storage.kvstore import KVStore
    from kvrag.storage.stores import make_store

    codec = CodecConfig()
    kvstore = KVStore(make_store("disk", folder, fsync=False), make_codec(codec.name, codec.level), lm.fingerprint,
                      lm.family.windows if cut else None)
    return Workload(lm, kvstore, length, chunk_tokens, seed=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--length", type=int, default=2048, help="context tokens in chunks")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.families.split(",")
    default = parse_mode("probe@0.15").config
    full = parse_mode("full").config
    runs: list[tuple[str, str, Any]] = []
    stored: dict[str, tuple[int, int]] = {}  # per family: the caches' bytes as stored, and with every row kept
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in names:
            lm = family_model(name)
            work = workload(lm, Path(tmp) / name, args.length, args.chunk_tokens)
            stored[name] = work.stored_bytes, (workload(lm, Path(tmp) / f"{name}-whole", args.length,
                                                        args.chunk_tokens, cut=False).stored_bytes
                                               if any(lm.family.windows) else work.stored_bytes)
            runs += [(name, "hf-prefill", lambda lm=lm, w=work: w.time_plain_prefill(lm)),
                     (name, "full", lambda lm=lm, w=work: w.time_mode(lm, full)),
                     (name, "default", lambda lm=lm, w=work: w.time_mode(lm, default))]
            print(f"built {name}", flush=True)
        for _, _, run in runs:  # warm-up
            run()
        samples: dict[tuple[str, str], list[dict[str, float]]] = {(n, m): [] for n, m, _ in runs}
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for r in range(args.repeats):
            shift = r * len(runs) // args.repeats
            for name, mode, run in runs[shift:] + runs[:shift]:
                samples[name, mode].append(run())
    rows = summarise(names, samples, stored)
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"started": started, "length": args.length, "chunk_tokens": args.chunk_tokens,
                "repeats": args.repeats, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__, "shape": SHAPE, "default": "probe@0.15, cachegen caches from disk"}
        (args.out / "family_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


def summarise(names: list[str], samples: dict[tuple[str, str], list[dict[str, float]]],
              stored: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    """Per family: median TTFT of each run (ms), every sample, the default's recompute fraction and the stored
    caches' bytes (as stored, and with every row of the windowed layers kept)."""
    rows = []
    for name in names:
        ms = {mode: [s["ttft_s"] * 1e3 for s in samples[name, mode]] for mode in ("hf-prefill", "full", "default")}
        med = {mode: statistics.median(v) for mode, v in ms.items()}
        rows.append({"family": name, "tokens": samples[name, "full"][0]["tokens"],
                     **{f"{mode}_ms": med[mode] for mode in med}, **{f"{mode}_ms_all": ms[mode] for mode in ms},
                     "default_speedup": med["full"] / med["default"],
                     "default_recompute_fraction": samples[name, "default"][0]["recompute_fraction"],
                     "stored_bytes": stored[name][0], "stored_bytes_every_row": stored[name][1]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| family | tokens | transformers prefill | `full` | default (probe@0.15) | default vs `full` "
             "| stored caches (every row) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['tokens']} | {r['hf-prefill_ms']:.0f} ms | {r['full_ms']:.0f} ms | "
                     f"{r['default_ms']:.0f} ms | {r['default_speedup']:.2f}× | {r['stored_bytes'] / 1e6:.2f} MB "
                     f"({r['stored_bytes_every_row'] / 1e6:.2f} MB) |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
