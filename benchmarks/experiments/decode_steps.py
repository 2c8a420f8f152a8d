"""Time of one decoding step, alone and for several answers together, over caches of a given length.

    python benchmarks/experiments/decode_steps.py --model smollm2 --cache-tokens 700 --answers 1 8 --threads 2

Each answer's cache is a prefill of ``--cache-tokens`` random tokens. For each count in ``--answers`` the answers
take ``--steps`` steps in a row through kvrag's batched step (`kvrag.generation.step_batch.forward_steps`, which
writes each step's rows into room kept after the cache's rows); one answer's steps also run through the model's
own forward (transformers' cache, which concatenates a layer's rows at every step). Prints the median step time
after the first two of each run (the first makes the room).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from kvrag.generation import step_batch
from kvrag.model import hf_compat
from kvrag.model.loading import load_model


def _prefilled(model: object, n: int, seed: int) -> object:
    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = hf_compat.base_model(model)(input_ids=ids, use_cache=True)
    return hf_compat.returned_cache(out)


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times[2:]) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cache-tokens", type=int, default=700)
    parser.add_argument("--answers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu").model
    caches = [_prefilled(model, args.cache_tokens, seed) for seed in range(max(args.answers))]
    n = args.cache_tokens
    for count in args.answers:
        held = [copy.deepcopy(c) for c in caches[:count]]
        times = []
        for i in range(args.steps):
            steps = [step_batch._Step(model, cache, 42, n + i) for cache in held]
            began = time.perf_counter()
            with torch.no_grad():
                step_batch.forward_steps(model, steps)
            times.append(time.perf_counter() - began)
        print(f"{count} answer(s) together, kvrag's step: {_median_ms(times)} ms")
    cache, times = copy.deepcopy(caches[0]), []
    for i in range(args.steps):
        began = time.perf_counter()
        with torch.no_grad():
            model(input_ids=torch.tensor([[42]]), position_ids=torch.tensor([[n + i]]),  # type: ignore[operator]
                  **hf_compat.with_cache(model, cache), use_cache=True)
        times.append(time.perf_counter() - began)
    print(f"1 answer, the model's own forward: {_median_ms(times)} ms")


if __name__ == "__main__":
    main()
