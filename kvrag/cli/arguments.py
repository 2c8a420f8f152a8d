"""The ``kvrag`` command line's grammar: every command's arguments, and the checks made before its module loads.

Contract: `add_commands(sub, parents)` adds ``index``, ``ask``, ``info``, ``verify``, ``repair``, ``serve`` and
``bench NAME`` (each benchmark's options from `kvrag.bench.options`). Each command's parser sets two defaults:
``command``, the module that runs it (``kvrag.cli.ask``, …, ``kvrag.bench.speed``: its ``run(args) -> int``), and
``check``, what can be refused before that module is imported (a missing index, an empty question, the server's
dependencies), or None. Nothing here imports torch, transformers, faiss, sentence-transformers or numpy, so that
``--help``, a usage error and those checks answer at once (tests/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrag.bench.options import BENCHES
from kvrag.cli.common import (
    add_embedder_flag,
    add_size_flag,
    add_store_flags,
    byte_size,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from kvrag.config import DEFAULT_MODE, PREFILL_CHUNK_TOKENS, PREFILL_SLICE_INTERVAL_S, SessionConfig
from kvrag.errors import IndexNotFoundError, InputError
from kvrag.fusion.selectors import available_modes
from kvrag.serve import check_installed

__all__ = ["add_commands", "port_number", "seconds"]


def add_commands(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Every command, under the subparsers ``sub``; ``parents`` carry the flags every command takes."""
    for add in (_add_index, _add_ask, _add_info, _add_verify, _add_repair, _add_serve, _add_bench):
        add(sub, parents)


def _command(sub: Any, parents: list[argparse.ArgumentParser], name: str, help: str, more: str = "",
             check: Callable[[argparse.Namespace], None] | None = None) -> argparse.ArgumentParser:
    """The parser of command ``name``, run by the module ``kvrag.cli.<name>`` after ``check``."""
    parser: argparse.ArgumentParser = sub.add_parser(name, parents=parents, help=help, description=help + more + ".")
    parser.set_defaults(command=f"kvrag.cli.{name}", check=check)
    return parser


def _add_index(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "index", "build an index over files or folders, or add new documents to one",
                 check=_check_index)
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="files or folders to index (folders recursively): .txt .md .rst, .json/.jsonl records "
                        "{title, text}, .html, .pdf, .docx")
    p.add_argument("--index", required=True, metavar="DIR",
                   help="index folder: created if missing; an existing index gets the chunks it lacks")
    p.add_argument("--model", default=None,
                   help="the LLM whose caches are stored: a Hugging Face hub id, a local folder, a .gguf file or "
                        "'smollm2' (default: smollm2 for a new index; an existing index's own model)")
    p.add_argument("--embedder", default=None,
                   help="sentence-transformers model for retrieval (default: all-MiniLM-L6-v2, bundled offline)")
    p.add_argument("--codec", default=None,
                   help="how chunk caches are stored: raw (lossless), int8 or cachegen (smallest, lossy) "
                        "(default: cachegen; an existing index keeps its own)")
    p.add_argument("--codec-level", type=non_negative_int, default=None, metavar="N",
                   help="codec quality level, higher is larger and closer (cachegen: 0-3, default 2)")
    p.add_argument("--codec-state", default="shared", choices=["shared", "index"],
                   help="where a fitted codec state is kept: in the user's cache folder, the index holding a reference "
                        "(shared, the default; $KVRAG_CACHE_DIR moves it), or in the index itself (index: a folder "
                        "that is whole on its own, about 4 MB larger for SmolLM2)")
    p.add_argument("--split", default="semantic", choices=["semantic", "fixed", "document"],
                   help="how documents are cut into chunks: at topic shifts under the token budget (semantic), "
                        "every --max-tokens tokens (fixed), or one chunk per document (document) "
                        "(default: semantic)")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens in a chunk (default 256)")
    p.add_argument("--min-tokens", type=non_negative_int, default=64, metavar="N",
                   help="fewest tokens in a semantic chunk unless its document ends (default 64)")
    p.add_argument("--index-kind", default="flat", choices=["flat", "hnsw"],
                   help="FAISS index: exact search (flat) or approximate and faster on large indexes (hnsw) "
                        "(default: flat)")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, metavar="N",
                   help="tokens prefilled per model call while computing caches (default 4096)")
    p.add_argument("--neighbour-context", type=non_negative_int, default=None, metavar="N",
                   help="compute each chunk's cache after its N nearest chunks (default 0; an index keeps its own)")
    p.add_argument("--neighbour-kv", default=None, choices=["stored", "prefill"],
                   help="with --neighbour-context: place the neighbours' stored caches before a chunk (default for a "
                        "new index; about the cost of a plain build again) or prefill their tokens with it (exact, "
                        "up to N+1 times the cost)")
    p.add_argument("--stream-levels", type=stream_levels, default=(), metavar="L,L",
                   help="also store each chunk's cache at these levels of its codec (e.g. 1,3 for cachegen), so that "
                        "'kvrag ask --ttft-slo' can pick a smaller or finer one per chunk from the measured bandwidth "
                        "(a new index only; default none)")
    p.add_argument("--lazy", action="store_true",
                   help="index the chunks for retrieval only: each chunk's cache is computed the first time a "
                        "question uses it (a later run without --lazy computes the missing ones)")
    p.add_argument("--max-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="bound the chunk caches' bytes (e.g. 5GB; a new index only, recorded): those not read "
                        "again are evicted first and computed again from their text when a question needs them; with "
                        "--lazy, a corpus larger than the disk keeps its hot chunks cached")
    p.add_argument("--instruction", default=None,
                   help="system instruction before the passages (a new index only; default: kvrag.prompt's)")
    p.add_argument("--question-tail", default="",
                   help="a line put right after each question, e.g. how to answer (a new index only; default none)")
    p.add_argument("--dtype", default=None,
                   help="the model's dtype: float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on "
                        "CPU; an existing index: the dtype it was built with)")
    _add_device_flag(p)
    p.add_argument("--engine", default="local", choices=["local", "ray"],
                   help="where the chunks are split, embedded and their caches computed: this process (local) or "
                        "Ray actors, one model each, GPUs where present (ray; needs pip install kvrag[ray])")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="with --engine ray: the Ray cluster, e.g. auto or HOST:6379 (default: start a local one)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="with --engine ray: Ray actors to run (default: one per GPU of the cluster, else one per CPU)")
    add_store_flags(p, building=True)


