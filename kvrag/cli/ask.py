"""``kvrag ask INDEX QUESTION``: answer a question from an index.

Contract: an empty question or a missing index folder fails in one line before torch is imported.
The model is the one the index was built with; ``--model`` loads another name for it and is refused
(`IndexMismatchError`) unless it is the same model. ``--warmup N`` first answers N throwaway
questions, unprinted. Prints the answer on stdout (``--stream``: as it is generated), then on stderr
one line with the mode, the TTFT and its breakdown, the model-load time (not part of the TTFT) and
the chunks used; ``--json`` prints all of it on stdout instead, model load as ``load_model_s``. The
chunk caches are read from where the index records them (``--store URL`` names them otherwise); a store
that does not answer costs one warning, and the chunks are computed from their text. ``--ttft-slo S``
streams the chunks (`FuseConfig.ttft_slo`): per chunk the stored level, or the text, that meets the target
at the store's measured bandwidth; ``--json`` then shows the choices under ``load_plan``. ``--timings`` prints
on stderr where the time went from the process's start (`kvrag.cli.process_clock`) to the whole answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvrag.cli.common import add_embedder_flag, add_store_flags, fraction, non_negative_int, positive_int, store_arg
from kvrag.config import DEFAULT_MODE
from kvrag.errors import IndexNotFoundError, InputError
from kvrag.fusion import available_modes

HELP = "answer a question from an index"
WARMUP_QUESTION = "What are these passages about?"


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ask", parents=parents, help=HELP, description=HELP + ".")
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("question", metavar="QUESTION", help="the question (quote it)")
    p.add_argument("--model", default=None,
                   help="load the index's model under this name (hub id, folder or .gguf file) instead of the one "
                        "recorded in the index; refused unless it is the same model")
    p.add_argument("--mode", default=None, choices=available_modes(),
                   help=f"how the retrieved chunks' caches are fused (default: {DEFAULT_MODE} under the correctness "
                        "gate); 'full' recomputes everything, the reference")
    p.add_argument("--ratio", type=fraction, default=None,
                   help="fraction of the chunks' tokens recomputed by cacheblend and probe, in (0, 1] (default 0.15)")
    p.add_argument("--gate", choices=("auto", "on", "off", "fuse", "strict"), default="auto",
                   help="the correctness gate: 'auto' (the default, when neither --mode nor --ratio is given) "
                        "answers exactly, the full prefill's answer: it reads the first passage's cache, kept "
                        "prompts and rows stored in place, and recomputes every other token; 'on' runs it with "
                        "--mode or --ratio too; 'fuse' fuses prompts of 512 stale tokens or more at 15 %% (sooner; "
                        "answers close to, not equal to, a full prefill's); 'strict' fuses and answers from the fused "
                        "cache only when a first-token check passes, else with a full prefill; 'off' no gate")
    p.add_argument("--k", type=positive_int, default=4, metavar="N", help="chunks to retrieve (default 4)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="longest answer, in tokens (default 64)")
    p.add_argument("--device", default=None,
                   help="torch device for the model and the embedder, e.g. cpu or cuda (default: cuda if available)")
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.add_argument("--json", action="store_true",
                   help="print the answer, mode, ratio, TTFT and its breakdown, the model-load time (load_model_s) "
                        "and the chunks used as JSON")
    p.add_argument("--warmup", type=non_negative_int, default=0, metavar="N",
                   help="first answer N throwaway questions (not printed) so that the TTFT reported excludes "
                        "warm-up: the first answer in a process also pays for one-time initialisation and "
                        "first-call compilation (default 0: the TTFT includes it)")
    p.add_argument("--ttft-slo", type=_seconds, default=None, metavar="S",
                   help="time-to-first-token target in seconds: load each chunk at the stored level (or recompute "
                        "it from its text) that meets it at the store's measured bandwidth (an index built with "
                        "--stream-levels offers several levels); implies --gate off unless --gate is given")
    p.add_argument("--timings", action="store_true",
                   help="print on stderr where the time went, from the process's start to the whole answer: "
                        "starting, imports, opening the model and index, retrieval (with the embedder's first "
                        "load), reading caches, prefill or fusion, decoding, closing")
    add_store_flags(p, building=False)
    add_embedder_flag(p)
    p.set_defaults(func=run)


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _check(args: argparse.Namespace) -> None:
    """What can be refused before loading anything."""
    if not args.question.strip():
        raise InputError("the question is empty")
    if not Path(args.index).is_dir():
        raise IndexNotFoundError(f"no kvrag index at {args.index}: the folder does not exist")


def _gate(choice: str) -> Any:
    """``--gate`` as `KVRag.answer`'s ``gate`` argument."""
    from kvrag.config import GateConfig

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
    from kvrag.cli.process_clock import seconds_since_start

    started = seconds_since_start()  # Python, kvrag's CLI and the argument parsing, before this line
    _check(args)
    t_import = time.perf_counter()
    from kvrag.rag import KVRag  # torch and the rest load only once the cheap checks passed

    t0 = time.perf_counter()
    rag = KVRag.open(args.index, model=args.model, device=args.device, store=store_arg(args),
                     embedder=args.embedder)
    load_s = time.perf_counter() - t0
    try:
        kwargs: dict[str, Any] = dict(k=args.k, mode=args.mode, ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                                      gate=_gate(args.gate))
        if args.ttft_slo is not None:  # streaming: the fusion's settings in a FuseConfig
            from kvrag.config import FuseConfig

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
        phases = {"start": started, "import": t0 - t_import, "open": load_s,
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
            ("imports (torch, transformers, kvrag)", phases["import"]),
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