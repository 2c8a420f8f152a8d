r"""Time one layer's attention for a scattered selection with each kernel `FuseConfig.attention` offers.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128), bf16, random tensors. For
each context length and selection (``cacheblend``-like: 15 % of the chunk positions at random plus a
32-token suffix; ``attnlink``-like: the first 16 positions of every 512-token chunk plus the suffix)
it prints the median milliseconds of:

- ``blocks``: the decoder layer's SDPA over up to 4 position-ordered blocks, each under a dense
  additive mask over the keys up to its last position, keys repeated to the query heads (what
  transformers passes when given a mask);
- ``flex``: `kvrag.fusion.scatter_attention` in one call (FlexAttention under a block mask), given the
  repeated keys or the KV heads;
- ``causal``: a full prefill's causal flash attention over all N positions, for scale.

and each kernel's largest difference from ``blocks``. Needs CUDA.

    python3 scripts/scatter_attention_bench.py 8192,32768
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrag.fusion import fuse  # noqa: E402

from kvrag.fusion import scatter_attention  # noqa: E402

HEADS, KV_HEADS, DIM, CHUNK, SUFFIX = 32, 8, 128, 512, 32


def median_ms(fn: Callable[[], object], n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def selections(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    chunks = torch.arange(CHUNK, n - SUFFIX)
    picked = chunks[torch.randperm(chunks.numel(), generator=gen)[: int(0.15 * chunks.numel())]].sort().values
    links = torch.cat([torch.arange(s, s + 16) for s in range(CHUNK, n - SUFFIX, CHUNK)])
    tail = torch.arange(n - SUFFIX, n)
    return {"cacheblend-15%": torch.cat([picked, tail]), "attnlink-16": torch.cat([links, tail])}


def blocks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    n, count = sel.numel(), 4
    bounds = [round(i * n / count) for i in range(count + 1)]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        limit = int(sel[b - 1]) + 1
        mask = fuse._attention_mask(sel[a:b], limit, q.dtype, None)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :limit], v[:, :, :limit], attn_mask=mask))
    return torch.cat(outs, dim=2)


def main() -> None:
    lengths = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768").split(",")]
    device, dtype, gen = torch.device("cuda"), torch.bfloat16, torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    if not scatter_attention.flex_works(device):
        raise SystemExit("FlexAttention does not run here")
    for n in lengths:
        k = torch.randn(1, KV_HEADS, n, DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        k_rep, v_rep = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        q_all = torch.randn(1, HEADS, n, DIM, device=device, dtype=dtype)
        causal = median_ms(lambda: F.scaled_dot_product_attention(q_all, k_rep, v_rep, is_causal=True))  # noqa: B023
        print(f"N={n}: causal (full prefill) {causal:.2f} ms")
        for name, sel in selections(n, gen).items():
            sel = sel.to(device)
            q = torch.randn(1, HEADS, sel.numel(), DIM, device=device, dtype=dtype)
            ref = blocks_attention(q, k_rep, v_rep, sel)
            base = median_ms(lambda: blocks_attention(q, k_rep, v_rep, sel))  # noqa: B023
            print(f"  {name} ({sel.numel()} queries): blocks {base:.2f} ms")
            plan = scatter_attention.ScatterPlan.build(sel, n)
            for keys, values, label in ((k_rep, v_rep, "repeated keys"), (k, v, "kv heads")):

                def run() -> torch.Tensor:
                    return scatter_attention.scatter_attention(q, keys, values, plan)  # noqa: B023

                diff = (run().float() - ref.float()).abs().max().item()
                ms = median_ms(run)
                print(f"    flex ({label}): {ms:.2f} ms ({base / ms:.2f}x blocks), max diff {diff:.2e}")

if __name__ == "__main__":
    main()
