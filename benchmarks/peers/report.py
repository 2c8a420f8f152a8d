"""The peer benchmark's summary (per prompt length and task), its Markdown table and its plot."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

KVRAG_TASKS = ("kvrag-full", "kvrag-default")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(float(np.exp(x - m).sum()))


def compare_logits(reference: np.ndarray, other: np.ndarray) -> dict[str, Any]:
    """How far ``other``'s first-token logits are from ``reference``'s (kvrag's full prefill)."""
    ref_lp, oth_lp = _log_softmax(reference), _log_softmax(other)
    top5_ref, top5_oth = set(np.argsort(-reference)[:5].tolist()), set(np.argsort(-other)[:5].tolist())
    return {
        "max_abs_diff": float(np.max(np.abs(reference.astype(np.float64) - other))),
        "max_abs_logit": float(np.max(np.abs(reference))),
        "kl_ref_other": float(np.sum(np.exp(ref_lp) * (ref_lp - oth_lp))),
        "top1_same": bool(reference.argmax() == other.argmax()),
        "top5_overlap": len(top5_ref & top5_oth),
    }


def summarise(args: argparse.Namespace, prompts: list[dict[str, Any]], rows: list[dict[str, Any]],
              logits: dict[tuple[int, str], np.ndarray], matmul: dict[str, Any]) -> dict[str, Any]:
    """Per prompt: each task's minimum TTFT, prefill rate, peak memory and first token; the ratios; the checks."""
    mm_gflops = max(m["gflops"] for m in matmul.values())
    lengths = []
    for pi, p in enumerate(prompts):
        n = len(p["ids"])
        entry: dict[str, Any] = {
            "target": p["target"], "prompt_tokens": n, "passages": len(p["docs"]),
            "cut_passage": any(":cut" in doc_id for doc_id, _ in p["docs"]),
            "tokenize_ms": p.get("tokenize_ms"), "prefill_gflop": p["flops"]["total"] / 1e9,
            "attention_share": p["flops"]["attention"] / p["flops"]["total"],
            "tasks": {}, "errors": {},
        }
        for task in args.tasks_list:
            got = [r for r in rows if r["target"] == p["target"] and r["task"] == task]
            ok = [r for r in got if "ttft_s_all" in r]
            if not ok:
                entry["errors"][task] = [r.get("error", "no run") for r in got] or ["no run"]
                continue
            ttfts = [t for r in ok for t in r["ttft_s_all"]]
            best = min(ttfts)
            tops = [t for r in sorted(ok, key=lambda r: r["repeat"]) for t in r["first_tokens"]]
            hwm = [r["memory_kb"].get("VmHWM") or r["memory_kb"]["ru_maxrss"] for r in ok]
            info: dict[str, Any] = {
                "ttft_ms": best * 1e3, "ttft_ms_all": [t * 1e3 for t in ttfts],
                "ttft_ms_median": float(np.median(ttfts)) * 1e3,
                "cpu_ms": min(c for r in ok for c in r.get("cpu_s_all", [math.nan])) * 1e3,
                "prefill_tokens_per_s": n / best,
                "gflops_per_s": p["flops"]["total"] / best / 1e9,
                "share_of_matmul_rate": p["flops"]["total"] / best / 1e9 / mm_gflops,
                "peak_rss_mb": max(hwm) / 1024, "rss_after_load_mb": max(r["rss_after_load_kb"] for r in ok) / 1024,
                "load_s": min(r["load_s"] for r in ok), "first_token": tops[0],
                "first_token_stable": len(set(tops)) == 1,
                "first_token_text": ok[0].get("first_token_text"), "runs": len(ttfts),
            }
            if ok[0].get("prompt_tokens") != n:
                info["prompt_tokens_mismatch"] = ok[0].get("prompt_tokens")
            if task.startswith("kvrag-"):
                last = ok[-1]
                info.update(kvrag_ttft_ms=min(r["kvrag_ttft_s"] for r in ok) * 1e3, mode=last["mode"],
                            ratio=last["ratio"], recompute_fraction=last["recompute_fraction"], gate=last["gate"])
            entry["tasks"][task] = info
        t = entry["tasks"]
        entry["ratios"] = {f"{llama}/{ours}": t[llama]["ttft_ms"] / t[ours]["ttft_ms"]
                           for llama in t if llama.startswith("llama-") for ours in KVRAG_TASKS if ours in t}
        reference = "kvrag-full"
        entry["first_token_agreement"] = {
            f"{task}=={reference}": t[task]["first_token"] == t[reference]["first_token"]
            for task in t if task != reference and reference in t}
        if (pi, reference) in logits:
            entry["logits_vs_kvrag_full"] = {task: compare_logits(logits[pi, reference], logits[pi, task])
                                             for task in t if task != reference and (pi, task) in logits}
        lengths.append(entry)
    return {
        "benchmark": "peers", "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup,
        "tasks": args.tasks_list, "data": Path(args.data).name, "item": args.item,
        "llama_cpp": {"n_batch": args.n_batch, "n_ubatch": args.n_ubatch, "flash_attn": not args.no_flash_attn},
        "omp_wait_policy": args.omp_wait_policy,
        "matmul": matmul, "matmul_gflops": mm_gflops, "lengths": lengths,
    }


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """The machine and the versions: kvrag's stamp, plus llama-cpp-python and llama.cpp's own CPU report."""
    from kvrag.bench import common

    env: dict[str, Any] = {"command": " ".join(["python", "benchmarks/peers/run.py", *_argv_without_paths()]),
                           "hardware": common.hardware(), "versions": common.versions(),
                           "platform": platform.platform()}
    try:
        import llama_cpp

        env["versions"]["llama_cpp_python"] = llama_cpp.__version__
        env["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except ImportError:
        env["versions"]["llama_cpp_python"] = None
    return env


def _argv_without_paths() -> list[str]:
    """The command line with ``--data``'s folder dropped (only its file name is kept)."""
    out, argv = [], sys.argv[1:]
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--data":
            arg = "$QA/" + Path(arg).name
        elif arg.startswith("--data="):
            arg = "--data=$QA/" + Path(arg.split("=", 1)[1]).name
        out.append(arg)
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The per-length table: TTFT of each task, llama.cpp over kvrag, prefill rates, peak memory, first tokens."""
    tasks = summary["tasks"]
    llamas = [t for t in tasks if t.startswith("llama-")]
    ours = [t for t in KVRAG_TASKS if t in tasks]
    head = ["prompt tokens", *[f"{t} ms" for t in tasks], *[f"{a}/{b}" for a in llamas for b in ours]]
    if "kvrag-default" in tasks:
        head.append("kvrag-default ran (recomputed)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary["lengths"]:
        t = e["tasks"]
        cells = [str(e["prompt_tokens"])]
        cells += [f"{t[x]['ttft_ms']:,.0f}" if x in t else "failed" for x in tasks]
        cells += [f"{e['ratios'][f'{a}/{b}']:.2f}" if f"{a}/{b}" in e["ratios"] else "–" for a in llamas for b in ours]
        if "kvrag-default" in tasks:
            d = t.get("kvrag-default")
            cells.append(f"{_ran(d)} ({d['recompute_fraction']:.2f})" if d else "–")
        lines.append("| " + " | ".join(cells) + " |")
    cpu_head = ["prompt tokens", *[f"{t} CPU ms" for t in tasks]]
    lines += ["", "| " + " | ".join(cpu_head) + " |", "|" + "---|" * len(cpu_head)]
    for e in summary["lengths"]:
        t = e["tasks"]
        cells = [str(e["prompt_tokens"])] + [f"{t[x]['cpu_ms']:,.0f}" if x in t else "–" for x in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    rate_head = ["prompt tokens", *[f"{t} tok/s (GFLOP/s)" for t in tasks]]
    lines += ["", "| " + " | ".join(rate_head) + " |", "|" + "---|" * len(rate_head)]
    for e in summary["lengths"]:
        t = e["tasks"]
        cells = [str(e["prompt_tokens"])]
        cells += [f"{t[x]['prefill_tokens_per_s']:,.0f} ({t[x]['gflops_per_s']:.1f})" if x in t else "–"
                  for x in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    mem_head = ["prompt tokens", *[f"{t} peak MB" for t in tasks], "first token (kvrag-full)", "agrees"]
    lines += ["", "| " + " | ".join(mem_head) + " |", "|" + "---|" * len(mem_head)]
    for e in summary["lengths"]:
        t = e["tasks"]
        cells = [str(e["prompt_tokens"])]
        cells += [f"{t[x]['peak_rss_mb']:,.0f}" if x in t else "–" for x in tasks]
        full = t.get("kvrag-full")
        cells.append(f"{full['first_token']} {json.dumps(full['first_token_text'])}" if full else "–")
        agree = [k.split("==")[0] for k, v in e["first_token_agreement"].items() if v]
        differ = [k.split("==")[0] for k, v in e["first_token_agreement"].items() if not v]
        cells.append(", ".join(agree) + (f"; differ: {', '.join(differ)}" if differ else ""))
        lines.append("| " + " | ".join(cells) + " |")
    mm = summary["matmul"]
    lines += ["", f"torch.mm float32 {mm['start']['n']}² on {summary['threads']} threads: "
              f"{mm['start']['gflops']:.1f} GFLOP/s at the start, {mm['end']['gflops']:.1f} at the end."]
    return "\n".join(lines) + "\n"


def _ran(task: dict[str, Any]) -> str:
    """What kvrag's default mode ran: the mode and ratio, or the full prefill the gate chose."""
    gate = task.get("gate") or {}
    if gate.get("decision") in ("short", "full"):  # "full": older results
        return f"{task['mode']} (gate, short prompt)"
    if task["mode"] == "full":
        return "full"
    ratio = f"@{task['ratio']:g}" if task["mode"] in ("probe", "cacheblend") else ""
    escalated = f", {gate['escalations']} escalations" if gate.get("escalations") else ""
    return f"{task['mode']}{ratio}{escalated}"


def plot(summary: dict[str, Any], path: Path) -> None:
    """TTFT against prompt length, one line per task (log-log)."""
    from kvrag.bench import common

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for task in summary["tasks"]:
        pts = [(e["prompt_tokens"], e["tasks"][task]["ttft_ms"]) for e in summary["lengths"] if task in e["tasks"]]
        if pts:
            style = "-" if task.startswith("kvrag-") else "--"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=task)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lengths = [e["prompt_tokens"] for e in summary["lengths"]]
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])  # the measured lengths, not log-axis minor labels
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"TTFT ms (min of {summary['repeats']}, {summary['threads']} threads)")
    title = "kvrag and llama.cpp, SmolLM2-135M-Instruct, same token ids"
    if summary.get("label"):
        title += f"\n{summary['label']}"
    common.save_plot(plt, fig, ax, path, title, grid="both")


def write(out: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, ``summary.md`` and ``ttft.png`` in ``out``."""
    from kvrag.bench import common

    common.write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out / "ttft.png")
