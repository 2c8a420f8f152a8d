"""``kvrag serve INDEX``: serve an index over an OpenAI-compatible HTTP API (`kvrag.serve`).

Contract: a missing index folder, or FastAPI/uvicorn/prometheus-client not installed (one line naming
``pip install 'kvrag[serve]'``), fails before any model loads; so does a port already in use, in one
line, before anything is served. The model is the index's (``--model`` as in ``kvrag ask``). Prints
one line on stderr once the port is bound, then serves until SIGTERM (exit status 0) or Ctrl-C (130,
as every command); either way the server stops gracefully and the index is closed. ``--api-key``
(default: the ``KVRAG_API_KEY`` environment variable) guards the ``/v1`` routes. ``--max-wait`` bounds a
request's expected wait for its first token: beyond it a request is held in the waiting line, in arrival order,
for up to ``--max-hold`` seconds, then refused (429 with ``Retry-After``); the ``--session-*`` flags
bound the conversations' tiers (``--session-dir`` keeps the disk tier across restarts); ``--store`` and
``--embedder`` are as in ``kvrag ask``. ``-v`` shows uvicorn's access log.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable

from kvrag.cli.common import store_arg
from kvrag.config import SessionConfig
from kvrag.rag import KVRag
from kvrag.serve.app import ServeOptions, bind, run_server


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
    """Serve ``args.index`` (its folder and the server's dependencies checked: `kvrag.cli.arguments`)."""
    options = ServeOptions(model_name=args.model_name, api_key=args.api_key or None,
                           history_cache=not args.no_history_cache, k=args.k, max_tokens=args.max_tokens,
                           max_active=args.max_active, max_queue=args.max_queue,
                           max_wait=args.max_wait or None, max_hold_s=args.max_hold,
                           prefill_chunk_tokens=args.prefill_chunk_tokens,
                           slice_interval_s=args.slice_interval,
                           warmup=not args.no_warmup)
    sock = bind(args.host, args.port)  # a taken port fails here, before the model loads
    try:
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
