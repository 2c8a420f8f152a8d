"""The load generator: N concurrent clients, each running multi-turn RAG conversations over the ``openai`` client.

Contract: `run_level(target, conversations, clients, duration_s)` starts ``clients`` asyncio tasks; each runs
conversations (turns of `Turn`) until ``duration_s`` has passed, streaming every answer, and never retries through
the client (``max_retries=0``): a 429 is counted, and the client waits its ``Retry-After`` (at most 5 s) and asks
the same turn again, as a user waiting for an answer would, also after ``duration_s``, until `GIVE_UP_S` after its
first attempt. It returns a `LevelResult`: per answered turn its TTFT from the attempt that was answered (from its
admission: less the seconds kvrag held it in its waiting line, its ``X-Kvrag-Held`` header) and from the turn's
first attempt, how long it was held, the gaps between its content chunks and its completion tokens; per turn given
up, how long it had waited; the counts of 429s, 5xx and other errors and the wall time until the last turn ended.
A `Target` says how to phrase a turn for one server: kvrag retrieves its passages itself (``k`` in the body), a plain
OpenAI server gets the same passages in the user message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 600.0
MAX_RETRY_WAIT_S = 5.0
GIVE_UP_S = 300.0  # a turn refused this long after its first attempt is given up (and counted)
SYSTEM = "Answer the question from the passages in a few words."
HELD_HEADER = "x-kvrag-held"  # seconds kvrag held the attempt in its waiting line before admitting it


@dataclass(frozen=True)
class Turn:
    """One user turn: the question and the passages a retriever picked for it (kvrag picks its own)."""

    question: str
    passages: tuple[str, ...]


@dataclass(frozen=True)
class Target:
    """A server to load: its base URL, model name, and how a turn's user message and body are phrased."""

    name: str
    base_url: str
    model: str
    user_message: Callable[[Turn], str]
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class LevelResult:
    """What one load level measured."""

    clients: int
    ttft_s: list[float] = field(default_factory=list)  # from the attempt that was answered, once admitted
    held_s: list[float] = field(default_factory=list)  # answered attempts held in kvrag's waiting line: how long
    ttft_first_attempt_s: list[float] = field(default_factory=list)  # from the turn's first attempt
    given_up_s: list[float] = field(default_factory=list)  # turns never answered: how long they were retried
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    answers: int = 0
    empty_answers: int = 0  # answered turns with no text at all
    refused_429: int = 0
    server_5xx: int = 0
    other_errors: int = 0
    wall_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)


async def _turn(client: Any, target: Target, messages: list[dict[str, str]], result: LevelResult,
                asked: float) -> str | None:
    """Stream one answer; its text, or None when it was refused or failed (counted in ``result``). ``asked``: when
    the turn's first attempt was sent.
    """
    import openai

    sent = time.perf_counter()
    first: float | None = None
    last: float | None = None
    pieces: list[str] = []
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=target.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=target.extra_body or None)
        held = float(stream.response.headers.get(HELD_HEADER, "0") or 0)  # kvrag's hold before admission
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            content = "".join(c.delta.content or "" for c in chunk.choices)
            if content:
                now = time.perf_counter()
                if first is None:
                    first = now
                elif last is not None:
                    result.gaps_s.append(now - last)
                last = now
                pieces.append(content)
    except openai.RateLimitError as exc:
        result.refused_429 += 1
        retry = float(exc.response.headers.get("retry-after", "1") or 1)
        await asyncio.sleep(min(retry, MAX_RETRY_WAIT_S))
        return None
    except openai.APIStatusError as exc:
        if exc.status_code >= 500:
            result.server_5xx += 1
        else:
            result.other_errors += 1
        _sample(result, f"{exc.status_code}: {str(exc)[:200]}")
        return None
    except Exception as exc:  # timeouts, dropped connections
        result.other_errors += 1
        _sample(result, f"{type(exc).__name__}: {str(exc)[:200]}")
        return None
    result.answers += 1
    result.empty_answers += not pieces
    result.tokens += tokens or len(pieces)
    result.ttft_s.append((first or time.perf_counter()) - sent - held)
    if held > 0:
        result.held_s.append(held)
    result.ttft_first_attempt_s.append((first or time.perf_counter()) - asked)
    return "".join(pieces).strip()


def _sample(result: LevelResult, text: str) -> None:
    if len(result.error_samples) < 5:
        result.error_samples.append(text)


async def _client(index: int, target: Target, conversations: list[list[Turn]], deadline: float,
                  result: LevelResult) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=target.base_url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    n = index
    try:
        while time.perf_counter() < deadline:
            conversation = conversations[n % len(conversations)]
            n += 7  # clients walk the conversations on different strides, so passages repeat across clients
            messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
            for turn in conversation:
                if time.perf_counter() >= deadline:
                    break
                answer, asked = None, time.perf_counter()
                while answer is None and time.perf_counter() - asked < GIVE_UP_S:
                    answer = await _turn(client, target, [*messages, {"role": "user",
                                                                     "content": target.user_message(turn)}], result,
                                         asked)
                if answer is None:
                    result.given_up_s.append(time.perf_counter() - asked)
                    break
                messages += [{"role": "user", "content": turn.question}, {"role": "assistant", "content": answer}]
    finally:
        await client.close()


async def run_level(target: Target, conversations: list[list[Turn]], clients: int, duration_s: float) -> LevelResult:
    """Load ``target`` with ``clients`` concurrent clients for ``duration_s`` (turns under way then finish)."""
    result = LevelResult(clients)
    start = time.perf_counter()
    await asyncio.gather(*(_client(i, target, conversations, start + duration_s, result) for i in range(clients)))
    result.wall_s = time.perf_counter() - start
    return result
