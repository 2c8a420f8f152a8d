"""Admission by expected wait: how long a request submitted now would wait for its first token, from measured
service times.

Contract: `ServiceTimes` keeps moving averages of what the worker thread measured: the seconds of a job's first
step (retrieval, fusion, prefill and the first token) and their mean deviation, of one later step (a token), and
the tokens a finished job generated. First steps vary (a short prompt is prefilled in full, a long one fused), and
the bound is on the slow ones, so a first step counts as its mean plus twice its deviation (`first_high`).
`expected_wait(times, active, queued, max_active)` replays the worker's round-robin over the
jobs ahead (processor sharing: with ``n`` jobs active each gets ``1/n`` of the worker) and returns the seconds
until the new job's first token, or None while nothing has been measured. Each job is given as the tokens it may
still generate and whether its first step is done. The replay misses what it does not model (later turns' longer
prompts, batched steps' shared time, the event loop), so `ServiceTimes` also keeps the ratios of admitted jobs'
measured waits to their replayed ones (`observe_wait`), and `calibrated` scales a replayed wait by a high
quantile of them (`WAIT_QUANTILE` of the last `WAIT_SAMPLES`; the range's top before any were measured): the bound
is on the slow waits, not the mean. `admit_limit`: the longest such wait admitted, `ADMIT_HEADROOM` of the bound.
Nothing here touches the model, FastAPI or a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SMOOTHING = 0.2  # the weight of each new measurement in the moving averages
WAIT_SAMPLES = 40  # the admitted jobs' wait ratios kept for `ServiceTimes.calibrated`
WAIT_QUANTILE = 0.99  # the quantile of those ratios a replayed wait is scaled by: the bound is on the p99 wait
WAIT_MIN_SAMPLES = 4  # fewer ratios than this: replayed waits are scaled by the range's top (a cold start's burst)
WAIT_MIN_REPLAYED_S = 0.5  # a replayed wait shorter than this gives no ratio (noise over a near-zero)
WAIT_SCALE_RANGE = (0.5, 4.0)  # the scale stays within this, whatever a few odd waits say
# a job is admitted when its calibrated wait is within this fraction of the bound: measured waits scatter about the
# calibration, and the bound is on the slowest admitted (at 64 clients with the whole bound, 1 of 26 turns overran)
ADMIT_HEADROOM = 0.8


@dataclass(frozen=True)
class Pending:
    """A job ahead of the new one: the tokens it may still generate, and whether its first step is done."""

    tokens: int
    started: bool


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class ServiceTimes:
    """Moving averages of the worker's measured service times (the worker thread writes, submitters read).

    Attributes:
        first_s: seconds of a job's first step (retrieval, fusion, prefill, first token); None until measured.
        first_dev: the mean absolute deviation of the first steps' seconds.
        step_s: seconds of one later step (one token); None until measured.
        tokens: tokens a finished job generated; None until a job finished.
        wait_ratios: the last admitted jobs' measured waits for a first token over their replayed ones.
    """

    first_s: float | None = None
    first_dev: float = 0.0
    step_s: float | None = None
    tokens: float | None = None
    wait_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_SAMPLES))

    def observe_wait(self, replayed: float | None, measured: float) -> None:
        """Record an admitted job's measured wait for its first token against the wait replayed at admission."""
        if replayed is not None and replayed >= WAIT_MIN_REPLAYED_S:
            self.wait_ratios.append(max(measured, 0.0) / replayed)

    @property
    def wait_scale(self) -> float:
        """What a replayed wait is multiplied by: a high quantile of the measured-to-replayed ratios, and the top of
        `WAIT_SCALE_RANGE` until `WAIT_MIN_SAMPLES` were measured (a burst at a cold start is admitted cautiously:
        with scale 1, its first turns overran the bound before any ratio was known).
        """
        if len(self.wait_ratios) < WAIT_MIN_SAMPLES:
            return WAIT_SCALE_RANGE[1]
        ratios = sorted(self.wait_ratios)
        high = ratios[min(int(WAIT_QUANTILE * len(ratios)), len(ratios) - 1)]
        return min(max(high, WAIT_SCALE_RANGE[0]), WAIT_SCALE_RANGE[1])

    def calibrated(self, replayed: float | None) -> float | None:
        """A replayed wait scaled by `wait_scale` (None stays None)."""
        return None if replayed is None else replayed * self.wait_scale

    def observe_first(self, seconds: float) -> None:
        """Record a first step's duration."""
        seconds = max(seconds, 0.0)
        if self.first_s is not None:
            self.first_dev = _average(self.first_dev, abs(seconds - self.first_s))
        self.first_s = _average(self.first_s, seconds)

    @property
    def first_high(self) -> float:
        """A slow first step: the mean plus twice the mean deviation (0 before any was measured)."""
        return (self.first_s or 0.0) + 2 * self.first_dev

    def observe_step(self, seconds: float) -> None:
        """Record a later step's duration."""
        self.step_s = _average(self.step_s, max(seconds, 0.0))

    def observe_tokens(self, count: int) -> None:
        """Record how many tokens a finished job generated."""
        self.tokens = _average(self.tokens, float(max(count, 1)))

    def work(self, job: Pending) -> float:
        """The worker seconds ``job`` still needs: its first step unless done, then its expected tokens' steps."""
        first, step = self.first_high, self.step_s if self.step_s is not None else (self.first_s or 0.0)
        tokens = job.tokens if self.tokens is None else min(job.tokens, self.tokens)
        return (0.0 if job.started else first) + max(tokens - (0 if job.started else 1), 0) * step


def expected_wait(times: ServiceTimes, active: list[Pending], queued: list[Pending], max_active: int) -> float | None:
    """Seconds until a job submitted now gives its first token, or None before any first step was measured.

    Args:
        times: the measured service times.
        active: the jobs generating now.
        queued: the jobs waiting for a slot, in order (the new job comes after them).
        max_active: how many jobs generate at once.
    """
    if times.first_s is None:
        return None
    first, step = times.first_high, times.step_s if times.step_s is not None else times.first_s
    # each job as [work left, first-step work left]: a job's next step is its first (seconds) until that is done
    running = [[times.work(job), 0.0 if job.started else first] for job in active]
    waiting = [[times.work(job), 0.0 if job.started else first] for job in queued]

    def fill() -> None:
        while waiting and len(running) < max_active:
            running.append(waiting.pop(0))

    fill()
    clock = 0.0
    while len(running) >= max_active:  # the new job waits for a slot: replay processor sharing until one frees
        least = min(left for left, _ in running)
        clock += least * len(running)
        running = [[left - least, max(head - least, 0.0)] for left, head in running if left > least]
        fill()
    # the worker admits it after the round under way, then steps every job ahead of it once more before its first
    # step: the next step of each other job (a first step for those just begun), then a token each
    return clock + first + sum(head if head > 0 else step for _, head in running) + len(running) * step


def admit_limit(max_wait: float) -> float:
    """The longest calibrated expected wait admitted under the bound ``max_wait`` (`ADMIT_HEADROOM` of it)."""
    return ADMIT_HEADROOM * max_wait
