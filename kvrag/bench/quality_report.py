"""Summaries of a quality run: per-mode means with bootstrap intervals, question-by-question paired
differences against baselines, the Markdown tables and the agreement-against-speed plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.bench import common, metrics


def summarise(rows: list[dict[str, Any]], specs: list[common.ModeSpec]) -> list[dict[str, Any]]:
    by_mode = {s.label: [r for r in rows if r["mode"] == s.label] for s in specs}
    full_ttft = metrics.summary([r["ttft_s"] for r in by_mode["full"]])["mean"]
    out = []
    for spec in specs:
        rs = by_mode[spec.label]
        ttft = metrics.summary([r["ttft_s"] for r in rs])
        abs_delta_nll = [abs(r["delta_nll"]) for r in rs]
        mean = {
            k: metrics.summary([r[k] for r in rs])["mean"]
            for k in (
                "f1",
                "rouge_l",
                "em",
                "agreement",
                "first_token_agreement",
                "delta_nll",
                "recompute_fraction",
                "load_s",
                "fuse_s",
                "prompt_tokens",
            )
        }
        out.append(
            {
                "mode": spec.label,
                "n": len(rs),
                **mean,
                # signed ΔNLL can cancel over questions scored better and worse than by full
                "abs_delta_nll": metrics.summary(abs_delta_nll)["mean"],
                "ttft_mean_s": ttft["mean"],
                "ttft_p50_s": ttft["p50"],
                "ttft_p90_s": ttft["p90"],
                "ttft_speedup": full_ttft / ttft["mean"],
                "agreement_ci": list(metrics.bootstrap_interval([r["agreement"] for r in rs])),
                "abs_delta_nll_ci": list(metrics.bootstrap_interval(abs_delta_nll)),
                **_gate_rates(rs),
            }
        )
    return out


def _gate_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """For rows answered under the correctness gate: how often it escalated, and how often it ended in
    a full prefill (failed checks, and short prompts where the gate prefills them in full).
    """
    gated = [r["gate"] for r in rows if "gate" in r]
    if not gated:
        return {}
    return {"gate_escalation_rate": sum(g["decision"] == "escalated" for g in gated) / len(gated),
            "gate_full_rate": sum(g["attempts"][-1]["mode"] == "full" for g in gated) / len(gated)}


PAIRED_BASELINES = ("reuse", "full@bfloat16")
MIN_PAIRED_QUESTIONS = 10  # fewer, and a bootstrap interval says little: no verdict


def paired(rows: list[dict[str, Any]], labels: list[str],
           baselines: Sequence[str] = PAIRED_BASELINES) -> list[dict[str, Any]]:
    """Each mode (``labels``, in the run's order) against each ``baselines`` mode of the run, on
    the questions both answered: the mean per-question difference in agreement and in |ΔNLL|, with
    95 % bootstrap intervals.

    ``separated`` says whether the agreement interval excludes 0 (the mode agrees with ``full``
    more, or less, than the baseline does beyond what the choice of questions explains); None
    below `MIN_PAIRED_QUESTIONS` questions.
    """
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["id"]] = r
    out = []
    for base in (b for b in baselines if b in by_mode):
        for label in labels:
            if label in (base, "full") or label not in by_mode:
                continue
            ids = [i for i in by_mode[label] if i in by_mode[base]]
            mode, ref = by_mode[label], by_mode[base]
            agree = [mode[i]["agreement"] - ref[i]["agreement"] for i in ids]
            closer = [abs(mode[i]["delta_nll"]) - abs(ref[i]["delta_nll"]) for i in ids]
            lo, hi = metrics.bootstrap_interval(agree)
            out.append({
                "mode": label, "baseline": base, "n": len(ids),
                "agreement_diff": metrics.summary(agree)["mean"], "agreement_diff_ci": [lo, hi],
                "abs_delta_nll_diff": metrics.summary(closer)["mean"],
                "abs_delta_nll_diff_ci": list(metrics.bootstrap_interval(closer)),
                "separated": bool(lo > 0 or hi < 0) if len(ids) >= MIN_PAIRED_QUESTIONS else None,
            })
    return out


def paired_markdown(pairs: list[dict[str, Any]]) -> str:
    headers = ["mode", "against", "questions", "agreement diff", "95 % interval", "\\|ΔNLL\\| diff", "95 % interval",
               "agreement separated"]
    rows = [
        [p["mode"], p["baseline"], p["n"], f"{p['agreement_diff']:+.3f}", interval_text(p["agreement_diff_ci"], "+.3f"),
         f"{p['abs_delta_nll_diff']:+.4f}", interval_text(p["abs_delta_nll_diff_ci"], "+.4f"),
         {True: "yes", False: "no", None: "too few questions"}[p["separated"]]]
        for p in pairs
    ]
    return common.markdown_table(headers, rows)


def interval_text(ci: Sequence[float], fmt: str = ".3f") -> str:
    """``[lo, hi]`` of an interval, each bound in ``fmt``."""
    return f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def summary_markdown(summary: list[dict[str, Any]]) -> str:
    headers = [
        "mode",
        "gold F1",
        "Rouge-L",
        "EM",
        "agreement",
        "agreement 95 % interval",
        "first-token",
        "ΔNLL",
        "mean \\|ΔNLL\\|",
        "TTFT mean ms",
        "p50 ms",
        "p90 ms",
        "speedup vs full",
        "recomputed",
    ]
    rows = [
        [
            s["mode"],
            s["f1"],
            s["rouge_l"],
            s["em"],
            s["agreement"],
            interval_text(s["agreement_ci"]),
            s["first_token_agreement"],
            s["delta_nll"],
            s["abs_delta_nll"],
            s["ttft_mean_s"] * 1e3,
            s["ttft_p50_s"] * 1e3,
            s["ttft_p90_s"] * 1e3,
            f"{s['ttft_speedup']:.2f}×",
            s["recompute_fraction"],
        ]
        for s in summary
    ]
    return common.markdown_table(headers, rows)


def pareto_plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs, ys = [s["ttft_speedup"] for s in summary], [s["agreement"] for s in summary]
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    for s, x, y in zip(summary, xs, ys, strict=True):
        ax.annotate(s["mode"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front, best = [], -1.0
    for x, y in sorted(
        zip(xs, ys, strict=True), key=lambda p: -p[0]
    ):  # fastest first: keep points better than all faster ones
        if y > best:
            front.append((x, y))
            best = y
    ax.plot(*zip(*sorted(front), strict=True), color="tab:orange", linestyle="--", label="Pareto front", zorder=2)
    ax.set_xlabel("TTFT speedup vs full (same run)")
    ax.set_ylabel("agreement with full (token F1)")
    ax.set_ylim(-0.02, 1.05)
    common.save_plot(plt, fig, ax, path, title)
