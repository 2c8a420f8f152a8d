"""The traffic benchmark's summary: per framework and arm, over the stream and per phase; a table and a plot.

Contract: `summarise` takes the rows of ``rows.jsonl`` (one per question position, framework and arm) and gives, per
(framework, arm) and per (framework, arm, phase): questions; TTFT mean, p50 and p99 (`kvrag.bench.metrics.percentile`);
mean prompt tokens; the share of prompt tokens read from a cache (summed over the answers: read tokens over prompt
tokens); the bytes held at the end (disk, memory); the share of answers whose text equals ``full``'s for the same
framework and question, their mean token F1 with it (`kvrag.bench.metrics.agreement`), and right answers
(`kvrag.bench.metrics.is_right`). `write` puts ``summary.json``, ``summary.md`` and ``ttft.png`` (TTFT over the
stream, a rolling median per arm, one panel per framework, restarts marked) in the output folder.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics

PHASES = ("cold", "warm", "from_disk")
ARM_ORDER = ("full", "llama.cpp", "prefix-index", "prefix-passages", "kvrag-index", "kvrag-passages", "fuse-index",
             "fuse-passages")
ARM_LABEL = {"full": "full (plain prefill)", "llama.cpp": "llama.cpp server (prompt cache)",
             "prefix-index": "prefix cache, index", "prefix-passages": "prefix cache, passage cache",
             "kvrag-index": "kvrag default, index", "kvrag-passages": "kvrag default, passage cache",
             "fuse-index": "kvrag fusion, index", "fuse-passages": "kvrag fusion, passage cache"}


def arm_label(arm: str) -> str:
    """The arm's name in tables and plots (``NAME@SIZE``: the arm's label with its store's bound)."""
    name, _, bound = arm.partition("@")
    return ARM_LABEL.get(name, name) + (f", bounded to {bound}" if bound else "")


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def with_agreement(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with ``same_as_full``, ``agreement_f1`` (against ``full``'s answer of the same framework and
    position; None where ``full`` did not run) and ``right``.
    """
    full = {(r["framework"], r["position"]): r["answer"] for r in rows if r["arm"] == "full"}
    out = []
    for r in rows:
        ref = full.get((r["framework"], r["position"]))
        out.append({**r, "same_as_full": None if ref is None else r["answer"] == ref,
                    "agreement_f1": None if ref is None else metrics.agreement(r["answer"], ref),
                    "right": metrics.is_right(r["answer"], r["golds"])})
    return out


def _group(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = _finite([r["ttft_s"] for r in rows])
    tokens = [r for r in rows if r.get("prompt_tokens") and r.get("read_share") is not None]
    read = sum(r["read_share"] * r["prompt_tokens"] for r in tokens)
    total = sum(r["prompt_tokens"] for r in tokens)
    agree = [r for r in rows if r["same_as_full"] is not None]
    last = max(rows, key=lambda r: r["position"])["held"] if rows else {}
    return {"n": len(rows), "ttft_mean_s": _mean(ttft), "ttft_p50_s": metrics.percentile(ttft, 50),
            "ttft_p99_s": metrics.percentile(ttft, 99),
            "prompt_tokens_mean": _mean([r["prompt_tokens"] for r in tokens]),
            "read_share": read / total if total else math.nan,
            "held_disk_bytes": last.get("disk"), "held_memory_bytes": last.get("memory"),
            "same_as_full": sum(r["same_as_full"] for r in agree) / len(agree) if agree else math.nan,
            "agreement_f1": _mean([r["agreement_f1"] for r in agree]), "right": sum(r["right"] for r in rows),
            "flush_mean_s": _mean(_finite([r.get("flush_s") for r in rows]))}


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (framework, arm): the whole stream (``phase`` ``all``) and each phase (module docstring)."""
    rows = with_agreement(rows)
    out = []
    frameworks = list(dict.fromkeys(r["framework"] for r in rows))
    arms = sorted({r["arm"] for r in rows}, key=lambda a: (ARM_ORDER.index(a.partition("@")[0]), a))
    for fw in frameworks:
        for arm in arms:
            mine = [r for r in rows if r["framework"] == fw and r["arm"] == arm]
            if not mine:
                continue
            out.append({"framework": fw, "arm": arm, "phase": "all", **_group(mine)})
            for phase in PHASES:
                part = [r for r in mine if r["phase"] == phase]
                if part:
                    out.append({"framework": fw, "arm": arm, "phase": phase, **_group(part)})
    return out


def _mb(value: Any) -> str:
    return "–" if value is None else f"{value / 1e6:,.0f}"


def _pct(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.0%}"


def table(summary: Sequence[dict[str, Any]], phase: str) -> str:
    """One phase's rows as a Markdown table."""
    headers = ["framework", "arm", "n", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "prompt tokens",
               "read from cache", "disk MB", "memory MB", "same text as full", "agreement F1", "right"]
    return common.markdown_table(headers, [
        [s["framework"], arm_label(s["arm"]), s["n"], s["ttft_mean_s"], s["ttft_p50_s"],
         s["ttft_p99_s"], "–" if not math.isfinite(s["prompt_tokens_mean"]) else f"{s['prompt_tokens_mean']:.0f}",
         _pct(s["read_share"]), _mb(s["held_disk_bytes"]), _mb(s["held_memory_bytes"]), _pct(s["same_as_full"]),
         "–" if not math.isfinite(s["agreement_f1"]) else f"{s['agreement_f1']:.3f}", s["right"]]
        for s in summary if s["phase"] == phase])


def markdown(summary: Sequence[dict[str, Any]], run: dict[str, Any]) -> str:
    """The summary as Markdown: the whole stream, then each phase."""
    parts = [f"# Traffic: {run['questions']} questions, Zipf s={run['zipf_s']}, k={run['k']}\n",
             f"Machine: {run['hardware']['cpu']}, {run['hardware']['cpu_count']} CPUs; threads {run['threads']}. "
             f"Corpus {run['corpus_passages']} passages ({run['corpus_tokens']} tokens); max new tokens "
             f"{run['max_new_tokens']}; restarts before positions {run['restarts'] or 'none'}; cold and from-disk "
             f"windows of {run['window']} questions.\n", "## Whole stream\n", table(summary, "all"), ""]
    for phase in PHASES:
        if any(s["phase"] == phase for s in summary):
            parts += [f"## {phase}\n", table(summary, phase), ""]
    return "\n".join(parts) + "\n"


def plot(rows: Sequence[dict[str, Any]], run: dict[str, Any], path: Path, window: int = 9) -> None:
    """TTFT over the stream: per framework a panel, per arm the raw points and a rolling median."""
    plt = common.pyplot()
    frameworks = list(dict.fromkeys(r["framework"] for r in rows))
    fig, axes = plt.subplots(len(frameworks), 1, figsize=(10, 3.6 * len(frameworks)), squeeze=False)
    for ax, fw in zip(axes[:, 0], frameworks):
        for arm in ARM_ORDER:
            mine = sorted((r for r in rows if r["framework"] == fw and r["arm"] == arm), key=lambda r: r["position"])
            points = [(r["position"], r["ttft_s"]) for r in mine if r["ttft_s"] is not None
                      and math.isfinite(r["ttft_s"])]
            if not points:
                continue
            bounds = [0, *run["restarts"], math.inf]
            line = None
            for lo, hi in zip(bounds, bounds[1:]):  # a rolling median within each process's lifetime
                part = [(x, y) for x, y in points if lo <= x < hi]
                if not part:
                    continue
                xs, ys = zip(*part)
                half = window // 2
                rolled = [statistics.median(ys[max(0, i - half): i + half + 1]) for i in range(len(ys))]
                color = None if line is None else line.get_color()
                label = arm_label(arm) if line is None else None
                line = ax.plot(xs, rolled, label=label, linewidth=1.4, color=color)[0]
                ax.scatter(xs, ys, s=5, alpha=0.25, color=line.get_color())
        for restart in run["restarts"]:
            ax.axvline(restart - 0.5, color="black", linestyle="--", linewidth=0.8)
        for start in [0, *run["restarts"]]:
            ax.axvspan(start - 0.5, start + run["window"] - 0.5, color="grey", alpha=0.08)
        ax.set_xlabel("question in the stream (shaded: cold start / first questions after a restart)")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        title = f"{fw}: TTFT over the stream (rolling median of {window}), k={run['k']}, Zipf s={run['zipf_s']}"
        if ax is axes[-1, 0]:  # the last panel: title, grid, legend, and the figure written
            common.save_plot(plt, fig, ax, path, title)
        else:
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


def write(out: Path, rows: Sequence[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md`` and ``ttft.png`` to ``out``; return the summary payload."""
    summary = summarise(rows)
    payload = {**run, "summary": summary}
    common.write_json(out / "summary.json", payload)
    (out / "summary.md").write_text(markdown(summary, run), encoding="utf-8")
    plot(rows, run, out / "ttft.png")
    return payload
