"""The FastAPI application: OpenAI-compatible routes over an opened `KVRag`, and running it under uvicorn.

Contract: `create_app(rag, options)` builds the app; its lifespan answers one warm-up question (unless
``options.warmup`` is off), then starts the `Scheduler`'s worker thread (the only thread that touches ``rag``
from then on) and stops it on shutdown. It never closes ``rag``: the
caller owns it. Routes:

- ``POST /v1/chat/completions`` (`kvrag.serve.completions`);
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model, named ``options.model_name`` or
  after the index's model;
- ``GET /health`` (also ``/healthz``): ``{"status": "ok", ...}`` with the queue depth, the active requests and
  the places held in the waiting line (`kvrag.serve.line`), 503 once the worker has stopped;
- ``GET /metrics``: Prometheus text format (`kvrag.serve.metrics`).

With ``options.api_key`` set, every ``/v1`` route answers 401 in OpenAI's error shape unless the request
carries ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open. Every refusal is
OpenAI's ``{"error": {...}}`` object. `run_server` serves the app with uvicorn until interrupted.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrag.serve import INSTALL_HINT

try:
    import uvicorn
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, Response
except ImportError as exc:  # pragma: no cover - exercised by monkeypatching the import
    raise ImportError(INSTALL_HINT) from exc

from kvrag.config import PREFILL_SLICE_INTERVAL_S, prefill_chunk_tokens
from kvrag.fusion.selectors.base import available_modes
from kvrag.serve.completions import complete
from kvrag.serve.metrics import ServeMetrics
from kvrag.serve.openai_schema import RequestDefaults, RequestError, parse_chat_request
from kvrag.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from kvrag.rag import KVRag

WARMUP_QUESTION = "What are these passages about?"


@dataclass(frozen=True)
class ServeOptions:
    """How the server serves an index.

    Attributes:
        model_name: the model's name in ``/v1/models`` and in responses (None: the index's model).
        api_key: the bearer token every ``/v1`` request must carry (None: no authentication).
        history_cache: False prefills each conversation's history from scratch on every turn.
        k: chunks retrieved per turn when a request names no ``k``.
        max_tokens: the answer's length limit when a request names no ``max_tokens``.
        max_active: conversations generating at once, stepped in turn.
        max_queue: requests that may wait for a slot; more get 429.
        max_wait: seconds; a request whose expected wait for its first token (from measured service times)
            exceeds it gets 429 with ``Retry-After`` (None: only ``max_queue`` bounds the wait).
        max_hold_s: seconds a request refused for its wait, with a place in the waiting line, is held there before
            it gets its 429 (0: refused at once); admitted meanwhile, it is answered.
        prefill_chunk_tokens: the tokens' worth of a fusion or prefill run between two rounds of the answers already
            streaming (None or 0: a first step runs whole, and their tokens wait for it; ``"auto"``:
            `kvrag.config.prefill_chunk_tokens`).
        slice_interval_s: a slice ends only once this many seconds passed since the streaming answers' last round.
        warmup: answer one question before serving, loading what loads on first use and measuring the first
            service times.
    """

    model_name: str | None = None
    api_key: str | None = None
    history_cache: bool = True
    k: int = 4
    max_tokens: int = 256
    max_active: int = 8
    max_queue: int = 64
    max_wait: float | None = 10.0
    max_hold_s: float = 50.0
    prefill_chunk_tokens: int | str | None = "auto"
    slice_interval_s: float = PREFILL_SLICE_INTERVAL_S
    warmup: bool = True


def default_model_name(rag: KVRag) -> str:
    """The index's model as a short name: its hub id or alias, or a local model folder's or file's name."""
    source = str(rag.lm.source or rag.manifest["model"]["source"])
    return Path(source).name if ("/" in source and Path(source).exists()) else source


class ServerState:
    """What the routes share: the options, the scheduler that owns ``rag``, the metrics."""

    def __init__(self, rag: KVRag, options: ServeOptions) -> None:
        self.options = options
        self.model_name = options.model_name or default_model_name(rag)
        self.created = int(time.time())
        self.defaults = RequestDefaults(k=options.k, max_tokens=options.max_tokens,
                                        history_cache=options.history_cache, modes=available_modes())
        device = rag.lm.device.type
        self.scheduler = Scheduler(rag, options.max_active, options.max_queue, options.max_wait,
                                   prefill_chunk_tokens(options.prefill_chunk_tokens, device), options.slice_interval_s)
        sessions = rag.sessions  # created here, before the worker starts
        self.metrics = ServeMetrics(self.scheduler.queue_depth, self.scheduler.active_count, sessions.stats,
                                    self.scheduler.expected_wait, rag.kvstore.stats, self.scheduler.batched_steps)

    def check_key(self, request: Request) -> None:
        """Raise a 401 `RequestError` unless the request carries the API key (when one is set)."""
        key = self.options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError("missing or incorrect API key: send 'Authorization: Bearer <key>'", status=401,
                               code="invalid_api_key")

    def model_card(self) -> dict[str, Any]:
        """The model's entry in ``/v1/models``."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvrag"}


def _v1_routes(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(state.check_key)])

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None
        return await complete(state, request, parse_chat_request(body, state.defaults))

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [state.model_card()]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise RequestError(f"the model {model_id!r} does not exist; this server has {state.model_name!r}",
                               param="model", status=404, code="model_not_found")
        return state.model_card()

    return router


def create_app(rag: KVRag, options: ServeOptions | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app over the opened index ``rag`` (see the module docstring)."""
    state = ServerState(rag, options or ServeOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.options.warmup:  # before the worker starts: this thread is then the only one touching rag
            await asyncio.to_thread(state.scheduler.warm_up, WARMUP_QUESTION, max(state.options.k, 1))
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

    app = FastAPI(title="kvrag", summary=f"OpenAI-compatible RAG over {state.model_name}", lifespan=lifespan)
    app.state.kvrag = state

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        state.metrics.count_request(request.url.path if request.url.path.startswith("/v1/") else "other",
                                    exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app.include_router(_v1_routes(state))

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> JSONResponse:
        alive = state.scheduler.alive
        body = {"status": "ok" if alive else "unavailable", "model": state.model_name,
                "queue_depth": state.scheduler.queue_depth(), "active": state.scheduler.active_count(),
                "waiting_line": state.scheduler.line_length()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); `OSError` when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_server(rag: KVRag, options: ServeOptions, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning", on_ready: Callable[[str], None] | None = None,
               sock: socket.socket | None = None) -> None:
    """Serve ``rag`` over HTTP at ``host:port`` (or on the listening socket ``sock``, from `bind`, which
    is closed after) with uvicorn until interrupted.

    The address is bound first (a taken port raises `OSError` before anything is served); ``on_ready``
    then gets the server's base URL (e.g. ``http://127.0.0.1:8000``). Ctrl-C stops the server gracefully
    and is then raised again as `KeyboardInterrupt` (uvicorn's behaviour).
    """
    sock = sock or bind(host, port)
    try:
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        config = uvicorn.Config(create_app(rag, options), log_level=log_level, timeout_graceful_shutdown=10)
        server = uvicorn.Server(config)
        if on_ready is not None:
            on_ready(f"http://{shown}:{bound}")
        server.run(sockets=[sock])
    finally:
        sock.close()
