"""`kvrag serve` held under steady load: resident memory and errors, window by window.

Usage (from the repository root):

    python benchmarks/serve-load/soak.py --out benchmarks/serve-load/soak --clients 16 --minutes 60

Prepares as `run.py` does (the same index, conversations and settings), starts only ``kvrag serve`` and runs
``--clients`` concurrent clients without a pause for ``--minutes``, in windows of ``--window`` seconds. For each
window it records the answers, 429s, 5xx and other errors, the TTFT p50 and p99, the server's resident memory
at the window's end and at its peak, and the bytes its conversations' host tier holds (bounded by
``--session-host-bytes``, 1 GiB by default). Writes ``soak.json`` and ``soak.md`` to ``--out``; the memory is flat when the
later windows' end values stay within a few percent of the first window's after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import run_level  # noqa: E402
from report import quantile  # noqa: E402
from run import PeakRss, _interrupted, server_args, started, targets  # noqa: E402


def host_tier_bytes(url: str) -> float:
    """The bytes the server's conversation host tier holds (its ``/metrics``), 0 when unread."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith('kvrag_session_tier_bytes{tier="host"}'):
            return float(line.split()[-1])
    return 0.0


def table(rows: list[dict[str, Any]]) -> str:
    """The windows as a Markdown table."""
    head = ("window", "minutes", "answers", "429", "5xx", "other errors", "TTFT p50 s", "TTFT p99 s", "RSS end MB",
            "RSS peak MB", "host tier MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        lines.append(f"| {i + 1} | {r['end_min']:.1f} | {r['answers']} | {r['refused_429']} | {r['server_5xx']} | "
                     f"{r['other_errors']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['rss_end_bytes'] / 2**20:.0f} | {r['rss_peak_bytes'] / 2**20:.0f} | "
                     f"{r.get('host_tier_bytes', 0) / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupted)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "soak")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=300.0, help="seconds a window lasts")
    server_args(parser)
    args = parser.parse_args()
    servers, convs = started(args, llama=False, log="server.log")
    proc, _ = servers["kvrag"]
    target = targets(servers, args.k)["kvrag"]
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < args.minutes * 60:
            with PeakRss(proc.pid) as rss:
                level = asyncio.run(run_level(target, convs[len(rows) % 7:], args.clients, args.window))
                time.sleep(0.5)  # one more sample after the window's last turn
            rows.append({"end_min": (time.monotonic() - start) / 60, "answers": level.answers,
                         "refused_429": level.refused_429, "server_5xx": level.server_5xx,
                         "other_errors": level.other_errors, "error_samples": level.error_samples,
                         "ttft_p50_s": quantile(level.ttft_s, 0.5) or 0.0,
                         "ttft_p99_s": quantile(level.ttft_s, 0.99) or 0.0,
                         "rss_end_bytes": rss.last, "rss_peak_bytes": rss.peak, "alive": proc.poll() is None,
                         "host_tier_bytes": host_tier_bytes(target.base_url.removesuffix("/v1"))})
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "soak.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                            "windows": rows}, indent=1) + "\n")
            (args.out / "soak.md").write_text(table(rows))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
