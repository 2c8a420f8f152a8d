"""``POST /v1/chat/completions``: a parsed request through the scheduler, answered whole or as SSE chunks.

Contract: `complete(state, request, chat)` queues the chat as a `Job` and answers it. A request whose expected wait
exceeds ``--max-wait`` and that got a place in the waiting line is held there, in arrival order, for up to
``--max-hold`` seconds (`hold`): it is submitted again every `HOLD_POLL_S` while first in line, every
`HOLD_POLL_LATER_S` behind, and answered once admitted, with the seconds it was held in the ``X-Kvrag-Held``
header. Past that, a full queue, or no place: 429 in OpenAI's error shape, with ``Retry-After``. A standard OpenAI
client retries a 429 twice and then fails; held, it waits as it would for llama.cpp's server, which queues.
Events cross from the worker thread to the event loop through an
`asyncio.Queue` fed with ``loop.call_soon_threadsafe``. A streaming request's response starts only once
its first event arrives, so a request kvrag refuses (an `InputError`: 400) or that fails (500) gets a
plain error response. After that, text pieces go out as ``chat.completion.chunk`` events (a first one
with the role; the pieces join to exactly `Answer.text`, the non-streamed content: `StrippedText`), a
last chunk with ``finish_reason`` and the ``kvrag`` extra field, a usage-only chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``; a failure mid-stream sends an error
event, then ``[DONE]``. A non-streaming request gets one ``chat.completion`` with ``usage`` and the
``kvrag`` field. A client that goes away (a closed stream, or a disconnect noticed while waiting)
cancels its job, whose generator the worker then closes; it is counted with status 499.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvrag.errors import KVRagError
from kvrag.serve.line import request_ticket
from kvrag.serve.openai_schema import (
    ChatRequest,
    RequestError,
    chunk_body,
    completion_body,
    new_completion_id,
    usage_body,
)
from kvrag.serve.scheduler import Done, Event, Failed, Job, Piece, QueueFull, ServerStopping, WaitTooLong

if TYPE_CHECKING:
    from kvrag.serve.app import ServerState

ENDPOINT = "/v1/chat/completions"
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
HOLD_POLL_S = 0.2  # how often the first request in the waiting line asks to be admitted again
HOLD_POLL_LATER_S = 1.0  # the same for the places behind it
HELD_HEADER = "X-Kvrag-Held"
CLIENT_GONE = 499


def kvrag_extra(answer: Any, queue_s: float) -> dict[str, Any]:
    """The ``kvrag`` response field: the fused chunks, the mode, TTFT and timings, the history report."""
    if answer is None:
        return {"chunks": [], "queue_s": queue_s}
    history = getattr(answer, "history", None)
    gate = getattr(answer, "gate", None)
    return {
        "chunks": [{"key": c.key, "doc_id": c.doc_id, "source": c.source, "score": c.score} for c in answer.chunks],
        "mode": answer.mode, "ratio": answer.ratio, "ttft_s": answer.ttft_s, "queue_s": queue_s,
        "prompt_tokens": answer.n_prompt_tokens, "timings": dict(answer.timings),
        "history": history.to_json() if history is not None else None,
        "gate": gate.to_json() if gate is not None else None,
    }


def _usage(answer: Any) -> dict[str, int]:
    if answer is None:
        return usage_body(0, 0)
    return usage_body(int(answer.n_prompt_tokens), len(answer.token_ids))


def failure(error: BaseException) -> RequestError:
    """A worker's failure as an HTTP error: kvrag's refusals of the request are 400s, anything else 500."""
    if isinstance(error, ServerStopping):
        return RequestError(str(error), status=503, kind="server_error", code="server_stopping")
    if isinstance(error, (KVRagError, ValueError)):
        return RequestError(str(error).splitlines()[0] if str(error) else type(error).__name__)
    return RequestError(f"internal error: {type(error).__name__}: {error}", status=500, kind="server_error")


class StrippedText:
    """Streamed pieces re-cut so that they join to ``"".join(pieces).strip()``, which is `Answer.text`.

    Whitespace that opens the answer is dropped and whitespace is held back until more text follows it,
    so a streaming client that sends the joined pieces back as the assistant message sends exactly the
    text whose KV the session cache kept (and the same text a non-streaming request returns).
    """

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, piece: str) -> str:
        """The text to send now for ``piece`` (possibly empty)."""
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        body = piece.rstrip()
        if not body:
            self.held += piece
            return ""
        out, self.held = self.held + body, piece[len(body):]
        return out


class Exchange:
    """One request's side of a job: the event queue the worker feeds, and the client to watch."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self._checked = self.loop.time()  # when the client was last seen connected
        self._get: asyncio.Future[Event] | None = None  # a pending events.get(), kept across checks

    def emit(self, event: Event) -> None:
        """Called on the worker thread: hand ``event`` to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    async def next_event(self) -> Event | None:
        """The job's next event, or None once the client has disconnected (checked every
        `DISCONNECT_POLL_S`, also while events keep coming).
        """
        while True:
            wait = DISCONNECT_POLL_S - (self.loop.time() - self._checked)
            if wait <= 0:
                self._checked = self.loop.time()
                if await self.request.is_disconnected():
                    self.close()
                    return None
                continue
            if self._get is None:
                self._get = asyncio.ensure_future(self.events.get())
            done, _ = await asyncio.wait({self._get}, timeout=wait)
            if done:
                got, self._get = self._get, None
                return got.result()

    def close(self) -> None:
        """Stop waiting for events."""
        if self._get is not None:
            self._get.cancel()
            self._get = None


async def complete(state: ServerState, request: Request, chat: ChatRequest) -> Response:
    """Queue ``chat`` and answer it, whole or streamed."""
    exchange = Exchange(request)
    kwargs = chat.chat_kwargs()
    job = Job(chat.messages, kwargs, exchange.emit, ticket=request_ticket(chat.messages, kwargs))
    try:
        held = await hold(state, request, job)
    except QueueFull as exc:
        retry = math.ceil(exc.retry_after)
        state.metrics.count_refusal("wait" if isinstance(exc, WaitTooLong) else "queue")
        raise RequestError(f"the server is busy: {exc}; retry after {retry} s", status=429, kind="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)}) from None
    except ServerStopping as exc:
        raise failure(exc) from None
    if held is None:  # the client went away while held
        state.metrics.count_request(ENDPOINT, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    headers = {HELD_HEADER: f"{held:.3f}"}
    if chat.stream:
        return await _stream(state, exchange, job, chat, headers)
    return await _whole(state, exchange, job, chat, headers)


async def hold(state: ServerState, request: Request, job: Job) -> float | None:
    """Submit ``job``, holding it in the waiting line while it is refused for its wait and has a place there, for up
    to ``max_hold_s``; the seconds it was held, or None when its client went away meanwhile (its place freed).
    Raises what the last submission raised once the hold is over (`QueueFull`, `WaitTooLong`, `ServerStopping`).
    """
    loop = asyncio.get_running_loop()
    started: float | None = None  # when it was first refused
    while True:
        try:
            state.scheduler.submit(job)
        except WaitTooLong as exc:
            started = loop.time() if started is None else started
            poll = HOLD_POLL_S if exc.place == 1 else HOLD_POLL_LATER_S
            if exc.place is None or loop.time() + poll - started > state.options.max_hold_s:
                raise
            await asyncio.sleep(poll)
            if await request.is_disconnected():
                state.scheduler.leave_line(job.ticket)
                return None
            continue
        if started is None:
            return 0.0
        held = loop.time() - started
        state.metrics.count_hold(held)
        return held


async def _whole(state: ServerState, exchange: Exchange, job: Job, chat: ChatRequest,
                 headers: dict[str, str]) -> Response:
    finished = False
    try:
        while True:
            event = await exchange.next_event()
            if event is None:
                state.metrics.count_request(ENDPOINT, CLIENT_GONE)
                return Response(status_code=CLIENT_GONE)
            if isinstance(event, Failed):
                finished = True
                raise failure(event.error)
            if isinstance(event, Done):
                finished = True
                state.metrics.observe_answer(event.answer, event.queue_s)
                text = event.answer.text if event.answer is not None else ""
                body = completion_body(new_completion_id(), state.model_name, text,
                                       event.finish_reason, _usage(event.answer),
                                       kvrag_extra(event.answer, event.queue_s))
                state.metrics.count_request(ENDPOINT, 200)
                return JSONResponse(body, headers=headers)
    finally:
        exchange.close()
        if not finished:
            job.cancel()


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def _stream(state: ServerState, exchange: Exchange, job: Job, chat: ChatRequest,
                  headers: dict[str, str]) -> Response:
    first = await exchange.next_event()
    if first is None:
        job.cancel()
        state.metrics.count_request(ENDPOINT, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    if isinstance(first, Failed):
        raise failure(first.error)
    return StreamingResponse(_chunks(state, exchange, job, chat, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def _chunks(state: ServerState, exchange: Exchange, job: Job, chat: ChatRequest,
                  first: Event) -> AsyncIterator[bytes]:
    cid, created, model = new_completion_id(), int(time.time()), state.model_name
    status = CLIENT_GONE
    text = StrippedText()
    try:
        yield _sse(chunk_body(cid, model, created, {"role": "assistant", "content": ""}))
        event: Event | None = first
        last_piece: float | None = None
        while event is not None:
            if isinstance(event, Piece):
                now = time.perf_counter()
                if last_piece is not None:
                    state.metrics.observe_inter_token(now - last_piece)
                last_piece = now
                if content := text.push(event.text):
                    yield _sse(chunk_body(cid, model, created, {"content": content}))
            elif isinstance(event, Failed):
                status = failure(event.error).status
                yield _sse(failure(event.error).body())
                yield b"data: [DONE]\n\n"
                return
            else:
                assert isinstance(event, Done)
                state.metrics.observe_answer(event.answer, event.queue_s)
                yield _sse(chunk_body(cid, model, created, {}, event.finish_reason,
                                      extra=kvrag_extra(event.answer, event.queue_s)))
                if chat.include_usage:
                    yield _sse(chunk_body(cid, model, created, usage=_usage(event.answer)))
                yield b"data: [DONE]\n\n"
                status = 200
                return
            event = await exchange.events.get()  # a closed connection cancels this await
    finally:
        if status == CLIENT_GONE:
            job.cancel()
        state.metrics.count_request(ENDPOINT, status)

