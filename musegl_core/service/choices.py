"""``n`` choices of one response: n worker requests that share the prompt's KV.

A request with ``n`` > 1 becomes n worker requests with the same prompt
(:func:`choice_requests`): choice 0 keeps the response's id, choice ``i``
gets ``<id>-<i>`` and, when the request has a ``seed``, the seed ``seed + i``
(without one, every choice draws its own random seed in the worker).

:class:`ChoiceGroup` runs them. :meth:`~ChoiceGroup.open` submits choice 0
and waits for its ``Started``: its prefill is done and the engine has
published the prompt's full KV blocks to the automatic prefix cache, so the
other choices, submitted only then, adopt those blocks and prefill just the
last partial block (copy-on-write is the engine's). With
``--no-prefix-caching`` they prefill the whole prompt each.
:meth:`~ChoiceGroup.open` returns once *every* choice has started; if any is
refused (``server_busy``, ``session_capacity``, a context overflow) or the
preflight timeout passes, every request already submitted is cancelled and
the error is raised, so a response is never a partial 200.
:meth:`~ChoiceGroup.events` then yields ``(index, event)`` as the events
arrive; :meth:`~ChoiceGroup.close` cancels every choice that has not
finished (client disconnect, an error in another choice).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any, AsyncIterator

import attrs

from musegl_core.errors import ApiError, unavailable
from musegl_core.worker import messages as m

SEED_MODULUS = 2**64
SEED_MAX = 2**64 - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` (kept in the 64-bit range the
    API accepts; the sampler reads seeds modulo 2**64, so wrapping changes nothing)."""
    if seed is None:
        return None
    value = seed + index
    return value - SEED_MODULUS if value > SEED_MAX else value


def choice_requests(generate: m.Generate, n: int) -> list[m.Generate]:
    """The worker requests of ``n`` choices of ``generate``; with ``n`` > 1 each names
    choice 0's id as its ``group`` (the engine admits them together)."""
    if n > 1:
        generate = attrs.evolve(generate, group=generate.id)
    requests = [generate]
    for index in range(1, n):
        sampling = attrs.evolve(generate.sampling, seed=choice_seed(generate.sampling.seed, index))
        requests.append(attrs.evolve(generate, id=f"{generate.id}-{index}", sampling=sampling))
    return requests


def preflight_timeout_error(timeout: float | None) -> ApiError:
    """503 ``preflight_timeout``; its ``Retry-After`` is the timeout itself: the request waited
    that long without starting, so a retry any sooner would most likely meet the same queue."""
    return unavailable(f"generation did not start within --streaming-preflight-timeout ({timeout} s)",
                       code="preflight_timeout", retry_after=max(1, math.ceil(timeout or 1)))


class ChoiceGroup:
    """The worker requests of one response's choices (see the module docstring).

    ``worker`` is anything with the :meth:`WorkerClient.generate
    <musegl_core.worker.client.WorkerClient.generate>` contract.
    """

    def __init__(self, worker: Any, requests: list[m.Generate]):
        self.worker = worker
        self.requests = requests
        self._contexts: dict[int, contextlib.AbstractAsyncContextManager] = {}
        self._events: dict[int, AsyncIterator[m.Event]] = {}
        self._pumps: list[asyncio.Task] = []
        self._merged: asyncio.Queue = asyncio.Queue()
        #: per choice, the ``Admitted`` / ``Started`` events :meth:`open` read
        self.admitted: dict[int, m.Admitted] = {}
        self.started: dict[int, m.Started] = {}

    @property
    def n(self) -> int:
        return len(self.requests)

    async def open(self, timeout: float | None = None, until: str = "started") -> None:
        """Submit every choice and wait until each has started (``until="admitted"``:
        until the worker admitted it, prefill may still run; one choice only);
        raises :class:`ApiError` (everything submitted is cancelled first)."""
        if until not in ("started", "admitted") or (until == "admitted" and self.n != 1):
            raise ValueError(f"cannot open {self.n} choices until {until!r}")
        try:
            await asyncio.wait_for(self._start_all(until), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise preflight_timeout_error(timeout) from None
        except BaseException:
            await self.close()
            raise

    async def _start_all(self, until: str = "started") -> None:
        await self._start(0, until)  # its prompt blocks are in the prefix cache once it has started
        if self.n > 1:
            try:
                async with asyncio.TaskGroup() as group:  # one failure cancels (and awaits) the rest
                    for index in range(1, self.n):
                        group.create_task(self._start(index))
            except BaseExceptionGroup as failures:  # the client sees one error: an ApiError if any
                errors = failures.exceptions
                raise next((e for e in errors if isinstance(e, ApiError)), errors[0]) from None

    async def _start(self, index: int, until: str = "started") -> None:
        context = self.worker.generate(self.requests[index])
        events = await context.__aenter__()
        self._contexts[index] = context  # no await since __aenter__: close() always sees it
        self._events[index] = events
        while True:
            first = await anext(events)
            if isinstance(first, m.Admitted) and index not in self.admitted:
                self.admitted[index] = first
                if until == "admitted":
                    return
            elif isinstance(first, m.Started):
                self.started[index] = first
                return
            else:
                raise unavailable("the model worker sent an unexpected first event", code="worker_restarting")

    async def events(self) -> AsyncIterator[tuple[int, m.Event]]:
        """``(choice index, event)`` in arrival order, after :meth:`open`; ends
        once every choice is done. An error of any choice is raised (call
        :meth:`close` then: it cancels the others)."""
        assert len(self._events) == self.n, "open() first"
        self._pumps = [asyncio.ensure_future(self._pump(i, self._events[i])) for i in range(self.n)]
        remaining = self.n
        while remaining:
            index, item = await self._merged.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield index, item

    async def _pump(self, index: int, events: AsyncIterator[m.Event]) -> None:
        try:
            async for event in events:
                self._merged.put_nowait((index, event))
        except Exception as error:  # ApiError, or a bug: either way the response ends with it
            self._merged.put_nowait((index, error))
            return
        self._merged.put_nowait((index, None))

    async def close(self) -> None:
        """Leave every worker request, cancelling those not done. Runs in its own
        task, so that a cancelled response (client disconnect) still reaches the
        worker with every cancellation."""
        pumps, self._pumps = self._pumps, []
        contexts, self._contexts = list(self._contexts.values()), {}
        if not pumps and not contexts:
            return

        async def leave() -> None:
            for pump in pumps:
                pump.cancel()
            for pump in pumps:
                with contextlib.suppress(BaseException):
                    await pump
            for context in contexts:
                with contextlib.suppress(BaseException):
                    await context.__aexit__(None, None, None)

        task = asyncio.ensure_future(leave())
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)
