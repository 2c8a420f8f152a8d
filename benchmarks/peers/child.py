"""One timed task of the peer benchmark, in a process of its own: ``python child.py SPEC.json RESULT.json``.

A fresh process per task makes its peak resident memory (``VmHWM``) that task's alone. The spec names the task:

- ``kvrag-full`` / ``kvrag-default``: open the kvrag index, then time ``KVRag.prepare(question, chunks=keys,
  mode="full")`` (or with no mode: kvrag's default mode under the correctness gate) to the argmax of the first
  token's logits. After the timed runs the same fused prompt decodes its first token through kvrag, whose own TTFT
  (`Answer.ttft_s`) is kept beside the measured one.
- ``llama-<format>``: load the GGUF with llama-cpp-python and time ``Llama.eval(ids)`` over the very token ids
  kvrag prefills, to the argmax of the last position's logits; the KV cache is cleared before every run.

Each run is preceded by ``warmup`` untimed runs of the same prompt; ``runs`` timed runs follow (the parent takes the
minimum over processes). Nothing here imports torch for a llama.cpp task.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def memory_kb() -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of this process, in kB."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return out


def run_kvrag(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from kvrag.config import GenerateConfig
    from kvrag.rag import KVRag

    t0 = time.perf_counter()
    rag = KVRag.open(spec["index"])
    _ = rag.prefix  # computed once per opened index: part of loading, not of a question
    load_s = time.perf_counter() - t0
    after_load = memory_kb()
    mode = "full" if spec["task"] == "kvrag-full" else None
    keys, question = spec["keys"], spec["question"]

    def once() -> tuple[float, Any, int]:
        start, cpu = time.perf_counter(), time.process_time()
        fused = rag.prepare(question, chunks=keys, mode=mode)
        top = int(torch.argmax(fused.fused.logits))
        elapsed = time.perf_counter() - start
        cpu_s.append(time.process_time() - cpu)
        return elapsed, fused, top

    cpu_s: list[float] = []

    with torch.inference_mode():
        for _ in range(spec["warmup"]):
            once()
        times, tops = [], []
        fused = None
        for _ in range(spec["runs"]):
            elapsed, fused, top = once()
            times.append(elapsed)
            tops.append(top)
        assert fused is not None
        logits = fused.fused.logits.float().cpu().numpy()
        answer = fused.generate(GenerateConfig(max_new_tokens=1))
    if spec.get("logits_out"):
        import numpy as np

        np.save(spec["logits_out"], logits)
    gate = fused.gate.to_json() if fused.gate is not None else None
    return {
        "ttft_s_all": times, "cpu_s_all": cpu_s[spec["warmup"]:], "first_tokens": tops, "load_s": load_s,
        "rss_after_load_kb": after_load.get("VmRSS"), "prompt_tokens": answer.n_prompt_tokens,
        "kvrag_ttft_s": answer.ttft_s, "mode": answer.mode, "ratio": answer.ratio,
        "recompute_fraction": answer.recompute_fraction,
        "kvrag_first_token": answer.token_ids[0] if answer.token_ids else None,
        "first_token_text": rag.lm.tokenizer.decode(answer.token_ids[:1]), "gate": gate,
        "timings": answer.timings,
    }


def run_llama(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    ids = [int(t) for t in spec["ids"]]
    n_ctx = -(-(len(ids) + 16) // 256) * 256
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_batch=spec["n_batch"], n_ubatch=spec["n_ubatch"], flash_attn=spec["flash_attn"],
                logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    after_load = memory_kb()
    n_vocab = llm.n_vocab()

    def once() -> tuple[float, np.ndarray]:
        llm.reset()  # the next eval removes the KV cache from position 0 on
        start, cpu = time.perf_counter(), time.process_time()
        llm.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        top = int(logits.argmax())
        elapsed = time.perf_counter() - start
        cpu_s.append(time.process_time() - cpu)
        assert top >= 0
        return elapsed, logits.copy()

    cpu_s: list[float] = []
    for _ in range(spec["warmup"]):
        once()
    times, tops, logits = [], [], None
    for _ in range(spec["runs"]):
        elapsed, logits = once()
        times.append(elapsed)
        tops.append(int(logits.argmax()))
    if spec.get("logits_out") and logits is not None:
        np.save(spec["logits_out"], logits.astype(np.float32))
    return {
        "ttft_s_all": times, "cpu_s_all": cpu_s[spec["warmup"]:], "first_tokens": tops, "load_s": load_s,
        "rss_after_load_kb": after_load.get("VmRSS"), "prompt_tokens": len(ids), "n_ctx": n_ctx,
        "first_token_text": llm.detokenize(tops[:1], special=True).decode("utf-8", "replace"),
        "llama_cpp_python": llama_cpp.__version__,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_kvrag(spec) if spec["task"].startswith("kvrag-") else run_llama(spec)
    result["memory_kb"] = memory_kb()
    Path(sys.argv[2]).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
