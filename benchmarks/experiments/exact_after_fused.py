"""A prompt whose passages were stored elsewhere, asked again under a fusing gate: fused each time, or read in place
after the exact pass that the second fused answer pays for (`kvrag.passages.exact_pass`).

    python benchmarks/experiments/exact_after_fused.py --data benchmarks/data/hotpotqa_ircot.jsonl --start 11 --n 10

For each QA item: its passages are warmed into a new passage cache (each computed alone, as `warm` and
`KVCacheWarmer` store them), then one prompt (LlamaIndex's default text-QA template, passages first, in the model's
chat template) is asked three times under ``GateConfig(fuse=True)`` and once with ``mode="full"``, greedily. The
first two answers fuse the warmed caches; after the second, the exact pass runs on the cache's background thread
(its time is that of `PassageCache.flush`, not in any TTFT). Before the third answer the kept prompts and the decoded
tier are cleared, so it reads the store, as a new process would (the page cache stays warm: not a restarted
process). Prints per item and as medians: TTFT of the fused answers, of the third, and of ``full``; the exact
pass's seconds; and which answers equal ``full``'s text. Without the exact pass the third answer would be fused
like the second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from kvrag import GateConfig
from kvrag.passages import PassageCache
from kvrag.query.locate import chat_prompt

TEMPLATE = ("Context information is below.\n---------------------\n{context}\n---------------------\nGiven the context "
            "information and not prior knowledge, answer the query.\nQuery: {question}\nAnswer: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a QA JSONL file ({question, answers, ctxs: [{title, text}]})")
    parser.add_argument("--start", type=int, default=11, help="the first item (1-based)")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the rows and medians as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.data) as fh:
        items = [json.loads(line) for line in fh][args.start - 1:args.start - 1 + args.n]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrag-exact-") as folder:
        cache = PassageCache.open("smollm2", f"file://{folder}/cache?max_bytes=5GB")
        fuse = GateConfig(fuse=True)
        cache.answer_prompt(chat_prompt(cache.lm.tokenizer, "Warm-up."), max_new_tokens=2)  # lazy initialisation
        for item in items:
            passages = [f"{c['title']}\n{c['text']}" for c in item["ctxs"]]
            prompt = chat_prompt(cache.lm.tokenizer, TEMPLATE.format(context="\n\n".join(passages),
                                                                     question=item["question"]))
            cache.warm(passages, show_progress=False)
            cache.flush()
            asked = [cache.answer_prompt(prompt, passages=passages, gate=fuse, max_new_tokens=args.max_new_tokens)]
            assert cache.flush()
            asked.append(cache.answer_prompt(prompt, passages=passages, gate=fuse, max_new_tokens=args.max_new_tokens))
            start = time.perf_counter()
            assert cache.flush()
            exact_pass_s = time.perf_counter() - start
            cache.heads.clear_prompts()
            cache.kvstore.decoded.clear()
            asked.append(cache.answer_prompt(prompt, passages=passages, gate=fuse, max_new_tokens=args.max_new_tokens))
            full = cache.answer_prompt(prompt, mode="full", max_new_tokens=args.max_new_tokens)
            assert cache.flush()
            row = {"id": item["id"], "prompt_tokens": full.n_prompt_tokens, "exact_pass_s": round(exact_pass_s, 3),
                   "full_ttft_s": round(full.ttft_s, 3),
                   "decisions": [a.gate.decision if a.gate else a.mode for a in asked],
                   "ttft_s": [round(a.ttft_s, 3) for a in asked], "same_as_full": [a.text == full.text for a in asked]}
            rows.append(row)
            print(json.dumps(row))
        info = cache.info()
        cache.close()
    medians = {"fused_ttft_s": statistics.median(r["ttft_s"][1] for r in rows),
               "third_ttft_s": statistics.median(r["ttft_s"][2] for r in rows),
               "full_ttft_s": statistics.median(r["full_ttft_s"] for r in rows),
               "exact_pass_s": statistics.median(r["exact_pass_s"] for r in rows),
               "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
               "same_as_full": [sum(r["same_as_full"][i] for r in rows) for i in range(3)], "items": len(rows),
               "exact_passes": info["exact_passes"]}
    print(json.dumps(medians))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "medians": medians, "settings": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    main()
