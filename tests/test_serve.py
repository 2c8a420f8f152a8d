"""`kvrag serve`: the real OpenAI-compatible server (uvicorn on a free 127.0.0.1 port) over real indexes.

Fast tests run a tiny random model; the OpenAI client, LangChain's ChatOpenAI and the history-reuse
answers run the real SmolLM2. A test that needs the server and cannot start it fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvrag import KVRag, SessionConfig, SplitConfig
from kvrag.cli import main
from kvrag.serve.app import ServeOptions, bind, create_app

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOCS = ["The alpha reactor was designed by Mira Okafor. It runs on molten salt.",
        "Beta station orbits the moon. Its commander is Jonas Reyes.",
        "The gamma telescope in Chile watches for distant comets."]
QUESTION = "Who designed the alpha reactor?"
START_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models gain nothing from threads on a shared 2-core CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_index(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "idx"
    KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(mode="document"), show_progress=False).close()
    return path


@pytest.fixture(scope="module")
def tiny_rag(tiny_index: Path) -> Iterator[KVRag]:
    """One opened tiny index; the servers over it run one at a time."""
    rag = KVRag.open(tiny_index, device="cpu")
    yield rag
    rag.close()


@contextmanager
def serving(rag: KVRag, **options: Any) -> Iterator[str]:
    """The real app under uvicorn in a background thread on a free port; yields its base URL."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(rag, ServeOptions(**options)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the kvrag server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def tiny_url(tiny_rag: KVRag) -> Iterator[str]:
    with serving(tiny_rag, api_key=KEY, model_name="kvrag-tiny", k=2) as url:
        yield url


