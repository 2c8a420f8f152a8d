"""Admission by expected wait: how long a request submitted now would wait for its first token, from measured
service times.

Contract: `ServiceTimes` keeps moving averages of what the worker thread measured: the seconds of a job's first step
(retrieval, fusion, prefill and the first token) and their mean deviation, of one later step (a token), and the
tokens a finished job generated; and the recent rounds of token steps as ``(answers, seconds)``, from which
`ServiceTimes.round_s` fits what a round of ``n`` answers' tokens costs (``a + b·n``: the steps of a round run as
one pass that reads the weights once, so a round of eight costs far less than eight rounds of one). First steps vary
(a short prompt is prefilled in full, a long one fused), and the bound is on the slow ones, so a first step counts
as its mean plus twice its deviation (`first_high`). A server started without its warm-up answer measures its first
job's first step cold (the embedder, the decoder's compiled code and the caches load on first use, seconds that no
later first step pays): that measurement is the estimate only until the first warm one replaces it, and waits
replayed from it give no ratio (`first_cold`). `expected_wait(times, active, queued, max_active)` replays the
worker over the jobs ahead (their first steps one after another, then rounds of a token each until a slot frees) and
returns the seconds until the new job's first token, or None while nothing has been measured. Each job is given as
the tokens it may still generate and whether its first step is done. The replay misses what it does not model (later
turns' longer prompts, first steps sliced between rounds, the event loop), so `ServiceTimes` also keeps the ratios
of admitted jobs' measured waits to their replayed ones (`observe_wait`), and `calibrated` scales a replayed wait by
a high quantile of them (`WAIT_QUANTILE` of the last `WAIT_SAMPLES`; the range's top before any were measured): the
bound is on the slow waits, not the mean. `admit_limit`: the longest such wait admitted, `ADMIT_HEADROOM` of the
bound.
Nothing here touches the model, FastAPI or a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SMOOTHING = 0.2  # the weight of each new measurement in the moving averages
WAIT_SAMPLES = 40  # the admitted jobs' wait ratios kept for `ServiceTimes.calibrated`
# the quantile of those ratios a replayed wait is scaled by: high, since the bound is on the slow waits, but not the
# top of 40, which is the one odd wait (at 0.99, three cold-start turns held the scale near 2.5 for a whole level)
WAIT_QUANTILE = 0.9
WAIT_MIN_SAMPLES = 4  # fewer ratios than this: replayed waits are scaled by the range's top (a cold start's burst)
WAIT_MIN_REPLAYED_S = 0.5  # a replayed wait shorter than this gives no ratio (noise over a near-zero)
WAIT_SCALE_RANGE = (0.5, 4.0)  # the scale stays within this, whatever a few odd waits say
ROUND_SAMPLES = 64  # the recent rounds `ServiceTimes.round_s` fits
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
        rounds: the last rounds of token steps, as ``(answers, seconds)``.
        first_cold: whether ``first_s`` is one cold first step, to be replaced by the first warm one.
    """

    first_s: float | None = None
    first_dev: float = 0.0
    step_s: float | None = None
    tokens: float | None = None
    wait_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_SAMPLES))
    rounds: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=ROUND_SAMPLES))
    first_cold: bool = False
    _round_fit: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)  # (a, b) of `round_s`

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

    def observe_first(self, seconds: float, cold: bool = False) -> None:
        """Record a first step's duration (without the other answers' steps run between its slices); ``cold``: it
        paid what loads on first use, and stands only until a warm one is measured (the module contract).
        """
        seconds = max(seconds, 0.0)
        if self.first_s is None or self.first_cold:  # the first measured, or the first warm one after a cold one
            self.first_cold = cold and self.first_s is None
            self.first_s, self.first_dev = seconds, 0.0
            return
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

    def observe_round(self, answers: int, seconds: float) -> None:
        """Record a round of token steps: ``answers`` tokens computed in one pass of ``seconds``; refit `round_s`
        (here, on the worker, not in each replay a submitter runs under the lock).
        """
        if answers <= 0:
            return
        self.rounds.append((answers, max(seconds, 0.0)))
        sizes, secs = [n for n, _ in self.rounds], [t for _, t in self.rounds]
        mean_n, mean_s = sum(sizes) / len(sizes), sum(secs) / len(secs)
        spread = sum((n - mean_n) ** 2 for n in sizes)
        slope = sum((n - mean_n) * (t - mean_s) for n, t in self.rounds) / spread if spread else 0.0
        if spread == 0:  # one size measured: proportional
            self._round_fit = (0.0, mean_s / mean_n)
        elif slope < 0:  # bigger rounds measured no slower: each round costs the mean
            self._round_fit = (mean_s, 0.0)
        elif mean_s - slope * mean_n < 0:  # no fixed cost: proportional to the tokens
            self._round_fit = (0.0, sum(secs) / sum(sizes))
        else:
            self._round_fit = (mean_s - slope * mean_n, slope)

    def round_s(self, answers: int) -> float:
        """Seconds of a round of ``answers`` tokens: ``a + b·answers`` fitted to the recorded rounds (least squares,
        neither term below zero); proportional to ``answers`` while the rounds recorded all had one size; ``answers``
        times the step before any round was recorded.
        """
        if answers <= 0:
            return 0.0
        if not self.rounds:
            return answers * (self.step_s if self.step_s is not None else (self.first_s or 0.0))
        base, slope = self._round_fit
        return base + slope * answers

    def tokens_left(self, job: Pending) -> int:
        """The tokens ``job`` is expected to generate still: its limit, or fewer as finished jobs measured."""
        return job.tokens if self.tokens is None else max(min(job.tokens, round(self.tokens)), 1)


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
    first = times.first_high
    # each job as [tokens left, first step pending]; a first step gives the job's first token
    running = [[times.tokens_left(job), not job.started] for job in active]
    waiting = [[times.tokens_left(job), not job.started] for job in queued]

    def fill() -> None:
        while waiting and len(running) < max_active:
            running.append(waiting.pop(0))

    fill()
    clock = 0.0
    while len(running) >= max_active:  # the new job waits for a slot: replay the worker until one frees
        for job in running:
            if job[1]:  # its first step
                clock += first
                job[0], job[1] = job[0] - 1, False
        live = [job for job in running if job[0] > 0]
        if len(live) == len(running):  # rounds of a token each until the shortest answer ends
            least = min(tokens for tokens, _ in live)
            clock += least * times.round_s(len(live))
            live = [[tokens - least, False] for tokens, _ in live if tokens > least]
        running = live
        fill()
    # the worker admits it after the round under way, then runs the first steps just begun and a round of the others'
    # tokens before its own first step
    pending = sum(first for _, starting in running if starting)
    return clock + pending + times.round_s(sum(not starting for _, starting in running)) + first


def admit_limit(max_wait: float) -> float:
    """The longest calibrated expected wait admitted under the bound ``max_wait`` (`ADMIT_HEADROOM` of it)."""
    return ADMIT_HEADROOM * max_wait
