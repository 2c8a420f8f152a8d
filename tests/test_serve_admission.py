"""Admission by expected wait in `kvrag serve`: the estimate from measured service times, requests over the bound
held in the waiting line and answered once admitted, 429 with Retry-After in OpenAI's error shape once the hold runs
out, and a client's own timeout freeing its queued or held place. Real ``kvrag serve`` processes over a
tiny random model, the ``openai`` client and httpx.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from _serve_process import ServeProcess, metric

from kvrag import KVRag, SplitConfig
from kvrag.serve.admission import ADMIT_HEADROOM, WAIT_SCALE_RANGE, Pending, ServiceTimes, expected_wait
from kvrag.serve.scheduler import Done, Failed, Job, Scheduler, WaitTooLong

DOCS = ["The alpha reactor was designed by Mira Okafor. It runs on molten salt.",
        "Beta station orbits the moon. Its commander is Jonas Reyes."]
LONG = {"model": "m", "messages": [{"role": "user", "content": "Who designed the alpha reactor?"}],
        "max_tokens": 3000}


@pytest.fixture(scope="module")
def index(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("admission") / "idx"
    KVRag.build(DOCS, path, model=str(tiny_model_dir), split=SplitConfig(mode="document"), show_progress=False).close()
    return path


def _post_quietly(url: str, body: dict) -> None:
    """A long answer that holds the server's slot; it ends when the server is stopped."""
    try:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    except httpx.HTTPError:
        pass


def _measured() -> ServiceTimes:
    times = ServiceTimes()
    times.observe_first(0.5)
    times.observe_step(0.05)
    return times


def test_the_expected_wait_grows_with_the_work_ahead():
    assert expected_wait(ServiceTimes(), [], [], 4) is None  # nothing measured: no estimate
    times = _measured()
    idle = expected_wait(times, [], [], 4)
    assert idle == times.first_high  # a free slot: only its own first step
    times.observe_first(1.5)  # first steps vary: the estimate counts a slow one
    assert times.first_high > times.first_s and expected_wait(times, [], [], 4) == times.first_high
    busy = [Pending(20, True)] * 4
    full = expected_wait(times, busy, [], 4)
    queued = expected_wait(times, busy, [Pending(20, False)] * 4, 4)
    longer = expected_wait(times, [Pending(200, True)] * 4, [], 4)
    assert idle is not None and full is not None and queued is not None and longer is not None
    assert idle < full < queued and full < longer
    assert expected_wait(times, busy[:3], [], 4) < full  # a slot free beside three busy ones: no waiting for one
    # beside jobs that have just begun, its first step waits for theirs (seconds each), not for a token each
    fresh, going = expected_wait(times, [Pending(20, False)] * 3, [], 4), expected_wait(times, busy[:3], [], 4)
    assert fresh is not None and going is not None and fresh >= 4 * times.first_high > going
    times.observe_tokens(10)  # answers end sooner than their limit: the estimate follows what was measured
    assert expected_wait(times, busy, [], 4) < full


def test_a_round_of_tokens_costs_what_the_measured_rounds_say():
    times = _measured()
    assert times.round_s(0) == 0.0 and times.round_s(4) == 4 * times.step_s  # no round measured: a step each
    for _ in range(3):
        times.observe_round(1, 0.040)
    assert abs(times.round_s(4) - 0.160) < 1e-9  # one size measured: proportional, as before
    for _ in range(3):
        times.observe_round(8, 0.103)  # the weights read once: eight tokens cost far less than eight rounds of one
    assert abs(times.round_s(1) - 0.040) < 1e-9 and abs(times.round_s(8) - 0.103) < 1e-9
    assert abs(times.round_s(4) - (0.040 + 3 * 0.063 / 7)) < 1e-9
    busy = [Pending(20, True)] * 8
    proportional = _measured()
    batched, alone = expected_wait(times, busy, [], 8), expected_wait(proportional, busy, [], 8)
    assert batched is not None and alone is not None and batched < alone / 2
    noisy = ServiceTimes(step_s=0.05, first_s=0.5)
    for n, t in ((2, 0.09), (6, 0.05)):  # bigger rounds measured faster (noise): every round costs the mean
        noisy.observe_round(n, t)
    assert abs(noisy.round_s(8) - 0.07) < 1e-9


