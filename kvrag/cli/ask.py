"""``kvrag ask INDEX QUESTION``: answer a question from an index.

Contract: an empty question or a missing index folder fails in one line before this module, and torch, is imported
(`kvrag.cli.arguments`).
The model is the one the index was built with; ``--model`` loads another name for it and is refused
(`IndexMismatchError`) unless it is the same model. ``--warmup N`` first answers N throwaway
questions, unprinted. Prints the answer on stdout (``--stream``: as it is generated), then on stderr
one line with the mode, the TTFT and its breakdown, the model-load time (not part of the TTFT) and
the chunks used; ``--json`` prints all of it on stdout instead, model load as ``load_model_s``. The
chunk caches are read from where the index records them (``--store URL`` names them otherwise); a store
that does not answer costs one warning, and the chunks are computed from their text. ``--ttft-slo S``
streams the chunks (`FuseConfig.ttft_slo`): per chunk the stored level, or the text, that meets the target
at the store's measured bandwidth; ``--json`` then shows the choices under ``load_plan``. ``--timings`` prints
on stderr where the time went from the process's start (`kvrag.cli.process_clock`) to the whole answer. In the
command's own process numba starts without SciPy's BLAS (`kvrag.model.numba_start`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvrag.cli.common import store_arg
from kvrag.cli.process_clock import seconds_since_start
from kvrag.config import DEFAULT_MODE, FuseConfig, GateConfig
from kvrag.model import numba_start
from kvrag.rag import KVRag

WARMUP_QUESTION = "What are these passages about?"


def _gate(choice: str) -> Any:
    """``--gate`` as `KVRag.answer`'s ``gate`` argument."""
    return {"auto": None, "on": True, "off": False, "fuse": GateConfig(fuse=True),
            "strict": GateConfig(strict=True)}[choice]


def _summary(answer: Any, load_s: float, warmup: int) -> str:
    t = answer.timings
    parts = ", ".join(f"{name} {t[name + '_s'] * 1000:.0f}" for name in ("retrieve", "load", "fuse")
                      if name + "_s" in t)
    warm = f"after {warmup} warm-up answer{'s' if warmup > 1 else ''}" if warmup else "first answer, includes warm-up"
    chunks = ", ".join(c.key[:10] for c in answer.chunks)
    gate = f"; gate: {_gate_text(answer.gate)}" if answer.gate is not None else ""
    return (f"[{answer.mode}{gate}: TTFT {answer.ttft_s * 1000:.0f} ms ({parts} ms; {warm}); "
            f"model load {load_s:.1f} s, not in the TTFT; chunks {chunks}]")


def run(args: argparse.Namespace) -> int:
    """Answer ``args.question`` from ``args.index`` (its checks passed: `kvrag.cli.arguments`)."""
    import_s = getattr(args, "import_s", 0.0)  # this module's import, timed by `kvrag.cli.main`
    since_start = seconds_since_start()
    started = None if since_start is None else since_start - import_s  # Python, the CLI, the arguments
    t0 = time.perf_counter()
    if getattr(args, "own_process", False):
        numba_start.only_kvrag_compiles()
    rag = KVRag.open(args.index, model=args.model, device=args.device, store=store_arg(args),
                     embedder=args.embedder)
    load_s = time.perf_counter() - t0
    try:
        kwargs: dict[str, Any] = dict(k=args.k, mode=args.mode, ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                                      gate=_gate(args.gate))
        if args.ttft_slo is not None:  # streaming: the fusion's settings in a FuseConfig
            kwargs["fuse_config"] = FuseConfig(mode=args.mode or DEFAULT_MODE, ttft_slo=args.ttft_slo,
                                               ratio=FuseConfig.ratio if args.ratio is None else args.ratio)
        t1 = time.perf_counter()
        for _ in range(args.warmup):
            rag.answer(WARMUP_QUESTION, **{**kwargs, "max_new_tokens": 1})
        warmup_s = time.perf_counter() - t1
        if args.stream and not args.json:
            for piece in rag.stream(args.question, **kwargs):
                print(piece, end="", flush=True)
            print()
            answer = rag.last_answer
        else:
            answer = rag.answer(args.question, **kwargs)
        assert answer is not None
    finally:
        t_close = time.perf_counter()
        rag.close()
    if args.timings:
        phases = {"start": started, "import": import_s, "open": load_s,
                  "warmup": warmup_s if args.warmup else None, "close": time.perf_counter() - t_close}
        print(_timings_text(answer, phases), file=sys.stderr)
    if args.json:
        out = {**answer.to_json(), "load_model_s": load_s}
        if args.warmup:
            out.update(warmup=args.warmup, warmup_s=warmup_s)
        print(json.dumps(out, indent=2))
        return 0
    if not args.stream:
        print(answer.text)
    print(_summary(answer, load_s, args.warmup), file=sys.stderr)
    return 0


def _timings_text(answer: Any, phases: dict[str, float | None]) -> str:
    """``--timings``: each phase's seconds, one a line, and their sum (from the process's start where known)."""
    t = answer.timings
    ttft, total = float(answer.ttft_s), float(t.get("total_s", answer.ttft_s))
    retrieve, load, fuse = (float(t.get(name, 0.0)) for name in ("retrieve_s", "load_s", "fuse_s"))
    rows = [("start (Python, kvrag's CLI, arguments)", phases["start"]),
            ("imports (torch, kvrag)", phases["import"]),
            ("open (model, index, caches' store)", phases["open"]),
            ("warm-up answers", phases["warmup"]),
            ("retrieve (with the embedder's first load)", retrieve),
            ("read caches", load), ("prefill or fusion", fuse),
            ("to the first token, the rest", max(ttft - retrieve - load - fuse, 0.0)),
            (f"decode ({len(answer.token_ids)} tokens after the first)", max(total - ttft, 0.0)),
            ("close", phases["close"])]
    shown = [(name, seconds) for name, seconds in rows if seconds is not None]
    width = max(len(name) for name, _ in shown)
    lines = [f"  {name:<{width}}  {seconds:6.2f} s" for name, seconds in shown]
    whole = "from the process's start" if phases["start"] is not None else "after starting (start unknown here)"
    lines.append(f"  {'total, ' + whole:<{width}}  {sum(seconds for _, seconds in shown):6.2f} s")
    return "kvrag ask --timings:\n" + "\n".join(lines)


_DECISIONS = {
    "fused": "check passed",
    "exact": "long prompt, prefilled in full after the kept head (fusion is --gate fuse)",
    "kept": "every passage read from a kept prompt's exact rows",
    "stored": "every passage read from rows stored after the same tokens, the rest recomputed",
    "text": "mostly text without a stored cache, prefilled in full",
    "text_before": "new text before the passages, prefilled in full",
}


def _gate_text(report: Any) -> str:
    """What the correctness gate did, in a few words."""
    if report.decision == "short":
        how = "full prefill" if report.attempts[-1]["mode"] == "full" else "first chunk read, the rest recomputed"
        return f"short prompt ({report.stale_tokens} stale tokens), {how}"
    if report.decision in _DECISIONS:
        return _DECISIONS[report.decision]
    last = report.attempts[-1]
    return f"check failed ({report.attempts[0]['reason']}), answered by {last['mode']}"