"""`kvrag serve` with the ground failing underneath: real ``redis-server``, ``kvrag serve`` and ``kvrag index``.

- Redis killed mid-answer, then down, then hung (SIGSTOP), then back: every request gets the answer it got with
  Redis up (computed from the chunks' text), never a 5xx; the caches are stored again and ``kvrag verify`` is clean.
- Redis unreachable (stopped) for 30 s under two clients: every answer as with Redis up, each in bounded time.
- Redis killed mid-build: the build ends with one line or completes; run again after Redis is back, it completes,
  verifies clean and answers as an undisturbed index. Two ``kvrag index`` processes into one Redis at once.
- The conversations' disk tier on a full disk (a 256 KB tmpfs, or a file-size limit where mounting is not allowed)
  and a host tier far too small, under 64 concurrent two-turn clients, some of them hanging up mid-stream:
  200 or 429 only, the write failures counted, no slot left held.
- ``kill -9`` of the server: a restart over the same ``--session-dir`` finds the kept conversations on disk, never
  reads a half-written or damaged entry, and answers as a full prefill would.

Tiny random model, the lossless ``raw`` codec and one chunk per prefill, so a cache computed again from text is
the same bytes. A test that needs Redis and cannot start it fails (`conftest.RedisServer`).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_process import ServeProcess, metric

from kvrag import KVRag, SplitConfig

TOPICS = ["reactor", "station", "river", "forest", "bridge", "harbour", "tower", "canal"]
DOCS = [f"Ada {i} keeps the {t}; it has {i * 5} lamps and {i} crates of salt." for i, t in enumerate(TOPICS)]
QUESTIONS = [f"Who keeps the {t}?" for t in TOPICS[:4]]
EXACT = {"mode": "reuse", "k": 2, "history_cache": False, "temperature": 0, "max_tokens": 12}


def _build_args(store: str | None) -> list[str]:
    return ["--split", "document", "--codec", "raw", "--batch-tokens", "1", *(["--store", store] if store else [])]


def _index(docs_dir: Path, index: Path, model_dir: Path, store: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrag.cli", "index", str(docs_dir), "--index", str(index),
                           "--model", str(model_dir), "--device", "cpu", *_build_args(store)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for i, text in enumerate(DOCS):
        (folder / f"d{i}.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def redis(redis_server):
    server = type(redis_server)().start()  # the module's own: it is killed and hung
    yield server
    server.stop()


def _chat(url: str, question: str | list[dict[str, str]], timeout: float = 60, **extra: Any) -> httpx.Response:
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, **EXACT, **extra},
                      timeout=timeout)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _no_5xx(server: ServeProcess) -> None:
    text = server.metrics()
    assert 'status="5' not in text, [line for line in text.splitlines() if 'status="5' in line]
    assert "Traceback" not in server.output()


def test_redis_killed_mid_answer_down_hung_and_back(redis, docs_dir: Path, tiny_model_dir: Path, tmp_path: Path):
    index = tmp_path / "idx"
    assert _index(docs_dir, index, tiny_model_dir, redis.url()).returncode == 0
    # no wait bound: a hung store slows the first steps, and this test is about answers, not admission
    # and no decoded tier: every answer reads the store, through its faults
    with ServeProcess(index, "--store-cache-bytes", "0", "--decoded-bytes", "0", "--max-active", "4", "--max-wait", "0",
                      "--no-warmup") as server:
        expected = {q: _text(_chat(server.url, q)) for q in QUESTIONS}
        answers: list[tuple[str, httpx.Response]] = []
        askers = [threading.Thread(target=lambda q=q: answers.append((q, _chat(server.url, q)))) for q in QUESTIONS * 2]
        for t in askers:
            t.start()
        time.sleep(0.05)
        redis.stop()  # killed while those are served: its data is gone with it
        for t in askers:
            t.join(120)
        answers += [(q, _chat(server.url, q)) for q in QUESTIONS]  # Redis down
        redis.start()
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)  # hung: connections accepted, nothing answered
        try:
            answers += [(q, _chat(server.url, q)) for q in QUESTIONS[:2]]
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        time.sleep(6)  # past the store's back-off after a failure
        answers += [(q, _chat(server.url, q)) for q in QUESTIONS]  # back: the caches are stored again
        assert len(answers) == 3 * len(QUESTIONS) + 2 + len(QUESTIONS)
        assert all(_text(r) == expected[q] for q, r in answers), [(q, r.status_code) for q, r in answers]
        _no_5xx(server)
    import redis as redis_py

    stored = redis_py.Redis.from_url(redis.url()).dbsize()
    assert stored > 0  # refilled after the restart
    verify = subprocess.run([sys.executable, "-m", "kvrag.cli", "verify", str(index)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


HUNG_S = 30  # how long Redis stays unreachable


def test_redis_unreachable_for_30_seconds(redis, docs_dir: Path, tiny_model_dir: Path, tmp_path: Path):
    if redis.proc is None:
        redis.start()
    index = tmp_path / "idx"
    assert _index(docs_dir, index, tiny_model_dir, redis.url(db=5)).returncode == 0
    # and no decoded tier: every answer reads the store, through its faults
    with ServeProcess(index, "--store-cache-bytes", "0", "--decoded-bytes", "0", "--max-active", "4", "--max-wait", "0",
                      "--no-warmup") as server:
        expected = {q: _text(_chat(server.url, q)) for q in QUESTIONS}
        answers: list[tuple[str, httpx.Response, float]] = []

        def ask_until(deadline: float, offset: int) -> None:
            n = offset
            while time.monotonic() < deadline:
                q = QUESTIONS[n % len(QUESTIONS)]
                sent = time.monotonic()
                answers.append((q, _chat(server.url, q), time.monotonic() - sent))
                n += 1

        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)  # unreachable: connections accepted, nothing answered
        try:
            askers = [threading.Thread(target=ask_until, args=(time.monotonic() + HUNG_S, i)) for i in range(2)]
            for t in askers:
                t.start()
            for t in askers:
                t.join(HUNG_S + 120)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        hung = len(answers)
        time.sleep(6)  # past the store's back-off after a failure
        answers += [(q, _chat(server.url, q), 0.0) for q in QUESTIONS]
        assert hung >= 4  # the server kept answering while Redis was away
        assert all(_text(r) == expected[q] for q, r, _ in answers), [(q, r.status_code) for q, r, _ in answers]
        assert max(took for _, _, took in answers) < 20  # a wait on the store is bounded, not one per chunk
        _no_5xx(server)
    verify = subprocess.run([sys.executable, "-m", "kvrag.cli", "verify", str(index)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_redis_killed_mid_build_then_built_again_and_two_builders_at_once(redis, docs_dir: Path, tiny_model_dir: Path,
                                                                         tiny_lm, tmp_path: Path):
    if redis.proc is None:
        redis.start()
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url(db=3))
    build = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "index", str(docs_dir), "--index",
                              str(tmp_path / "killed"), "--model", str(tiny_model_dir), "--device", "cpu",
                              *_build_args(redis.url(db=3))], stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while client.dbsize() == 0 and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    redis.stop()  # mid-build
    _, err = build.communicate(timeout=300)
    assert build.returncode in (0, 2) and "Traceback" not in err, err  # completed, or stopped with one line
    redis.start()
    again = _index(docs_dir, tmp_path / "killed", tiny_model_dir, redis.url(db=3))
    assert again.returncode == 0, again.stderr
    with KVRag.build(docs_dir, tmp_path / "reference", model=tiny_lm, split=SplitConfig(mode="document"), codec="raw",
                     batch_tokens=1, show_progress=False) as rag:  # undisturbed, on disk
        expected = [rag.answer(q, k=2, mode="reuse", max_new_tokens=6).token_ids for q in QUESTIONS]

    builders = [subprocess.Popen([sys.executable, "-m", "kvrag.cli", "index", str(docs_dir), "--index",
                                  str(tmp_path / name), "--model", str(tiny_model_dir), "--device", "cpu",
                                  *_build_args(redis.url(db=4))], stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}) for name in ("one", "two")]
    for builder in builders:
        _, err = builder.communicate(timeout=300)
        assert builder.returncode == 0, err
    for name in ("killed", "one", "two"):
        verify = subprocess.run([sys.executable, "-m", "kvrag.cli", "verify", str(tmp_path / name)],
                                capture_output=True, text=True)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        with KVRag.open(tmp_path / name, device="cpu") as rag:
            assert rag.kvstore.store.label.startswith("redis://")
            assert [rag.answer(q, k=2, mode="reuse", max_new_tokens=6).token_ids for q in QUESTIONS] == expected


@pytest.fixture
def full_disk(tmp_path: Path):
    """A folder on a 256 KB tmpfs, or (where mounting is not allowed) with every file the server writes limited
    to 64 KB: either way the disk tier's writes fail. Yields the folder and the server's extra ``preexec_fn``.
    """
    folder = tmp_path / "sessions"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    limit = None if mounted else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)))
    yield folder, limit
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)


RETRY_FOR_S = 240  # a client retries a refused turn for this long from its first attempt


def _retry_after(response: httpx.Response) -> float:
    """How long a client waits before retrying a 429: the server's Retry-After, at most 5 s (as clients cap it)."""
    return min(float(response.headers.get("Retry-After", 1)), 5.0)


