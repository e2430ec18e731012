"""The admission queue: requests accepted by the worker that do not run yet.

``--max-inflight-requests`` bounds the requests that *run* (hold a sequence
and KV blocks). A request that cannot run at once waits here, holding no KV:
for a running place, for a session slot that frees on its own (an anonymous
request's, or an evictable one with ``--evict-idle-sessions``), for KV blocks
that running requests give back when they end (blocks on demand: a request
reserves, when it starts, what it may still take to its end), or for its
named session's previous request. ``--max-queued-requests`` bounds the queue;
a request that finds it full is refused (``Busy``: 503 ``server_busy``).
Waiting requests start in a fair order (:meth:`AdmissionQueue.fair_order`):
round-robin over client keys, in arrival order within a client and within a
named session. :class:`AdmissionQueue` keeps the order, the bound, the wait
times and the estimate behind a refusal's ``Retry-After``; :class:`Admission`
decides, on the engine thread, which request starts when.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import attrs

from musegl_core.engine import errors
from musegl_core.engine.identity import prompt_keys
from musegl_core.engine.replay import Replayer
from musegl_core.engine.request import PreparedRequest
from musegl_core.engine.sessions import CapacityError, SaltMismatch, Session, SessionTable

#: departures (starts and cancellations) the Retry-After estimate looks back over
DEPARTURES_SEEN = 16


@attrs.define(eq=False)
class Queued:
    request: PreparedRequest
    since: float  # the clock when it entered the queue


class AdmissionQueue:
    """Requests waiting to run, a fair share per client key (see the module docstring)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self._items: dict[str, Queued] = {}  # insertion order is arrival order
        self._departures: collections.deque[float] = collections.deque(maxlen=DEPARTURES_SEEN)
        self.refused = 0  # requests refused because the queue was full
        self.admitted = 0  # requests that entered the queue (and did not start at once)
        self._starts = 0  # requests started from the queue
        self._last_start: dict[str | None, int] = {}  # per client key, the ordinal of its last start

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[Queued]:
        """The waiting requests in arrival order (a copy: the queue may change meanwhile)."""
        return iter(list(self._items.values()))

    def fair_order(self) -> list[Queued]:
        """The waiting requests in the order admission considers them: round-robin
        over client keys (:attr:`~musegl_core.engine.request.RequestOptions.client`),
        the client that started a request least recently first (one that never did
        before any that did; ties by its oldest waiting request), and in arrival order
        within a client. So one client's many requests cannot hold back another's.
        A request behind an earlier one of its named session takes no turn: it comes
        last (a session's requests run in arrival order, whoever sent them)."""
        first = self.first_of_sessions()
        by_client: dict[str | None, list[Queued]] = {}
        behind: list[Queued] = []
        for entry in self._items.values():  # arrival order
            name = entry.request.session_id
            if name is not None and first[name] != entry.request.id:
                behind.append(entry)
            else:
                by_client.setdefault(entry.request.client, []).append(entry)
        clients = sorted(by_client, key=lambda c: self._last_start.get(c, -1))  # stable: by oldest waiting
        order: list[Queued] = []
        for turn in range(max((len(q) for q in by_client.values()), default=0)):
            order.extend(by_client[c][turn] for c in clients if turn < len(by_client[c]))
        return order + behind

    def first_of_sessions(self) -> dict[str, str]:
        """Per named session with waiting requests, the id of the one that arrived first."""
        first: dict[str, str] = {}
        for entry in self._items.values():
            name = entry.request.session_id
            if name is not None:
                first.setdefault(name, entry.request.id)
        return first

    def served(self, client: str | None) -> None:
        """Note that a request of ``client`` started (it goes to the back of the round)."""
        self._starts += 1
        self._last_start[client] = self._starts
        if len(self._last_start) > 4 * max(self.limit, 1):  # forget clients with nothing waiting
            waiting = {entry.request.client for entry in self._items.values()}
            self._last_start = {c: n for c, n in self._last_start.items() if c in waiting}

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


