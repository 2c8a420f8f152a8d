"""Build throughput on Ray (1 and 2 workers) against the single-process build, over passages of a QA file.

    python benchmarks/build-ray/run.py --qa $QA/hotpotqa_ircot.jsonl --passages 100 --out benchmarks/build-ray

Each configuration builds a fresh index of the same passages (SmolLM2 by default, the default codec, semantic
split) on a local Ray cluster started once before the runs (a cluster is up before a build in practice).
The single-process build gets the model already loaded; a Ray build starts its workers, each loading the
model and the embedder, and that start is timed apart. Writes ``results.json`` and ``results.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from kvrag import KVRag
from kvrag.indexing import ray_build
from kvrag.model import load_model


def passages(qa: Path, limit: int) -> list[tuple[str, str]]:
    """The first ``limit`` distinct ``ctxs`` passages of a QA jsonl file, as ``(title, "title\\ntext")``."""
    out: dict[str, str] = {}
    for line in qa.read_text().splitlines():
        for ctx in json.loads(line).get("ctxs", []):
            title = ctx["title"]
            if title not in out and len(out) < limit:
                out[title] = f"{title}\n{ctx['text']}"
    return list(out.items())


def timed_build(docs, path: Path, lm, engine: str, workers: int | None, codec: str | None) -> dict:
    """One build: its wall time, the workers' start (Ray), and the `BuildStats` of the build's add."""
    captured: dict = {}
    add, init = KVRag.add, ray_build.WorkerPool.__init__

    def counting_add(self, *args, **kwargs):
        captured["stats"] = add(self, *args, **kwargs)
        return captured["stats"]

    def timed_init(self, *args, **kwargs):
        t0 = time.perf_counter()
        init(self, *args, **kwargs)
        captured["start_s"] = time.perf_counter() - t0

    KVRag.add, ray_build.WorkerPool.__init__ = counting_add, timed_init
    try:
        t0 = time.perf_counter()
        rag = KVRag.build(docs, path, model=lm, codec=codec, show_progress=False, engine=engine, workers=workers)
        wall = time.perf_counter() - t0
    finally:
        KVRag.add, ray_build.WorkerPool.__init__ = add, init
    stats, start = captured["stats"], captured.get("start_s", 0.0)
    chunks, tokens = len(rag.index), sum(r.n_tokens for r in rag.index.records())
    rag.close()
    work = wall - start
    return {"engine": engine, "workers": workers, "chunks": chunks, "prefill_tokens": tokens,
            "prefilled_chunks": stats.prefilled_chunks, "stored_bytes": stats.stored_bytes,
            "wall_s": round(wall, 2), "worker_start_s": round(start, 2), "work_s": round(work, 2),
            "chunks_per_s": round(chunks / wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "chunks_per_s_after_start": round(chunks / work, 2), "tokens_per_s_after_start": round(tokens / work, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qa", type=Path, required=True, help="a QA jsonl file whose records hold 'ctxs'")
    parser.add_argument("--passages", type=int, default=100)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--codec", default=None, help="default: kvrag's default codec")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--worker-niceness", type=int, default=None,
                        help="the Ray workers' nice value (Ray's default: 15, below every normal process)")
    args = parser.parse_args()

    import ray
    import torch

    docs = passages(args.qa, args.passages)
    lm = load_model(args.model, device="cpu")
    cpus, load_before = os.cpu_count() or 1, os.getloadavg()
    if args.worker_niceness is not None:  # read by the raylet this process starts
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    results = []
    work = Path(tempfile.mkdtemp(prefix="kvrag-build-ray-"))
    try:
        runs = [("local", None)] + [("ray", n) for n in args.workers]
        for engine, workers in runs:
            result = timed_build(docs, work / f"{engine}-{workers}", lm, engine, workers, args.codec)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    meta = {"passages": len(docs), "model": args.model, "codec": args.codec or "default", "cpus": cpus,
            "torch_threads_single_process": torch.get_num_threads(), "machine": platform.platform(),
            "worker_niceness": args.worker_niceness if args.worker_niceness is not None else "ray default (15)",
            "load_average_before": load_before, "load_average_after": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    rows = ["| build | workers | chunks | prefill tokens | wall s | worker start s | chunks/s | tokens/s | "
            "chunks/s after start | tokens/s after start |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r['engine']} | {r['workers'] or '-'} | {r['chunks']} | {r['prefill_tokens']} | "
                    f"{r['wall_s']} | {r['worker_start_s']} | {r['chunks_per_s']} | {r['tokens_per_s']} | "
                    f"{r['chunks_per_s_after_start']} | {r['tokens_per_s_after_start']} |")
    (args.out / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