def test_replayed_waits_are_scaled_by_how_admitted_waits_compared():
    times = _measured()
    top = WAIT_SCALE_RANGE[1]
    assert times.calibrated(None) is None and times.calibrated(2.0) == 2.0 * top  # nothing compared yet: cautious
    for _ in range(3):
        times.observe_wait(4.0, 6.0)
    assert times.wait_scale == top  # too few ratios to trust
    times.observe_wait(0.1, 5.0)  # a near-zero replay says nothing
    assert times.wait_scale == top
    for measured in (5.0, 5.0, 5.0, 5.0, 8.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0):
        times.observe_wait(4.0, measured)
    # the bound is on the slow waits: the scale follows a high quantile (1.5 and 2.0 among 1.25s), not the mean
    assert 1.5 <= times.wait_scale <= 2.0
    assert times.calibrated(6.0) == 6.0 * times.wait_scale
    for _ in range(40):  # older ratios age out, and the replay was pessimistic: the scale goes below 1
        times.observe_wait(4.0, 3.0)
    assert times.wait_scale == 0.75
    for _ in range(40):  # one odd stretch cannot blow the scale up without bound
        times.observe_wait(1.0, 100.0)
    assert times.wait_scale == 4.0


def test_a_cold_first_step_stands_only_until_a_warm_one_replaces_it():
    times = ServiceTimes()
    times.observe_first(6.0, cold=True)  # a server started without its warm-up: the first job loads what it uses
    assert times.first_cold and expected_wait(times, [], [], 4) == 6.0  # an estimate, the only one there is
    times.observe_first(0.3)
    assert not times.first_cold and times.first_s == 0.3 and times.first_dev == 0.0  # replaced, not averaged in
    times.observe_first(0.8)
    assert abs(times.first_s - 0.4) < 1e-9 and times.first_dev > 0  # warm steps average as before
    warm = ServiceTimes()
    warm.observe_first(6.0)  # measured after the warm-up answer: an estimate like any other
    warm.observe_first(0.3)
    assert warm.first_s > 4.0 and not warm.first_cold


def test_a_scheduler_without_warm_up_measures_its_first_job_as_cold(index: Path):
    rag = KVRag.open(index)
    scheduler = Scheduler(rag, max_active=1, max_wait=60.0)
    finished = threading.Semaphore(0)

    def ask() -> Job:
        job = Job([{"role": "user", "content": "Who designed the alpha reactor?"}], {"max_new_tokens": 3},
                  lambda event: finished.release() if isinstance(event, (Done, Failed)) else None)
        scheduler.submit(job)
        return job

    scheduler.start()
    try:
        assert ask().replayed_wait is None  # nothing measured yet
        assert finished.acquire(timeout=120)
        assert scheduler.times.first_cold  # what it measured loaded the model's first-use costs
        assert ask().replayed_wait is None  # a wait replayed from a cold step calibrates nothing
        assert finished.acquire(timeout=120)
        assert not scheduler.times.first_cold and scheduler.times.first_dev == 0.0  # the warm step replaced it
        assert ask().replayed_wait is not None
        assert finished.acquire(timeout=120)
    finally:
        scheduler.stop()
        rag.close()


def test_admission_keeps_headroom_below_the_bound():
    scheduler = Scheduler(None, max_active=1, max_wait=10.0)  # never started: submit only queues
    for _ in range(40):
        scheduler.times.observe_wait(1.0, 1.0)  # replayed waits measured as they were: scale 1
    replayed = iter([None, 0.9 * 10.0 * ADMIT_HEADROOM, 10.0 * (1 + ADMIT_HEADROOM) / 2])
    scheduler._expected_wait_locked = lambda ahead=None: next(replayed)  # type: ignore[method-assign]

    def job() -> Job:
        return Job([{"role": "user", "content": "q"}], {}, lambda event: None)

    scheduler.submit(job())  # alone: nothing measured to wait for
    scheduler.submit(job())  # within the headroom
    with pytest.raises(WaitTooLong, match="too close to the server's bound of 10 s") as refused:
        scheduler.submit(job())  # under the bound, but too close to it: measured waits scatter above
    assert refused.value.retry_after >= 1.0


