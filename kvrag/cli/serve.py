"""``kvrag serve INDEX``: serve an index over an OpenAI-compatible HTTP API (`kvrag.serve`).

Contract: a missing index folder, or FastAPI/uvicorn/prometheus-client not installed (one line naming
``pip install 'kvrag[serve]'``), fails before any model loads; so does a port already in use, in one
line, before anything is served. The model is the index's (``--model`` as in ``kvrag ask``). Prints
one line on stderr once the port is bound, then serves until SIGTERM (exit status 0) or Ctrl-C (130,
as every command); either way the server stops gracefully and the index is closed. ``--api-key``
(default: the ``KVRAG_API_KEY`` environment variable) guards the ``/v1`` routes. ``--max-wait`` bounds a
request's expected wait for its first token (429 with ``Retry-After`` beyond it); the ``--session-*`` flags
bound the conversations' tiers (``--session-dir`` keeps the disk tier across restarts); ``--store`` and
``--embedder`` are as in ``kvrag ask``. ``-v`` shows uvicorn's access log.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrag.cli.common import (
    add_embedder_flag,
    add_size_flag,
    add_store_flags,
    non_negative_float,
    non_negative_int,
    positive_int,
    store_arg,
)
from kvrag.config import PREFILL_CHUNK_TOKENS, PREFILL_SLICE_INTERVAL_S, SessionConfig
from kvrag.errors import IndexNotFoundError

HELP = "serve an index over an OpenAI-compatible HTTP API"


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, ``10`` or ``10s``, zero or more."""
    return non_negative_float(text.strip().removesuffix("s"))


def _chunk_tokens(text: str) -> int | str:
    """An argparse type: ``auto`` or a token count, zero or more."""
    return "auto" if text.strip().lower() == "auto" else non_negative_int(text)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=parents, help=HELP, description=HELP + " (/v1/chat/completions, "
                       "/v1/models, /health, /metrics).")
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
    p.add_argument("--prefill-chunk-tokens", type=_chunk_tokens, default="auto", metavar="N",
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
    p.add_argument("--model", default=None,
                   help="load the index's model under this name (hub id, folder or .gguf file); refused unless "
                        "it is the same model")
    p.add_argument("--device", default=None,
                   help="torch device for the model and the embedder, e.g. cpu or cuda (default: cuda if available)")
    add_size_flag(p, "--session-host-bytes", "host memory for conversations' kept KV, e.g. 1GiB "
                  f"(default {SessionConfig.host_bytes >> 20} MiB)")
    add_size_flag(p, "--session-disk-bytes", "disk for conversations' kept KV, below host memory, e.g. 8GiB "
                  f"(default {SessionConfig.disk_bytes >> 20} MiB; 0: none)")
    p.add_argument("--session-dir", default=None, metavar="DIR",
                   help="the disk tier's folder; its conversations are found again after a restart (default: a "
                        "temporary folder, removed on exit)")
    add_store_flags(p, building=False)
    add_embedder_flag(p)
    p.set_defaults(func=run)


class _Terminated(Exception):
    """SIGTERM arrived: stop serving and exit normally."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _ready(args: argparse.Namespace, api_key: str | None) -> Callable[[str], None]:
    def announce(url: str) -> None:
        auth = "API key required" if api_key else "no API key"
        print(f"kvrag: serving {args.index} at {url}/v1 ({auth}; Ctrl-C to stop)", file=sys.stderr, flush=True)

    return announce


def session_config(args: argparse.Namespace) -> SessionConfig | None:
    """The conversations' tiers the flags ask for (None: the defaults)."""
    if args.session_host_bytes is None and args.session_disk_bytes is None and args.session_dir is None:
        return None
    default = SessionConfig()
    host, disk = args.session_host_bytes, args.session_disk_bytes
    return SessionConfig(host_bytes=default.host_bytes if host is None else host,
                         disk_bytes=default.disk_bytes if disk is None else disk, disk_dir=args.session_dir)


def run(args: argparse.Namespace) -> int:
    from kvrag.serve import check_installed

    if not Path(args.index).is_dir():
        raise IndexNotFoundError(f"no kvrag index at {args.index}: the folder does not exist")
    check_installed()
    from kvrag.serve.app import ServeOptions, bind, run_server

    options = ServeOptions(model_name=args.model_name, api_key=args.api_key or None,
                           history_cache=not args.no_history_cache, k=args.k, max_tokens=args.max_tokens,
                           max_active=args.max_active, max_queue=args.max_queue,
                           max_wait=args.max_wait or None, prefill_chunk_tokens=args.prefill_chunk_tokens,
                           slice_interval_s=args.slice_interval,
                           warmup=not args.no_warmup)
    sock = bind(args.host, args.port)  # a taken port fails here, before the model loads
    try:
        from kvrag.rag import KVRag  # torch and the rest load only now

        rag = KVRag.open(args.index, model=args.model, device=args.device, embedder=args.embedder,
                         store=store_arg(args))
        if sessions := session_config(args):
            rag.configure_sessions(sessions)
    except BaseException:
        sock.close()
        raise
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        run_server(rag, options, args.host, args.port, log_level="info" if args.verbose else "warning",
                   on_ready=_ready(args, options.api_key), sock=sock)
    except _Terminated:  # uvicorn shut down gracefully, then passed SIGTERM on to the handler above
        pass
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        rag.close()
    return 0
