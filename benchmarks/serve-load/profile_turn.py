"""Where one turn of the load benchmark spends its time in kvrag: the `Answer`'s own timings for a few turns, then
cProfile of one turn, on one thread (the benchmark's index in ``--work``; run `run.py` first).

    python benchmarks/serve-load/profile_turn.py > benchmarks/serve-load/profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvrag

SYSTEM = {"role": "system", "content": "Answer the question from the passages in a few words."}


def main() -> None:
    import torch

    from kvrag import KVRag

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvrag-serve-load"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    items = [json.loads(line) for line in (ROOT / "benchmarks" / "data" / "hotpotqa_ircot.jsonl").open()]
    with KVRag.open(args.work / "index", device="cpu") as rag:
        rag.chat([SYSTEM, {"role": "user", "content": items[0]["question"]}], k=4, max_new_tokens=24)  # warm-up
        for item in items[1:6]:
            began = time.perf_counter()
            answer = rag.chat([SYSTEM, {"role": "user", "content": item["question"]}], k=4, max_new_tokens=24)
            took = time.perf_counter() - began
            gate = answer.gate.to_json() if answer.gate else {}
            print(f"turn {took:.2f} s: TTFT {answer.ttft_s:.2f} s, {len(answer.token_ids)} tokens "
                  f"({(took - answer.ttft_s) / max(len(answer.token_ids) - 1, 1):.3f} s each after the first), "
                  f"{answer.n_prompt_tokens} prompt tokens, mode {answer.mode} (gate: {gate.get('decision')}), "
                  + ", ".join(f"{k} {v:.2f}" for k, v in answer.timings.items()))
        profile = cProfile.Profile()
        profile.enable()
        rag.chat([SYSTEM, {"role": "user", "content": items[7]["question"]}], k=4, max_new_tokens=24)
        profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