def test_a_request_whose_wait_exceeds_the_bound_gets_429_with_retry_after(index: Path):
    import openai

    with ServeProcess(index, "--max-active", "1", "--max-wait", "0.5", "--max-hold", "0") as server:
        hog = threading.Thread(target=_post_quietly, args=(server.url, LONG), daemon=True)
        hog.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health").json()["active"] == 0:  # the long answer holds the only slot
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 8}, timeout=30)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_error"
        assert "expected wait" in error["message"] and int(refused.headers["Retry-After"]) >= 1
        assert error["message"].endswith("its place in line: 1; retry after "
                                         f"{refused.headers['Retry-After']} s")
        other = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 9}, timeout=30)
        assert other.status_code == 429 and "its place in line: 2" in other.json()["error"]["message"]
        again = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 8}, timeout=30)
        assert "its place in line: 1" in again.json()["error"]["message"]  # the same request keeps its place
        assert httpx.get(f"{server.url}/health").json()["waiting_line"] == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as raised:
            client.chat.completions.create(model="m", messages=LONG["messages"], max_tokens=8)  # type: ignore[arg-type]
        assert raised.value.response.headers["retry-after"]
        text = server.metrics()
        assert metric(text, 'kvrag_refused_total{reason="wait"}') >= 2
        assert metric(text, "kvrag_expected_wait_seconds") > 0.5
        assert metric(text, "process_resident_memory_bytes") > 0


def _busy(server: ServeProcess, hog_tokens: int) -> None:
    """Start a long answer and return once it holds the server's only slot."""
    threading.Thread(target=_post_quietly, args=(server.url, LONG | {"max_tokens": hog_tokens}), daemon=True).start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["active"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_request_over_the_bound_is_held_in_line_and_answered_once_admitted(index: Path):
    with ServeProcess(index, "--max-active", "1", "--max-wait", "0.5", "--max-hold", "120") as server:
        _busy(server, 600)
        started = time.monotonic()
        held = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 8}, timeout=150)
        assert held.status_code == 200, held.text
        waited = float(held.headers["X-Kvrag-Held"])
        assert 0 < waited <= time.monotonic() - started
        text = server.metrics()
        assert metric(text, "kvrag_held_total") == 1 and metric(text, "kvrag_held_seconds_total") == pytest.approx(
            waited, abs=1e-3)
        assert metric(text, 'kvrag_refused_total{reason="wait"}') == 0
        idle = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 4}, timeout=60)
        assert idle.status_code == 200 and float(idle.headers["X-Kvrag-Held"]) == 0  # nothing ahead: not held


def test_a_hold_that_runs_out_ends_in_429_and_a_client_gone_while_held_frees_its_place(index: Path):
    with ServeProcess(index, "--max-active", "1", "--max-wait", "0.5", "--max-hold", "1.5") as server:
        _busy(server, 3000)
        started = time.monotonic()
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 8}, timeout=60)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert 1.0 <= time.monotonic() - started < 10  # held about its 1.5 s first
        assert "its place in line: 1" in refused.json()["error"]["message"]
    with ServeProcess(index, "--max-active", "1", "--max-wait", "0.5", "--max-hold", "120") as server:
        _busy(server, 3000)
        with pytest.raises(httpx.TimeoutException):  # held behind the long answer: the client gives up
            httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 8}, timeout=1.0)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").json()["waiting_line"] != 0:
            assert time.monotonic() < deadline, "the abandoned request kept its place in the waiting line"
            time.sleep(0.1)
        assert 'status="499"' in server.metrics()


def test_a_client_timeout_frees_its_place_in_the_queue(index: Path):
    import openai

    with ServeProcess(index, "--max-active", "1", "--max-queue", "1", "--max-wait", "0") as server:
        hog = threading.Thread(target=_post_quietly, args=(server.url, LONG), daemon=True)
        hog.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health").json()["active"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):  # queued behind the long answer: the client gives up
            client.chat.completions.create(model="m", messages=LONG["messages"], max_tokens=8)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/health").json()["queue_depth"] != 0:
            assert time.monotonic() < deadline, "the abandoned request kept its place in the queue"
            time.sleep(0.05)
        with pytest.raises(httpx.TimeoutException):  # the one queue place is free again: queued, not refused
            httpx.post(f"{server.url}/v1/chat/completions", json=LONG | {"max_tokens": 4}, timeout=1.0)
        assert 'status="499"' in server.metrics()
