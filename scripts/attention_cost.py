"""Prefill time per token against per unit of `kvrag.loading.control.FusionShape.units`, at several lengths.

The loading controller predicts recompute time as ``a + c · units``, a unit being one token through
one layer weighted by ``1 + keys / K`` (``K``: `kvrag.loading.control.half_cost_keys`). If that weighting is
right, a full prefill's seconds per unit stay level as the prompt grows while its seconds per token
climb.

    python scripts/attention_cost.py --arch smollm2-135m --lengths 512,1024,2048,4096,8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvrag.model import hf_compat
from kvrag.bench import common
from kvrag.bench.speed import arch_model
from kvrag.loading.control import fusion_shape, half_cost_keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="smollm2-135m")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    common.set_threads(args.threads)
    lm = arch_model(args.arch, "cpu", "float32")
    k0 = half_cost_keys(lm.model)
    print(json.dumps({"arch": args.arch, "half_cost_keys": k0}))
    base = hf_compat.base_model(lm.model)
    with torch.no_grad():
        base(input_ids=torch.randint(0, 1000, (1, 64)))  # warm-up
        for n in (int(x) for x in args.lengths.split(",")):
            ids = torch.randint(0, 1000, (1, n))
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                base(input_ids=ids)
                best = min(best, time.perf_counter() - t0)
            units = fusion_shape([], n, lm.spec.n_layers, half_cost_keys=k0).units(0.0, ())
            print(json.dumps({"tokens": n, "seconds": round(best, 3),
                              "ms_per_token_layer": round(best / (n * lm.spec.n_layers) * 1e3, 4),
                              "ms_per_unit": round(best / units * 1e3, 4)}), flush=True)


if __name__ == "__main__":
    main()