@attrs.define(eq=False)
class Admission:
    """The engine's admission decisions (see the module docstring): a new request
    is checked, queued and started at once when it may run; :meth:`dispatch`
    starts queued requests as places and slots free.

    ``running`` is the engine's running requests by id (read here only);
    ``start(request, session, waited)`` makes a request run on its session (or returns
    the KV blocks it could not reserve; then nothing started),
    ``fail(request_id, error)`` reports a refusal. ``due`` is set by the engine when
    something finished or freed a slot: the queue is to be looked at again."""

    config: Any  # the EngineConfig: max_context, max_inflight_requests, max_queued_requests
    sessions: SessionTable
    replayer: Replayer
    running: Mapping[str, object]
    start: Callable[[PreparedRequest, Session, float], "int | None"]
    fail: Callable[[str, errors.EngineError], None]
    queue: AdmissionQueue = attrs.field(init=False)  # admitted, not running
    due: bool = False

    def __attrs_post_init__(self) -> None:
        self.queue = AdmissionQueue(self.config.max_queued_requests)

    def admit(self, request: PreparedRequest) -> None:
        """Check a new request, queue it, and start it at once when it may run; a
        request that has to wait in a full queue is refused (:class:`~musegl_core.engine.errors.Busy`)."""
        config = self.config
        if request.id in self.running or request.id in self.queue:
            self.fail(request.id, errors.DuplicateId(request.id))
            return
        prompt = len(request.prompt_ids)
        reservation = request.completion_reservation
        if prompt + reservation > config.max_context:
            self.fail(request.id, errors.ContextTooLong(prompt, reservation, config.max_context))
            return
        self.queue.push(request)
        self.link(request)
        self.dispatch()
        if request.id not in self.queue:
            return  # started, or failed for a reason of its own
        if self.queue.over:  # queue overload never evicts a session
            self.unlink(request)
            self.queue.refuse(request.id)
            self.fail(request.id, errors.Busy(len(self.running), len(self.queue), self.queue.retry_after()))
            return
        self.queue.admitted += 1

    def dispatch(self) -> None:
        """Start the queued requests that may run now, in :meth:`AdmissionQueue.fair_order`: while a running
        place is free, each one whose session is not busy with an earlier request and
        that gets a session slot. One that waits for a slot that will never free on its
        own fails (:class:`~musegl_core.engine.errors.NoSessionSlot`) instead of waiting for ever;
        so does one whose KV blocks cannot be reserved while nothing runs that would give
        any back (its message names the numbers)."""
        self.due = False
        slots_full = False  # once a new slot was refused, later requests needing one wait too
        kv_full = False  # once a request's KV blocks were refused, later requests wait too (in order)
        first_of_session = self.queue.first_of_sessions()
        for entry in self.queue.fair_order():
            if len(self.running) >= self.config.max_inflight_requests:
                return
            request = entry.request
            if request.id not in self.queue:
                continue
            name = request.session_id
            earlier = first_of_session.get(name) if name is not None else None
            if earlier is not None and earlier != request.id and earlier in self.queue:
                continue  # a session's requests run in arrival order, whoever sent them
            existing = self.sessions.named.get(name) if name is not None else None
            if request.soft_session and not self.soft_fits(request, existing, slots_full):
                self.unlink(request)  # it runs anonymously, on the prefix cache
                request = attrs.evolve(request, session_id=None, soft_session=False, replay=None)
                name = existing = None
            if existing is not None and existing.active:
                self.link(request)  # it waits for the session's running request
                continue
            if (existing is None and slots_full) or kv_full:
                continue
            try:
                session, created = self.sessions.open(name, request.cache_salt, soft=request.soft_session,
                                                      group=request.group)
            except SaltMismatch as exc:
                self.unqueue(request)
                self.fail(request.id, errors.salt_mismatch(exc))
                continue
            except CapacityError as exc:
                if self.slot_frees_later(anonymous=name is None):
                    slots_full = True
                    continue  # it waits for a slot
                self.unqueue(request)
                self.fail(request.id, errors.capacity_error(exc, self.sessions))
                continue
            lacking = self.start(request, session, self.queue.clock() - entry.since)
            if lacking is not None:  # the pool has not the blocks it may take to its end
                if created and (session.name is None or not session.confirmed):
                    self.sessions.drop(session)  # a new session holds nothing worth keeping
                on_demand = getattr(self.sessions, "on_demand", None)
                if self.running and not (on_demand is not None and on_demand.never):
                    kv_full = True  # a running request gives blocks back when it ends
                    continue
                self.unqueue(request)
                self.fail(request.id, errors.NoSessionSlot(self.sessions.kv_shortfall(lacking)))
                continue
            self.unlink(request)
            self.queue.take(request.id)
            self.queue.served(request.client)

    def soft_fits(self, request: PreparedRequest, session: Session | None, slots_full: bool) -> bool:
        """May a soft-session request run on its session? Not while the session
        is busy, and not when it is new and no slot is free (the request then runs
        anonymously rather than wait or fail). An idle session is used when the
        prompt extends its last executed prompt (after generated-token replay), or
        when the prompt is at least as long as the session's history: a soft
        session keeps the longest conversation that uses it, so a client's short
        side request never displaces its main conversation."""
        if session is None:
            return not slots_full and self.sessions.can_open_soft()
        if session.active or session.salt != request.cache_salt:
            return False
        keys = prompt_keys(request.prompt_ids, request.images)
        executed = session.replay.executed
        if session.clean and executed:
            plan = request.replay
            if plan is not None and plan.log is session.replay:
                replayed = plan.keys
            else:
                replayed, _ = self.replayer.apply(session.replay, keys)
            if tuple(replayed[: len(executed)]) == executed:
                return True
        return len(keys) >= len(session.tokens)

    def unqueue(self, request: PreparedRequest) -> None:
        self.unlink(request)
        self.queue.drop(request.id)

    def link(self, request: PreparedRequest) -> None:
        """Record a queued request on its existing named session (then not idle: never
        evicted, expired or closed under it, and counted in ``queued_requests``)."""
        session = self.sessions.named.get(request.session_id) if request.session_id else None
        if session is not None and not any(r is request for r in session.waiting):
            session.waiting.append(request)

    def unlink(self, request: PreparedRequest) -> None:
        session = self.sessions.named.get(request.session_id) if request.session_id else None
        if session is not None:
            for index, queued in enumerate(session.waiting):
                if queued is request:
                    del session.waiting[index]
                    return

    def slot_frees_later(self, anonymous: bool = False) -> bool:
        """Will a session slot free without a client's action? An anonymous request's
        does when it ends; with ``--evict-idle-sessions``, or for an anonymous request,
        so does a named session's, which turns evictable once its request ends. Named
        sessions otherwise persist."""
        table = self.sessions
        return (bool(table.anonymous) or any(s.active and s.soft for s in table.named.values())
                or ((table.evict_idle or anonymous) and any(s.active for s in table.named.values())))

    def cancel(self, request_id: str) -> None:
        """Take a queued request out of the queue (it holds no KV)."""
        entry = self.queue.get(request_id)
        if entry is not None:
            self.unlink(entry.request)
            self.queue.take(request_id)
            self.due = True  # a place behind it may run now (its session's next request)
