"""The waiting line of `kvrag serve` (`kvrag.serve.line`): requests refused for their wait are admitted in the
order they first came, a newcomer does not pass them, ``Retry-After`` grows with the place, and places expire.
"""

from __future__ import annotations

import pytest

from kvrag.serve.admission import Pending
from kvrag.serve.line import WaitingLine, request_ticket
from kvrag.serve.scheduler import Job, Scheduler, WaitTooLong


def test_a_ticket_names_a_request_and_its_options():
    talk = [{"role": "user", "content": "Who designed the reactor?"}]
    assert request_ticket(talk, {"k": 4, "max_new_tokens": 8}) == request_ticket(list(talk), {"max_new_tokens": 8,
                                                                                              "k": 4})
    assert request_ticket(talk, {"k": 4}) != request_ticket(talk, {"k": 5})
    assert request_ticket(talk, {}) != request_ticket([{"role": "user", "content": "Who built it?"}], {})


def test_places_keep_their_order_expire_and_are_bounded():
    line = WaitingLine(max_places=2)
    work = Pending(8, False)
    assert line.hold(None, work, 5.0) is None  # no ticket: no place
    assert line.hold("a", work, 5.0) == 1 and line.hold("b", work, 5.0) == 2
    assert line.hold("c", work, 5.0) is None  # the line is full
    assert line.hold("a", work, 9.0) == 1  # coming back keeps the place and its time
    assert line.ahead("b") == [work] and line.ahead("a") == [] and len(line.ahead(None)) == 2
    line.expire(6.0)  # b did not come back in time; a did
    assert line.position("b") is None and line.position("a") == 1
    line.release("a")
    assert len(line) == 0
    with pytest.raises(ValueError, match="max_places"):
        WaitingLine(-1)


def _job(ticket: str) -> Job:
    return Job([{"role": "user", "content": ticket}], {"max_new_tokens": 10}, lambda event: None, ticket=ticket)


def test_requests_refused_for_their_wait_are_admitted_in_the_order_they_came():
    scheduler = Scheduler(None, max_active=1, max_wait=10.0)  # never started: submit only queues
    scheduler.times.observe_first(5.0)
    scheduler.times.observe_step(0.05)
    for _ in range(40):
        scheduler.times.observe_wait(1.0, 1.0)  # replayed waits measured as they were: scale 1
    scheduler.submit(_job("x"))  # alone
    refusals = {}
    for ticket in ("a", "b"):
        with pytest.raises(WaitTooLong, match="place in line") as refused:
            scheduler.submit(_job(ticket))
        refusals[ticket] = refused.value.retry_after
    assert refusals["b"] > refusals["a"]  # Retry-After says when each place comes
    assert scheduler.line_length() == 2
    scheduler._arrived.clear()  # x is served: the worker is free
    for ticket, place in (("c", 3), ("b", 2)):  # a newcomer queues behind both; b is still behind a
        with pytest.raises(WaitTooLong, match=f"its place in line: {place}$"):
            scheduler.submit(_job(ticket))
    scheduler.submit(_job("a"))  # the first refused is the first admitted
    assert [job.ticket for job in scheduler._arrived] == ["a"] and scheduler.line_length() == 2
