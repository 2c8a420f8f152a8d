"""The load benchmark's table and plot from its rows (`run.py`): ``python report.py RESULTS_DIR`` redraws them.

Contract: `summarise(row)` turns one level's raw measurements into the reported figures (answers and tokens per
second over the level's wall time, TTFT p50/p99 over answered turns from the attempt answered (from its admission),
TTFT p99 from a turn's first attempt and the longest any turn waited (answered or given up), p99 time between
tokens, the share of requests admitted (answers over answers and 429s; an attempt held in kvrag's waiting line and
then answered is admitted), how many answered attempts were held, peak resident memory, error counts);
`write_report(rows, out)` writes ``table.md`` and, when matplotlib is installed, ``load.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = ("server", "clients", "answers", "empty", "answers/s", "tokens/s", "TTFT p50 s", "TTFT p99 s",
           "TTFT p99 from first attempt s", "longest wait s", "p99 between tokens s", "admitted share", "held",
           "peak RSS MB", "429", "given up", "5xx", "other errors")


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (the value at rank ``q * n``); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """The reported figures of one level."""
    wall = max(row["wall_s"], 1e-9)
    return {"server": row["server"], "clients": row["clients"], "answers": row["answers"],
            "empty": row.get("empty_answers", 0),
            "answers/s": row["answers"] / wall, "tokens/s": row["tokens"] / wall,
            "TTFT p50 s": quantile(row["ttft_s"], 0.5), "TTFT p99 s": quantile(row["ttft_s"], 0.99),
            "TTFT p99 from first attempt s": quantile(row.get("ttft_first_attempt_s", []), 0.99),
            "longest wait s": max([*row.get("ttft_first_attempt_s", []), *row.get("given_up_s", [])], default=None),
            "p99 between tokens s": quantile(row["gaps_s"], 0.99),
            "admitted share": row["answers"] / max(row["answers"] + row["refused_429"], 1),
            "held": len(row.get("held_s", [])),
            "peak RSS MB": row["peak_rss_bytes"] / 2**20,
            "429": row["refused_429"], "given up": len(row.get("given_up_s", [])), "5xx": row["server_5xx"],
            "other errors": row["other_errors"]}


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    return str(value)


def write_report(rows: list[dict[str, Any]], out: Path) -> None:
    """``table.md`` (and ``load.png``) in ``out``."""
    figures = [summarise(r) for r in rows]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(f[c]) for c in COLUMNS) + " |" for f in figures]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for server in sorted({f["server"] for f in figures}):
        mine = [f for f in figures if f["server"] == server]
        clients = [f["clients"] for f in mine]
        axes[0].plot(clients, [f["answers/s"] for f in mine], marker="o", label=server)
        axes[1].plot(clients, [f["TTFT p50 s"] or 0 for f in mine], marker="o", label=f"{server} p50")
        axes[1].plot(clients, [f["TTFT p99 s"] or 0 for f in mine], marker="x", linestyle="--", label=f"{server} p99")
        axes[2].plot(clients, [f["peak RSS MB"] for f in mine], marker="o", label=server)
    for ax, title in zip(axes, ("answers per second", "TTFT (s)", "peak resident memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    write_report(json.loads((folder / "results.json").read_text())["rows"], folder)
