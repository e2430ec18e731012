"""A request's CPU work before the worker sees it, off the event loop and bounded.

Parsing a body (up to ``--max-request-bytes``), type-checking it, rendering
the prompt and the output constraint's preflight (JSON-schema checks, the
grammar compiled by llguidance) take from microseconds to about a second for
a hostile body. On the event loop, that second is a second in which
``/health`` is not answered and no other client's tokens are streamed. Every
generation route runs that work through :func:`off_loop`:

* on one of :data:`THREADS` threads (the event loop keeps the GIL's turn
  every few milliseconds of Python work; native steps such as ``json.loads``
  hold it for their own length, which the body bound limits);
* at most :data:`WAITING` more wait for a thread; past that, the request is
  refused at once with 503 ``server_busy`` (``Retry-After: 1``), so a flood
  of heavy bodies holds a bounded amount of memory and time.

There are two such lanes. A request whose body is at least
:data:`HEAVY_BYTES` takes the *heavy* lane, whose threads also run at a lower
CPU priority (``nice`` +:data:`HEAVY_NICE`, on Linux): a 10 MiB letter run or
a 30 MB schema takes seconds of CPU, and on a small machine those seconds
would otherwise delay the small requests queued behind them and the worker's
steps beside them (the soak's 1-token probe waited up to 5.4 s behind them:
``benchmarks/results/soak_hardening_2026-12-07_30min_quiet.json``). Other
requests take the *light* lane; neither waits for the other's threads.

The bounds of each step are those of the step itself (docs/protocol.md 1.1):
the body's size and nesting, the schema's subschemas, enum values and
references, the tools' preflight visits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from musegl_core.errors import unavailable
from musegl_core.http.request_log import CURRENT

T = TypeVar("T")

#: threads that run request preparation (two cores' worth: the machine's other work goes on)
THREADS = 2
#: a body of at least this many bytes is prepared on the heavy lane (an agent's turn with a long
#: history is a few hundred KB of JSON: it stays on the light lane)
HEAVY_BYTES = 1 << 20
#: how much lower the heavy lane's threads run (os.setpriority on their thread ids: Linux only)
HEAVY_NICE = 10
#: requests that may wait for one of those threads: above the default connection cap
#: (``--max-connections`` 1000), so a burst of ordinary requests queues here instead of failing
#: (200 streams at once met 503 with 64 places); the bodies waiting are already read, bounded by
#: the connections times ``--max-request-bytes``, so these places add no memory of their own
WAITING = 1024


class Lane:
    """:data:`THREADS` threads and :data:`WAITING` waiting places."""

    def __init__(self, threads: int = THREADS, waiting: int = WAITING, *, name: str = "musegl-prepare",
                 nice: int = 0):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=name,
                                           initializer=_lower_priority if nice else None,
                                           initargs=(nice,) if nice else ())
        self.capacity = threads + waiting
        self.held = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            if self.held >= self.capacity:
                raise unavailable(f"the server is busy preparing {self.held} other requests; retry in about 1 s",
                                  code="server_busy", retry_after=1)
            self.held += 1
        context = contextvars.copy_context()  # the request's record (request_log.CURRENT) goes along
        try:
            job = self.executor.submit(functools.partial(context.run, fn, *args, **kwargs))
        except BaseException:
            self._release()
            raise
        job.add_done_callback(self._release)  # when the work ends, even if its client is gone
        return await asyncio.wrap_future(job)

    def _release(self, _: Any = None) -> None:
        with self._lock:
            self.held -= 1


def _lower_priority(nice: int) -> None:
    """A heavy lane thread's initializer: run ``nice`` steps below the process (Linux applies a
    niceness per thread; elsewhere, or where it is not permitted, the thread runs as it is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError):
        pass


_LANES: dict[str, Lane] = {}


def lane(heavy: bool = False) -> Lane:
    """The process's light or heavy lane (made on first use)."""
    key = "heavy" if heavy else "light"
    if key not in _LANES:
        _LANES[key] = (Lane(name="musegl-prepare-heavy", nice=HEAVY_NICE) if heavy
                       else Lane(name="musegl-prepare-light"))
    return _LANES[key]


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a preparation lane (the heavy one when the current request's body
    is at least :data:`HEAVY_BYTES`); its result or its exception."""
    record = CURRENT.get()
    heavy = record is not None and record.body_bytes >= HEAVY_BYTES
    return await lane(heavy).run(fn, *args, **kwargs)