def chat_body(content: str | list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return {"model": "kvrag-tiny", "messages": messages, "max_tokens": 8, **extra}


def stream_events(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[list[Any], list[float]]:
    """POST a streaming request; the decoded ``data:`` events ("[DONE]" as a string) and their arrival times."""
    events, times = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                times.append(time.perf_counter())
    return events, times


def streamed_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return str(error["message"])


# -- tiny model: endpoints, auth, errors ----------------------------------------------------------------


def test_health_models_and_metrics(tiny_url: str):
    for path in ("/health", "/healthz"):
        health = httpx.get(tiny_url + path)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    models = httpx.get(f"{tiny_url}/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["kvrag-tiny"]
    assert httpx.get(f"{tiny_url}/v1/models/kvrag-tiny", headers=AUTH).json()["id"] == "kvrag-tiny"
    assert_openai_error(httpx.get(f"{tiny_url}/v1/models/gpt-4", headers=AUTH), 404, "model")
    answer = httpx.post(f"{tiny_url}/v1/chat/completions", json=chat_body(QUESTION), headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    metrics = httpx.get(f"{tiny_url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("kvrag_requests_total", "kvrag_ttft_seconds_bucket", "kvrag_prompt_tokens_total",
                 "kvrag_completion_tokens_total", "kvrag_queue_depth", "kvrag_active_requests",
                 "kvrag_history_reused_tokens_total", "kvrag_session_lookups_total", "kvrag_session_tier_hits_total",
                 "kvrag_session_tier_bytes", "kvrag_queue_wait_seconds_count"):
        assert name in metrics.text, name
    assert 'kvrag_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics.text


def test_api_key_guards_v1_only(tiny_url: str):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert_openai_error(httpx.get(f"{tiny_url}/v1/models", headers=headers), 401)
        assert_openai_error(httpx.post(f"{tiny_url}/v1/chat/completions", json=chat_body(QUESTION),
                                       headers=headers), 401)
    assert httpx.get(f"{tiny_url}/health").status_code == 200
    assert httpx.get(f"{tiny_url}/metrics").status_code == 200


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "last message"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role", "not supported"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                   {"role": "user", "content": "c"}]}, "messages[1].role", "only come first"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "must be 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "positive"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "[0, 2]"),
    ({"messages": [{"role": "user", "content": "hi"}], "mode": "nonsense"}, "mode", "probe"),
    ({"messages": [{"role": "user", "content": "hi"}], "ratio": 0}, "ratio", "(0, 1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "text parts"),
    ([1, 2], None, "JSON object"),
])
def test_bad_requests_get_openai_400s(tiny_url: str, body: Any, param: str | None, words: str):
    response = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, headers=AUTH)
    assert words in assert_openai_error(response, 400, param)


def test_invalid_json_is_a_400(tiny_url: str):
    response = httpx.post(f"{tiny_url}/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert "not valid JSON" in assert_openai_error(response, 400)


def test_stream_is_openai_sse_and_matches_the_whole_answer(tiny_url: str):
    body = chat_body(QUESTION, stream_options={"include_usage": True}, retrieve=True, k=1)
    events, _ = stream_events(tiny_url, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "kvrag-tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "length"  # the tiny random model never says EOS this soon
    assert len(finish["kvrag"]["chunks"]) == 1 and finish["kvrag"]["ttft_s"] > 0
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    whole = httpx.post(f"{tiny_url}/v1/chat/completions", json=chat_body(QUESTION, k=1), headers=AUTH,
                       timeout=60).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["choices"][0]["message"]["content"] == streamed_text(chunks).strip()
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + whole["usage"]["completion_tokens"]
    assert whole["kvrag"]["chunks"] == finish["kvrag"]["chunks"]
    plain = httpx.post(f"{tiny_url}/v1/chat/completions", json=chat_body(QUESTION, retrieve=False), headers=AUTH,
                       timeout=60).json()
    assert plain["kvrag"]["chunks"] == [] and plain["usage"]["prompt_tokens"] < whole["usage"]["prompt_tokens"]


def _converse(url: str, i: int, turns: int, out: dict[int, list[Any]]) -> None:
    """One conversation of ``turns`` streamed turns, each sending back the answers so far."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You are assistant number {i}."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Conversation {i}, turn {turn}: {DOCS[turn % 3][:30]}?"})
        events, times = stream_events(url, {**chat_body(messages), "max_tokens": 8 + i})
        text = streamed_text(events[:-1])
        out[i].append((text, events[-2]["kvrag"], times[0], times[-1]))
        messages.append({"role": "assistant", "content": text})


def test_eight_concurrent_conversations_all_progress(tiny_url: str, tiny_rag: KVRag):
    # tiers too small for every conversation: kept KV moves to disk and stays within the bounds
    tiny_rag.configure_sessions(SessionConfig(host_bytes=256 << 10, disk_bytes=4 << 20))
    out: dict[int, list[Any]] = {i: [] for i in range(8)}
    threads = [threading.Thread(target=_converse, args=(tiny_url, i, 2 + i % 2, out)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [len(out[i]) for i in range(8)] == [2 + i % 2 for i in range(8)]  # every turn answered with 200
    for turns in out.values():
        assert turns[0][1]["history"]["reused_tokens"] == 0
        assert all(later[1]["history"]["reused_tokens"] > 0 for later in turns[1:]), [t[:2] for t in turns]
    first_turns = sorted((t[2], t[3]) for t in (turns[0] for turns in out.values()))
    overlapping = sum(a_end > b_start for (_, a_end), (b_start, _) in zip(first_turns, first_turns[1:]))
    assert overlapping >= 1, "concurrent conversations were served one after another"
    batched = [line for line in httpx.get(f"{tiny_url}/metrics", timeout=10).text.splitlines()
               if line.startswith("kvrag_decode_steps_batched ")]
    assert batched and float(batched[0].split()[-1]) > 0  # their token steps shared forward passes
    tiny_rag.sessions.wait()
    tiers = tiny_rag.sessions.stats()["tiers"]
    assert all(t["bytes"] <= t["limit"] for t in tiers.values()), tiers
    assert tiers["disk"]["entries"] > 0, tiers


def test_concurrent_answers_are_the_answers_each_gets_alone_and_the_full_prefills(tiny_url: str):
    questions = [QUESTION, "Who commands beta station?", "Where is the gamma telescope?", "What does alpha run on?"]

    def ask(question: str, **extra: Any) -> str:
        body = chat_body(question, max_tokens=12, temperature=0, history_cache=False, **extra)
        reply = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["message"]["content"])

    alone = [ask(q) for q in questions]
    assert alone == [ask(q, mode="full") for q in questions]  # short prompts: the gate's prefill is full's
    together: list[tuple[int, str]] = []
    threads = [threading.Thread(target=lambda i=i: together.append((i, ask(questions[i]))))
               for i in range(len(questions)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(together) == 2 * len(questions)
    assert all(text == alone[i] for i, text in together), together  # token steps shared between answers


def test_queue_overflow_gives_429(tiny_rag: KVRag):
    statuses: list[int] = []
    bodies: list[dict[str, Any]] = []
    with serving(tiny_rag, max_active=1, max_queue=1) as url:
        barrier = threading.Barrier(6)

        def ask(i: int) -> None:
            barrier.wait()
            r = httpx.post(f"{url}/v1/chat/completions", json={**chat_body(f"{QUESTION} ({i})"), "max_tokens": 64},
                           timeout=120)
            statuses.append(r.status_code)
            bodies.append(r.json())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        metrics = httpx.get(f"{url}/metrics").text
    assert sorted(set(statuses)) == [200, 429] and statuses.count(200) >= 2, statuses
    refusal = next(b for b, s in zip(bodies, statuses) if s == 429)["error"]
    assert refusal["type"] == "rate_limit_error" and refusal["code"] == "rate_limit_exceeded"
    assert 'status="429"' in metrics


def test_a_client_gone_frees_the_worker(tiny_rag: KVRag):
    long = {**chat_body(QUESTION), "max_tokens": 3000}  # a minute of tokens: it must not hold the only slot
    with serving(tiny_rag, max_active=1, max_queue=4) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**long, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk: generation is under way
            next(lines)
        with pytest.raises(httpx.TimeoutException):  # a whole answer the client stops waiting for
            httpx.post(f"{url}/v1/chat/completions", json=long, timeout=1.0)
        deadline = time.monotonic() + 10  # the server notices a disconnect within its poll interval
        while httpx.get(f"{url}/health").json()["active"]:
            assert time.monotonic() < deadline, "a request whose client went away still holds the worker"
            time.sleep(0.05)
        t0 = time.perf_counter()
        after = httpx.post(f"{url}/v1/chat/completions", json=chat_body("What orbits the moon?"), timeout=60)
        assert after.status_code == 200 and time.perf_counter() - t0 < 15
        deadline = time.monotonic() + 10
        while 'status="499"} 2.0' not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the dropped requests were never counted"
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json()["active"] == 0


def test_stop_and_seed_are_honoured(tiny_url: str):
    def text(**options: Any) -> tuple[str, str]:
        reply = httpx.post(f"{tiny_url}/v1/chat/completions", json=chat_body(QUESTION, retrieve=False, **options),
                           headers=AUTH, timeout=60).json()
        return reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"]

    greedy, reason = text()
    assert reason == "length"
    cut, reason = text(stop=greedy[len(greedy) // 2:])
    assert greedy.startswith(cut) and len(cut) < len(greedy) and reason == "stop"
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)


def test_no_history_cache_prefills_every_turn(tiny_rag: KVRag):
    with serving(tiny_rag, history_cache=False) as url:
        first = httpx.post(f"{url}/v1/chat/completions", json=chat_body(QUESTION), timeout=60).json()
        messages = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And what orbits the moon?"}]
        second = httpx.post(f"{url}/v1/chat/completions", json=chat_body(messages, history_cache=True),
                            timeout=60).json()
    history = second["kvrag"]["history"]
    assert history["reused_tokens"] == 0 and history["prefilled_tokens"] > 0 and history["history_cache"] is False


# -- the command -----------------------------------------------------------------------------------------


def test_cli_refuses_in_one_line_before_loading(tmp_path: Path, capsys, monkeypatch):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kvrag[serve]'" in err


def test_cli_serves_until_sigterm(tiny_index: Path, capsys):
    with bind("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    env = {**os.environ, "KVRAG_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "serve", str(tiny_index), "--port", str(port),
                             "--model-name", "cli-model", "--max-tokens", "4", "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the port is bound and the model loaded
        assert line.startswith(f"kvrag: serving {tiny_index} at http://127.0.0.1:{port}/v1"), line
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=60).json()["model"] == "cli-model"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat_body(QUESTION) | {"max_tokens": None},
                            headers=AUTH, timeout=60).json()
        assert answer["model"] == "cli-model" and answer["usage"]["completion_tokens"] == 4
        assert main(["serve", str(tiny_index), "--port", str(port)]) == 2  # the port is taken: one line
        assert capsys.readouterr().err.startswith("kvrag: error: cannot listen on")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the real SmolLM2: OpenAI's client, LangChain's ChatOpenAI, the history cache -------------------------


REAL_QUESTION = "In what year was the album Milk and Honey released?"


@pytest.fixture(scope="module")
def real_url(lennon_rag: KVRag) -> Iterator[str]:
    with serving(lennon_rag, api_key=KEY, model_name="smollm2", k=2) as url:
        yield url




@pytest.mark.slow
def test_openai_client_whole_and_streamed(real_url: str):
    import openai

    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["smollm2"]
    messages: Any = [{"role": "user", "content": REAL_QUESTION}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                           seed=1, extra_body={"k": 1})
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 8
    extra = (whole.model_extra or {})["kvrag"]
    assert len(extra["chunks"]) == 1 and extra["ttft_s"] > 0 and extra["history"]["reused_tokens"] == 0
    pieces = []
    usage = None
    for chunk in client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"k": 1}):
        pieces.extend(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces).strip() == text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{real_url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=messages, n=2)


@pytest.mark.slow
def test_langchain_chat_openai_invoke_and_stream(real_url: str):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{real_url}/v1", api_key=KEY, model="smollm2", max_tokens=8, temperature=0,
                     max_retries=0, extra_body={"k": 1})
    message = llm.invoke(REAL_QUESTION)
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata is not None and 0 < message.usage_metadata["output_tokens"] <= 8
    streamed = "".join(str(chunk.content) for chunk in llm.stream(REAL_QUESTION))
    assert streamed.strip() == message.content


@pytest.mark.slow
def test_second_turn_reuses_history_with_the_same_greedy_answer(real_url: str):
    import openai

    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key=KEY, max_retries=0)
    messages: Any = [{"role": "system", "content": "Answer in a few words."},
                     {"role": "user", "content": REAL_QUESTION}]
    one = {"k": 1}  # the server's default is 2
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, extra_body=one)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Who recorded it?"}]
    cached = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, extra_body=one)
    fresh = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                           extra_body={**one, "history_cache": False})
    reused = (cached.model_extra or {})["kvrag"]["history"]
    assert reused["reused_tokens"] > 0 and reused["tier"] is not None
    assert (fresh.model_extra or {})["kvrag"]["history"]["reused_tokens"] == 0
    assert cached.choices[0].message.content == fresh.choices[0].message.content
    assert cached.usage is not None and fresh.usage is not None
    assert cached.usage.prompt_tokens == fresh.usage.prompt_tokens