def _add_ask(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "ask", "answer a question from an index", check=_check_ask)
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("question", metavar="QUESTION", help="the question (quote it)")
    _add_index_model_flag(p)
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
    _add_device_flag(p)
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.add_argument("--json", action="store_true",
                   help="print the answer, mode, ratio, TTFT and its breakdown, the model-load time (load_model_s) "
                        "and the chunks used as JSON")
    p.add_argument("--warmup", type=non_negative_int, default=0, metavar="N",
                   help="first answer N throwaway questions (not printed) so that the TTFT reported excludes "
                        "warm-up: the first answer in a process also pays for one-time initialisation and "
                        "first-call compilation (default 0: the TTFT includes it)")
    p.add_argument("--ttft-slo", type=positive_seconds, default=None, metavar="S",
                   help="time-to-first-token target in seconds: load each chunk at the stored level (or recompute "
                        "it from its text) that meets it at the store's measured bandwidth (an index built with "
                        "--stream-levels offers several levels); implies --gate off unless --gate is given")
    p.add_argument("--timings", action="store_true",
                   help="print on stderr where the time went, from the process's start to the whole answer: "
                        "starting, imports, opening the model and index, retrieval (with the embedder's first "
                        "load), reading caches, prefill or fusion, decoding, closing")
    add_store_flags(p, building=False)
    add_embedder_flag(p)


def _add_info(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "info", "show what an index holds and its size on disk")
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("--json", action="store_true", help="print the same as one JSON object, with the whole manifest")


