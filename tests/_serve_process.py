"""A real ``kvrag serve`` process for the tests: started on a free loopback port, waited for, stopped or killed.

A server that does not start fails the test with the end of its log (never a skip).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

START_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    """``python -m kvrag.cli serve INDEX --port P ARGS…`` on one CPU thread; ``url`` once `start` returned."""

    def __init__(self, index: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.index, self.args, self.port, self.preexec = index, args, port or free_port(), preexec
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "serve", str(self.index), "--port",
                                      str(self.port), "--device", "cpu", *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=self.preexec)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"kvrag serve exited with status {self.proc.returncode}: {self.output()[-1500:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"kvrag serve did not answer /health within {START_S:.0f} s: {self.output()[-1500:]}")

    def output(self) -> str:
        """What the server printed so far."""
        if self.log is None:
            return ""
        self.log.seek(0)
        return str(self.log.read().decode(errors="replace"))

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> int:
        """SIGTERM, then the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)

    def kill(self) -> None:
        """``kill -9``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
        if self.log is not None:
            self.log.close()


def metric(text: str, name: str) -> float:
    """The value of the metric line ``name`` (with its labels, as exposed) in ``text``; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