def _conversation(url: str, i: int, outcome: dict[int, Any]) -> None:
    """Two turns; a refused turn is retried after its Retry-After, as real clients do; every fifth client hangs up
    in the middle of its second answer. ``outcome[i]``: the last status, or the error's name.
    """
    messages = [{"role": "system", "content": f"You are assistant {i}."}, {"role": "user", "content": QUESTIONS[i % 4]}]
    try:
        deadline = time.monotonic() + RETRY_FOR_S
        while (first := _chat(url, messages, timeout=300, history_cache=True, max_tokens=8)).status_code == 429:
            if time.monotonic() > deadline:
                break
            time.sleep(_retry_after(first))
        if first.status_code != 200:
            outcome[i] = first.status_code
            return
        messages += [{"role": "assistant", "content": _text(first)}, {"role": "user", "content": "And then?"}]
        body = {"model": "m", "messages": messages, **EXACT, "history_cache": True, "max_tokens": 40, "stream": True}
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
                outcome[i] = response.status_code
                if response.status_code == 429 and time.monotonic() < deadline:
                    pause = _retry_after(response)
                else:
                    for n, _ in enumerate(response.iter_lines()):
                        if i % 5 == 0 and n == 2:
                            return  # closes the connection mid-stream
                    return
            time.sleep(pause)
    except httpx.HTTPError as exc:
        outcome[i] = type(exc).__name__


