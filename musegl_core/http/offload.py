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

The bounds of each step are those of the step itself (docs/protocol.md 1.1):
the body's size and nesting, the schema's subschemas, enum values and
references, the tools' preflight visits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from musegl_core.errors import unavailable

T = TypeVar("T")

#: threads that run request preparation (two cores' worth: the machine's other work goes on)
THREADS = 2
#: requests that may wait for one of those threads: above the default connection cap
#: (``--max-connections`` 1000), so a burst of ordinary requests queues here instead of failing
#: (200 streams at once met 503 with 64 places); the bodies waiting are already read, bounded by
#: the connections times ``--max-request-bytes``, so these places add no memory of their own
WAITING = 1024


class Lane:
    """:data:`THREADS` threads and :data:`WAITING` waiting places."""

    def __init__(self, threads: int = THREADS, waiting: int = WAITING):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="musegl-prepare")
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


_LANE: Lane | None = None


def lane() -> Lane:
    """The process's lane (made on first use)."""
    global _LANE
    if _LANE is None:
        _LANE = Lane()
    return _LANE


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the preparation lane; its result or its exception."""
    return await lane().run(fn, *args, **kwargs)
