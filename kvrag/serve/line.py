"""The waiting line: requests refused for the wait keep their place, in arrival order, for when they come back.

Contract: admission by expected wait (`kvrag.serve.admission`) refuses a request whose wait for a first token would
pass the bound, with a ``Retry-After``. Without a memory of who was refused, whoever retries just as capacity frees
is admitted, and a client can be refused again and again while newer ones are served. A `WaitingLine` gives each
refused request a place (`hold`), named by its ticket (`request_ticket`: the same request sent again has the same
one), at the end of the line. A place counts as work queued ahead of every later place and every new request
(`ahead`), so a newcomer is admitted only when the places before it fit under the bound too, and a place holder
that comes back is admitted once the places before it do (`release` frees its place). A place expires when its
holder does not come back within its ``Retry-After`` plus `GRACE_S`; the line holds at most ``max_places`` places
(beyond them a refused request gets none). Two clients sending byte-identical requests share one place. Nothing
here touches a clock: callers pass ``now`` (seconds, monotonic).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrag.serve.admission import Pending

GRACE_S = 10.0  # how long past its Retry-After a place waits for its holder to come back


@dataclass
class _Place:
    pending: Pending
    expires: float


def request_ticket(messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
    """The ticket of a chat request: a digest of its messages and options (a retry of it has the same one)."""
    text = json.dumps([list(messages), dict(options)], sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class WaitingLine:
    """Places of refused requests, in arrival order (see the module docstring)."""

    def __init__(self, max_places: int) -> None:
        if max_places < 0:
            raise ValueError(f"max_places must be >= 0, got {max_places}")
        self.max_places = max_places
        self._places: OrderedDict[str, _Place] = OrderedDict()

    def __len__(self) -> int:
        return len(self._places)

    def expire(self, now: float) -> None:
        """Drop the places whose holders did not come back in time."""
        for ticket in [t for t, place in self._places.items() if place.expires <= now]:
            del self._places[ticket]

    def ahead(self, ticket: str | None) -> list[Pending]:
        """The work of the places before ``ticket``'s, or of every place when it holds none."""
        out = []
        for held, place in self._places.items():
            if held == ticket:
                break
            out.append(place.pending)
        return out

    def position(self, ticket: str | None) -> int | None:
        """``ticket``'s place, 1 for the first, or None when it holds none."""
        for i, held in enumerate(self._places, 1):
            if held == ticket:
                return i
        return None

    def hold(self, ticket: str | None, pending: Pending, expires: float) -> int | None:
        """Keep ``ticket``'s place until ``expires`` (its place stays where it was, or is the last when new); its
        position, or None when it gets none (no ticket, or the line is full).
        """
        if ticket is None:
            return None
        place = self._places.get(ticket)
        if place is None:
            if len(self._places) >= self.max_places:
                return None
            self._places[ticket] = _Place(pending, expires)
        else:
            place.expires = max(place.expires, expires)
        return self.position(ticket)

    def release(self, ticket: str | None) -> None:
        """Free ``ticket``'s place (its request was admitted)."""
        if ticket is not None:
            self._places.pop(ticket, None)