def _add_verify(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "verify", "check every file of an index (exit status 0 sound, 1 damaged)")
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("--no-caches", action="store_true", help="skip reading every chunk cache (faster)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _add_repair(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "repair", "rebuild the damaged parts of an index from its intact ones")
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("--model", default=None, help="the index's model, if not where the manifest says it is")
    p.add_argument("--device", default=None, help="torch device for the model and the embedder")
    add_embedder_flag(p)


def _add_serve(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = _command(sub, parents, "serve", "serve an index over an OpenAI-compatible HTTP API",
                 " (/v1/chat/completions, /v1/models, /health, /metrics)", check=_check_serve)
    p.add_argument("index", metavar="INDEX", help="index folder, built by 'kvrag index'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("KVRAG_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: $KVRAG_API_KEY; "
                        "none: no authentication)")
    p.add_argument("--no-history-cache", action="store_true",
                   help="prefill every conversation's history from scratch on each turn (the comparison baseline)")
    p.add_argument("--k", type=non_negative_int, default=4, metavar="N",
                   help="chunks retrieved per turn when a request names no 'k' (default 4)")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                   help="answer length limit when a request names no max_tokens (default 256)")
    p.add_argument("--max-active", type=positive_int, default=8, metavar="N",
                   help="conversations generating at once, stepped token by token in turn (default 8)")
    p.add_argument("--max-queue", type=non_negative_int, default=64, metavar="N",
                   help="requests that may wait for a generation slot; more are refused with 429 (default 64)")
    p.add_argument("--max-wait", type=seconds, default=10.0, metavar="SECONDS",
                   help="refuse with 429 and Retry-After a request whose expected wait for its first token, "
                        "estimated from measured service times, exceeds this (e.g. 10 or 10s; 0: no bound; "
                        "default 10)")
    p.add_argument("--max-hold", type=seconds, default=50.0, metavar="SECONDS",
                   help="hold a request refused for its expected wait in the waiting line, in arrival order, for up "
                        "to this long before answering 429, and answer it if admitted meanwhile (0: refuse at once; "
                        "default 50, under the 60 s idle timeout of common proxies)")
    p.add_argument("--prefill-chunk-tokens", type=chunk_tokens, default="auto", metavar="N",
                   help="run a long prefill or fusion in slices of N tokens' work, with the answers already "
                        "streaming given a token between slices (0: whole, their tokens wait for it; default "
                        f"auto: {PREFILL_CHUNK_TOKENS} on the CPU, whole on a GPU)")
    p.add_argument("--slice-interval", type=seconds, default=PREFILL_SLICE_INTERVAL_S, metavar="SECONDS",
                   help="end a slice only once this long has passed since the streaming answers' last tokens: more "
                        "answers a second, longer gaps between tokens (default 0: at every slice's end)")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve at once, without answering one warm-up question first (the first service times "
                        "are then measured on the first requests)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and responses (default: the index's model)")
    _add_index_model_flag(p)
    _add_device_flag(p)
    add_size_flag(p, "--session-host-bytes", "host memory for conversations' kept KV, e.g. 1GiB "
                  f"(default {SessionConfig.host_bytes >> 20} MiB)")
    add_size_flag(p, "--session-disk-bytes", "disk for conversations' kept KV, below host memory, e.g. 8GiB "
                  f"(default {SessionConfig.disk_bytes >> 20} MiB; 0: none)")
    p.add_argument("--session-dir", default=None, metavar="DIR",
                   help="the disk tier's folder; its conversations are found again after a restart (default: a "
                        "temporary folder, removed on exit)")
    add_store_flags(p, building=False)
    add_embedder_flag(p)


def _add_bench(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    help = "benchmarks (ratios against 'full' measured in the same run)"
    bench = sub.add_parser("bench", parents=parents, help=help, description=help + ".")
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, (doc, add_options) in BENCHES.items():
        parser = names.add_parser(name, parents=parents, help=doc, description=doc)
        add_options(parser)
        parser.set_defaults(command=f"kvrag.bench.{name}", check=None)


def _add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="torch device for the model and the embedder, e.g. cpu or cuda (default: cuda if available)")


def _add_index_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="load the index's model under this name (hub id, folder or .gguf file) instead of the one "
                        "recorded in the index; refused unless it is the same model")


def _check_index(args: argparse.Namespace) -> None:
    index = Path(args.index)
    if index.exists() and not index.is_dir():
        raise InputError(f"index path {index} is a file, not a folder; name a new or existing index folder")


def _check_ask(args: argparse.Namespace) -> None:
    if not args.question.strip():
        raise InputError("the question is empty")
    _check_index_folder(args)


def _check_serve(args: argparse.Namespace) -> None:
    _check_index_folder(args)
    check_installed()


def _check_index_folder(args: argparse.Namespace) -> None:
    if not Path(args.index).is_dir():
        raise IndexNotFoundError(f"no kvrag index at {args.index}: the folder does not exist")


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, ``10`` or ``10s``, zero or more."""
    return non_negative_float(text.strip().removesuffix("s"))


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return value


def stream_levels(text: str) -> tuple[int, ...]:
    """An argparse type: ``--stream-levels`` as a tuple of levels (``1,3``)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected levels like 1,3, got {text!r}") from None
    if any(lv < 0 for lv in levels):
        raise argparse.ArgumentTypeError(f"levels must be >= 0, got {text!r}")
    return levels


def chunk_tokens(text: str) -> int | str:
    """An argparse type: ``auto`` or a token count, zero or more."""
    return "auto" if text.strip().lower() == "auto" else non_negative_int(text)
