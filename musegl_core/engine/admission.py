"""The admission queue: requests accepted by the worker that do not run yet.

``--max-inflight-requests`` bounds the requests that *run* (hold a sequence
and KV blocks). A request that cannot run at once waits here, in arrival
order, holding no KV: for a running place, for a session slot that frees on
its own (an anonymous request's, or an evictable one with
``--evict-idle-sessions``), or for its named session's previous request.
``--max-queued-requests`` bounds the queue; a request that finds it full is
refused with 503 ``server_busy``. The engine (:mod:`musegl_core.engine.engine`)
owns the decisions; this module keeps the order, the bound, the wait times and
the estimate behind a refusal's ``Retry-After``.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Iterator

import attrs

from musegl_core.engine.request import PreparedRequest

#: departures (starts and cancellations) the Retry-After estimate looks back over
DEPARTURES_SEEN = 16


@attrs.define(eq=False)
class Queued:
    request: PreparedRequest
    since: float  # the clock when it entered the queue


class AdmissionQueue:
    """Requests waiting to run, first come first served (see the module docstring)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self._items: dict[str, Queued] = {}  # insertion order is arrival order
        self._departures: collections.deque[float] = collections.deque(maxlen=DEPARTURES_SEEN)
        self.refused = 0  # requests refused because the queue was full
        self.admitted = 0  # requests that entered the queue (and did not start at once)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[Queued]:
        """The waiting requests in arrival order (a copy: the queue may change meanwhile)."""
        return iter(list(self._items.values()))

    def get(self, request_id: str) -> Queued | None:
        return self._items.get(request_id)

    def push(self, request: PreparedRequest) -> Queued:
        entry = self._items[request.id] = Queued(request, self.clock())
        return entry

    def take(self, request_id: str) -> float:
        """Remove a request that starts running or is cancelled; the seconds it waited."""
        entry = self._items.pop(request_id)
        now = self.clock()
        self._departures.append(now)
        return now - entry.since

    def refuse(self, request_id: str) -> None:
        """Remove a request that may not wait (the queue was over its bound)."""
        del self._items[request_id]
        self.refused += 1

    def drop(self, request_id: str) -> None:
        """Remove a request that failed while waiting (not a departure that frees a place in time)."""
        self._items.pop(request_id, None)

    @property
    def over(self) -> bool:
        return len(self._items) > self.limit

    def retry_after(self) -> int:
        """Seconds until a place in a full queue is expected to free: the mean gap
        between the recent departures, rounded up (at least 1; 1 before any)."""
        if len(self._departures) < 2:
            return 1
        span = self._departures[-1] - self._departures[0]
        gap = span / (len(self._departures) - 1)
        return max(1, math.ceil(gap))