def test_full_disk_tier_and_tiny_host_tier_under_64_clients_degrade(redis, docs_dir: Path, tiny_model_dir: Path,
                                                                    tmp_path: Path, full_disk):
    folder, limit = full_disk
    index = tmp_path / "idx"
    assert _index(docs_dir, index, tiny_model_dir, None).returncode == 0
    with ServeProcess(index, "--session-host-bytes", "20KiB", "--session-disk-bytes", "64MiB", "--session-dir",
                      str(folder), "--max-wait", "60", "--no-warmup", preexec=limit) as server:
        outcome: dict[int, Any] = {}
        clients = [threading.Thread(target=_conversation, args=(server.url, i, outcome)) for i in range(64)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(600)
        # refused turns retried after their Retry-After are served in turn: no client is starved
        assert len(outcome) == 64 and set(outcome.values()) == {200}, outcome
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health").json())["active"] or health["queue_depth"]:
            assert time.monotonic() < deadline, f"slots still held after every client left: {health}"
            time.sleep(0.1)
        text = server.metrics()
        assert metric(text, "kvrag_session_disk_write_errors_total") > 0  # the disk was full: entries dropped
        assert metric(text, 'kvrag_session_tier_bytes{tier="host"}') <= metric(
            text, 'kvrag_session_tier_limit_bytes{tier="host"}')
        assert metric(text, 'kvrag_requests_total{endpoint="/v1/chat/completions",status="499"}') >= 1
        _no_5xx(server)


def test_kill_9_then_restart_finds_the_kept_conversations_on_disk(docs_dir: Path, tiny_model_dir: Path,
                                                                  tmp_path: Path):
    index, sessions = tmp_path / "idx", tmp_path / "sessions"
    assert _index(docs_dir, index, tiny_model_dir, None).returncode == 0
    flags = ("--session-host-bytes", "0", "--session-dir", str(sessions), "--no-warmup")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with ServeProcess(index, *flags) as server:
        for messages in conversations:
            messages += [{"role": "assistant", "content": _text(_chat(server.url, messages, history_cache=True))},
                         {"role": "user", "content": "And then?"}]
        deadline = time.monotonic() + 30
        while metric(server.metrics(), 'kvrag_session_tier_entries{tier="disk"}') < len(conversations):
            assert time.monotonic() < deadline, "the conversations never reached the disk tier"
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        server.proc.wait(10)  # type: ignore[union-attr]
    kept = sorted((p for p in sessions.rglob("*.safetensors")), key=lambda p: p.stat().st_mtime)
    assert len(kept) == len(conversations)
    folder = kept[0].parent
    (folder / f".{kept[0].name}.half.tmp").write_bytes(kept[0].read_bytes()[:100])  # a killed writer's leftover
    damaged = kept[-1]
    damaged.write_bytes(damaged.read_bytes()[:200])  # a damaged entry: never trusted, dropped
    with ServeProcess(index, *flags) as server:
        replies = [_chat(server.url, messages, history_cache=True) for messages in conversations]
        fresh = [_chat(server.url, messages, history_cache=False) for messages in conversations]
        reports = [r.json()["kvrag"]["history"] for r in replies]
        assert [_text(r) for r in replies] == [_text(r) for r in fresh]  # as a full prefill of the same messages
        assert sum(r["tier"] == "disk" and r["reused_tokens"] > 0 for r in reports) >= len(conversations) - 1, reports
        assert metric(server.metrics(), "kvrag_session_disk_read_errors_total") == 1
        _no_5xx(server)
