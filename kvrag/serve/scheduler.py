"""The one worker thread that owns the model: queued chat jobs, stepped round-robin one model step at a time.

Contract: `KVRag` is not thread-safe, so every call into it (``chat_stream`` and its generators'
``next()``, ``sessions.expect``/``release``) happens on `Scheduler`'s worker thread. `Scheduler.submit`
(any thread) queues a `Job` or raises `QueueFull` when ``max_queue`` jobs already wait for a slot (the
queue is bounded, never unbounded memory) or, with ``max_wait`` set, `WaitTooLong` when the job's expected
wait for its first token exceeds it (`kvrag.serve.admission`, from the step times the worker measures, scaled by
how admitted jobs' measured waits compared with their expected ones); both
carry ``retry_after``, the seconds after which a retry may be admitted. A job refused for its wait keeps a place
in a `kvrag.serve.line.WaitingLine` (by its ``ticket``, up to ``max_queue`` places): the places count as work
ahead of later requests, so refused requests are admitted in the order they first came, and ``retry_after``
reflects the place. A cancelled job no longer counts.
The worker keeps up to ``max_active`` jobs' ``chat_stream``
generators and calls ``next()`` on each in turn, so concurrent conversations all progress; before each round it
runs the decoding steps the answers announced as one pass (`kvrag.generation.step_batch`). With
``prefill_chunk_tokens`` set, a job's first step (its fusion or prefill) hands the worker back after each slice
of that many tokens' work and as its fusion begins (`kvrag.fusion.slicing`), and the worker runs one round of the
answers already decoding before the next slice, so their tokens keep flowing, and a new round begins after it
(the others' next steps were announced between its slices: they run as one pass, not one by one); the slices
compute what the whole pass would. A job waiting
for a slot has had ``rag.sessions.expect(messages)`` called (its history is prefetched and kept from
eviction), and every job, however it ends, has ``rag.sessions.release(messages)`` called once.

A job reports through its ``emit`` callback, from the worker thread, in order: zero or more
``Piece(text)`` then exactly one ``Done(answer, queue_s, finish_reason)`` or ``Failed(error)``. ``emit`` must not
block or raise (the app hands events to its event loop with ``call_soon_threadsafe``). A job whose
``cancel()`` was called (its client went away) has its generator closed at the next step and emits
nothing more. `Scheduler.stop` fails the jobs still waiting or active with `ServerStopping`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from kvrag.config import PREFILL_SLICE_INTERVAL_S
from kvrag.fusion import slicing
from kvrag.generation import step_batch
from kvrag.serve.admission import Pending, ServiceTimes, admit_limit, expected_wait
from kvrag.serve.jobs import Done, Event, Failed, Job, Piece, QueueFull, ServerStopping, WaitTooLong
from kvrag.serve.line import GRACE_S, WaitingLine

if TYPE_CHECKING:
    from kvrag.query.answer import Answer
    from kvrag.rag import KVRag

__all__ = ["Done", "Event", "Failed", "Job", "Piece", "QueueFull", "Scheduler", "ServerStopping", "WaitTooLong"]

log = logging.getLogger(__name__)


class Scheduler:
    """Serve chat jobs on one worker thread, interleaving up to ``max_active`` of them token by token.

    Args:
        rag: the opened `KVRag`; only the worker thread touches it once `start` is called.
        max_active: how many conversations generate at once (round-robin, one step each in turn).
        max_queue: how many more may wait for a slot; beyond that `submit` raises `QueueFull`.
        max_wait: the longest expected wait for a first token a job is admitted with (seconds; None: no bound);
            beyond it `submit` raises `WaitTooLong`.
        prefill_chunk_tokens: the tokens' worth of fusion or prefill work run between two rounds of the decoding
            answers (None: a first step runs whole).
        slice_interval_s: a slice ends only once this many seconds passed since the decoding answers' last round.
    """

    def __init__(self, rag: KVRag, max_active: int = 8, max_queue: int = 64, max_wait: float | None = None,
                 prefill_chunk_tokens: int | None = None, slice_interval_s: float = PREFILL_SLICE_INTERVAL_S) -> None:
        if max_active < 1 or max_queue < 0 or (max_wait is not None and not max_wait > 0):
            raise ValueError(f"max_active must be >= 1, max_queue >= 0 and max_wait > 0 (or None), got "
                             f"{max_active}, {max_queue}, {max_wait}")
        self.rag, self.max_active, self.max_queue, self.max_wait = rag, max_active, max_queue, max_wait
        self._slicer = (slicing.Slicer(prefill_chunk_tokens, self._between_slices, slice_interval_s)
                        if prefill_chunk_tokens else None)
        self._stepping: Job | None = None  # the job whose next() runs now
        self._sliced_s = 0.0  # seconds the stepping job's next() spent running other jobs' steps between slices
        self.times = ServiceTimes()  # written by the worker thread, read by submitters
        self._lock = threading.Condition()
        self._line = WaitingLine(max_queue)  # refused for their wait, by ticket, in arrival order
        self._arrived: deque[Job] = deque()  # submitted, not yet seen by the worker (no expect() yet)
        self._waiting: deque[Job] = deque()  # seen by the worker (expect() called), waiting for a slot
        self._active: list[Job] = []
        self._batch = step_batch.StepBatch()  # the active answers' decoding steps, one pass a round
        self._batch_share = 0.0  # seconds of the last round's pass per step it computed
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvrag-serve-worker", daemon=True)

    # -- any thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def warm_up(self, question: str, k: int, tokens: int = 4) -> None:
        """Answer ``question`` before `start` (loading what loads on first use), then again, taking its step times
        as the first measurements, so that admission by expected wait holds from the first request on.
        """
        assert not self._thread.is_alive(), "warm_up runs before the worker starts"
        try:
            self.rag.answer(question, k=k, max_new_tokens=1)  # loads the embedder, fills caches: not measured
            began = time.perf_counter()
            answer = self.rag.answer(question, k=k, max_new_tokens=tokens)
        except Exception as exc:  # the server still serves; admission waits for its own measurements
            log.warning("the warm-up answer failed (%s); admission by wait starts after the first request", exc)
            return
        took, ttft = time.perf_counter() - began, float(getattr(answer, "ttft_s", 0.0) or 0.0)
        first = ttft if 0.0 < ttft <= took else took
        self.times.observe_first(first)
        self.times.observe_step((took - first) / max(len(answer.token_ids) - 1, 1))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker: jobs still waiting or active fail with `ServerStopping`."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises `QueueFull` when ``max_queue`` jobs wait already, `ServerStopping` after `stop`."""
        with self._lock:
            if self._stopping or (self._thread.ident is not None and not self._thread.is_alive()):
                raise ServerStopping("the server is shutting down")
            now = time.monotonic()
            self._line.expire(now)
            ahead = self._line.ahead(job.ticket)  # the places of requests refused before this one
            replayed = self._expected_wait_locked(ahead)
            wait = self.times.calibrated(replayed)
            if self._queued_locked() >= self.max_queue + max(0, self.max_active - len(self._active)):
                raise QueueFull(f"{self.max_queue} requests are already waiting", max(wait or 1.0, 1.0))
            # alone, a job waits for nothing but itself; a cancelled one ends at its next step
            busy = any(not job.cancelled for job in self._active) or self._queued_locked() > 0 or bool(ahead)
            limit = admit_limit(self.max_wait) if self.max_wait is not None else None
            if limit is not None and wait is not None and wait > limit and busy:
                retry = max(wait - limit, 1.0)
                place = self._line.hold(job.ticket, job.pending(), now + retry + GRACE_S)
                kept = f"; its place in line: {place}" if place is not None else ""
                raise WaitTooLong(f"its expected wait for a first token, {wait:.1f} s, is too close to the server's "
                                  f"bound of {self.max_wait:g} s{kept}", retry, place)
            self._line.release(job.ticket)
            job.replayed_wait = None if self.times.first_cold else replayed  # a cold estimate calibrates nothing
            self._arrived.append(job)
            self._lock.notify_all()

    def leave_line(self, ticket: str | None) -> None:
        """Free ``ticket``'s place in the waiting line (its client went away while held)."""
        with self._lock:
            self._line.release(ticket)

    def _queued_locked(self) -> int:
        return sum(not job.cancelled for queue in (self._arrived, self._waiting) for job in queue)

    def _expected_wait_locked(self, ahead: list[Pending] | None = None) -> float | None:
        """The replayed wait of a job submitted now, behind ``ahead`` (places in the line) as well as the queue."""
        queued = [job.pending() for queue in (self._waiting, self._arrived) for job in queue if not job.cancelled]
        queued += ahead or []
        active = [job.pending() for job in self._active if not job.cancelled]  # a cancelled one ends at its next step
        return expected_wait(self.times, active, queued, self.max_active)

    def expected_wait(self) -> float | None:
        """Seconds a request submitted now would wait for its first token (None before anything was measured)."""
        with self._lock:
            return self.times.calibrated(self._expected_wait_locked(self._line.ahead(None)))

    def batched_steps(self) -> int:
        """Token steps run in a pass shared with other answers, since the worker started."""
        return self._batch.batched_steps

    def line_length(self) -> int:
        """Places held in the waiting line by refused requests that may come back."""
        with self._lock:
            self._line.expire(time.monotonic())
            return len(self._line)

    def queue_depth(self) -> int:
        """Requests waiting for a slot (not yet generating)."""
        with self._lock:
            return self._queued_locked()

    def active_count(self) -> int:
        """Requests generating now."""
        with self._lock:
            return len(self._active)

    # -- the worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with step_batch.installed(self._batch), slicing.installed(self._slicer):
                while self._take_arrivals():
                    self._admit()
                    self._run_batch()
                    if self._slicer is not None:  # the decoding answers get their tokens now: slices count from here
                        self._slicer.reset()
                    for job in list(self._active):
                        handed_back = self.prefill_slices()
                        self._step(job)
                        if self.prefill_slices() != handed_back:
                            break  # the others stepped between its slices: a new round batches their next steps
        except BaseException:  # a bug here must not leave requests hanging: fail them all, then stop
            log.exception("the serve worker failed")
            raise
        finally:
            self._fail_all(ServerStopping("the server is shutting down"))

    def _run_batch(self) -> None:
        """The active answers' announced decoding steps in one pass; each batched step's share of its time is
        counted in the step time of its job (`_step`).
        """
        began = time.perf_counter()
        computed = self._batch.run()
        self._batch_share = (time.perf_counter() - began) / computed if computed else 0.0
        self._record_rounds()

    def _record_rounds(self) -> None:
        """The token rounds run since the last call (together or alone), for admission's cost of a round."""
        rounds = self._batch.take_rounds()
        if rounds:
            with self._lock:  # submitters read the rounds under the lock
                for answers, seconds in rounds:
                    self.times.observe_round(answers, seconds)

    def prefill_slices(self) -> int:
        """How many times a fusion or prefill handed the worker back to the decoding answers, since it started."""
        return self._slicer.hand_backs if self._slicer is not None else 0

    def _between_slices(self) -> None:
        """Between two slices of the stepping job's first step: one round of the answers already decoding (their
        batched steps, then a token each), with ``rag.last_answer`` as the stepping job left it.
        """
        began = time.perf_counter()
        stepping, sliced, had = self._stepping, self._sliced_s, self.rag.last_answer
        try:
            self._run_batch()
            for job in list(self._active):
                if job is not stepping and job.steps > 0:
                    self._step(job)
        finally:
            self.rag.last_answer = had
            self._stepping = stepping  # the steps above set their own
            self._sliced_s = sliced + time.perf_counter() - began

    def _take_arrivals(self) -> bool:
        """Wait for work; move new jobs to the waiting line, announcing each to the session cache, and drop
        the waiting jobs whose clients went away.
        """
        with self._lock:
            while not (self._stopping or self._arrived or self._waiting or self._active):
                self._lock.wait()
            if self._stopping:
                return False
            arrived = list(self._arrived)
            self._arrived.clear()
            self._waiting.extend(arrived)  # still counted as queued while they are announced
            gone = [job for job in self._waiting if job.cancelled]
            for job in gone:
                self._waiting.remove(job)
        for job in arrived:
            self._sessions("expect", job)
        for job in gone:
            self._sessions("release", job)
        return True

    def _admit(self) -> None:
        while True:
            with self._lock:
                if len(self._active) >= self.max_active or not self._waiting:
                    return
                job = self._waiting.popleft()
            if job.cancelled:
                self._sessions("release", job)
                continue
            job.started = time.perf_counter()
            try:
                job._stream = iter(self.rag.chat_stream(job.messages, **job.kwargs))
            except Exception as exc:  # bad arguments refused before the generator exists
                self._finish(job, Failed(exc))
                continue
            with self._lock:
                self._active.append(job)

    def _step(self, job: Job) -> None:
        """One ``next()`` on ``job``'s generator (its first does retrieval, fusion and the first token)."""
        assert job._stream is not None
        if job.cancelled:
            self._close(job)
            self._finish(job, None)
            return
        before = self.rag.last_answer
        self._stepping, self._sliced_s = job, 0.0
        began = time.perf_counter()
        try:
            piece = next(job._stream)
        except StopIteration as stop:
            self._note_answer(job, before)
            if stop.value is not None:  # a generator that returns its Answer
                job.answer = stop.value
            if job.answer is not None:
                self.times.observe_tokens(len(job.answer.token_ids))
            queue_s = job.started - job.submitted if job.started else 0.0
            self._finish(job, Done(job.answer, queue_s, self._finish_reason(job)))
            return
        except Exception as exc:
            self._close(job)
            self._finish(job, Failed(exc))
            return
        took = time.perf_counter() - began - self._sliced_s  # other jobs' steps between slices are theirs
        self._record_rounds()
        if job.steps == 0:
            # nothing measured before: no warm-up answer ran, so this first step loaded what loads on first use
            self.times.observe_first(took, cold=self.times.first_s is None)
            with self._lock:  # submitters read the ratios under the lock
                self.times.observe_wait(job.replayed_wait, time.perf_counter() - job.submitted)
        else:
            self.times.observe_step(took + self._batch_share)
        job.steps += 1
        self._note_answer(job, before)
        if piece:
            job.emit(Piece(piece))

    def _note_answer(self, job: Job, before: Answer | None) -> None:
        """``rag.last_answer`` is shared by the interleaved generators: keep it for the job whose step set it."""
        after = self.rag.last_answer
        if after is not None and after is not before:
            job.answer = after

    def _finish_reason(self, job: Job) -> str:
        """``"length"`` when the answer used every token it was allowed and no stop string cut it."""
        answer, limit = job.answer, job.kwargs.get("max_new_tokens")
        if answer is None or limit is None or len(answer.token_ids) < limit:
            return "stop"  # EOS ends an answer before the limit (it is not among the token ids)
        stops = job.kwargs.get("stop") or ()
        tokenizer = self.rag.lm.tokenizer
        if stops:
            text = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
            if any(stop in text for stop in stops):  # the last token completed a stop string
                return "stop"
        return "length"

    @staticmethod
    def _close(job: Job) -> None:
        try:
            if job._stream is not None and hasattr(job._stream, "close"):
                job._stream.close()
        except Exception:  # closing must never wedge the worker
            log.exception("closing a chat stream failed")

    def _finish(self, job: Job, event: Event | None) -> None:
        with self._lock:
            if job in self._active:
                self._active.remove(job)
        self._sessions("release", job)
        if event is not None and not job.cancelled:
            job.emit(event)

    def _sessions(self, method: str, job: Job) -> None:
        """``rag.sessions.expect``/``release`` for ``job``'s messages; a failure there only costs the prefetch."""
        sessions = self.rag.sessions
        try:
            (sessions.expect if method == "expect" else sessions.release)(job.messages)
        except Exception as exc:  # e.g. messages the chat call will refuse itself, with the reason
            log.warning("rag.sessions.%s failed: %s", method, exc)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs = [*self._active, *self._waiting, *self._arrived]
            seen = set(map(id, self._active)) | set(map(id, self._waiting))
            self._active.clear()
            self._waiting.clear()
            self._arrived.clear()
        for job in jobs:
            self._close(job)
            if id(job) in seen:
                self._sessions("release", job)
            if not job.cancelled:
                job.emit(Failed(error))
